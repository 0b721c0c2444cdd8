"""Horovod-style collectives on the library's private communicator.

Naming grid (as Horovod): ``op`` returns a new tensor, ``op_`` works in place, ``op_async`` and
``op_async_`` return a ``Handle`` for ``poll``/``synchronize``. Inputs are torch tensors (CPU or
CUDA) or NumPy arrays; outputs are of the same kind and device.

Every operation is built in two halves: argument validation runs at once in the caller (bad
arguments raise ``ValueError``/``TypeError`` synchronously, on the rank that passed them), and a
``run`` closure does the MPI work, either inline or on the communication thread (``worker.py``).
Each ``run`` starts with the cross-rank agreement check (``consistency.py``), so a disagreement
raises ``MismatchError`` on every rank instead of a hang.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from mpi4py import MPI

from . import consistency, runtime
from .buffers import (FLOATING, HALF, contiguous, copy_into, dtype_name, empty_like,
                      fast_cpu_view, is_cuda, mpi_buffer, reduce_dtype, scale_, scaled_copy,
                      to_dtype)
from .exceptions import BaguaMPIError
from .ops import Average, ReduceOp, mpi_op
from .worker import Handle


# -- plumbing ----------------------------------------------------------------------------------

def _dispatch(rt, run, describe, asynchronous: bool, owned: tuple = ()):
    if asynchronous:
        for t in owned:
            if is_cuda(t):  # the comm thread reads device memory outside torch's stream order
                torch.cuda.current_stream(t.device).synchronize()
                break
        return rt.worker.submit(run, describe, owned)
    return rt.worker.run(run, describe)


def _check_factor(name: str, value, dtype: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value != 1.0 and dtype not in FLOATING:
        raise TypeError(f"{name}={value!r} needs a floating-point tensor, got {dtype}")
    return float(value)


def _check_root(root, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root_rank must be an integer in [0, {size}), got {root!r}")
    return int(root)


def _row_elems(shape) -> int:
    return int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1


def _copy(dst, src) -> None:
    """dst[...] = src for MPI-side buffers (NumPy arrays or device tensors)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def _allreduce_mpi(topo, src, dst, mop, hierarchical: bool) -> None:
    """MPI allreduce of MPI-ready buffer ``src`` into ``dst`` (``src is dst``: in place)."""
    if not hierarchical:
        topo.comm.Allreduce(MPI.IN_PLACE if src is dst else src, dst, op=mop)
        return
    if src is not dst:
        _copy(dst, src)
    hierarchical_allreduce_(topo, dst, mop)


def hierarchical_allreduce_(topo, buf, mop) -> None:
    """Two-level allreduce in place: reduce to each node's leader, allreduce among leaders,
    broadcast inside each node. Same result as the flat one up to summation order."""
    topo.node_reduce_(buf, mop)
    if topo.leaders is not None and topo.leaders.Get_size() > 1:
        topo.leaders.Allreduce(MPI.IN_PLACE, buf, op=mop)
    topo.node_broadcast_(buf)


# -- allreduce ---------------------------------------------------------------------------------

def _allreduce_run(rt, tensor, out, op, prescale_factor, postscale_factor, hierarchical,
                   check=None):
    dt = dtype_name(tensor)
    if type(op) is not ReduceOp:
        op = ReduceOp.parse(op)
    mop = mpi_op(op, dt)
    pre = 1.0 if prescale_factor == 1.0 else _check_factor("prescale_factor", prescale_factor, dt)
    post = (1.0 if postscale_factor == 1.0
            else _check_factor("postscale_factor", postscale_factor, dt))
    topo = rt.topo
    if op is Average:
        # Average divides *before* the sum, fused into the copy into the output that an
        # out-of-place allreduce makes anyway (MPICH copies send to receive buffer first).
        pre /= topo.size
    hier = rt.hierarchical if hierarchical is None else bool(hierarchical)
    shape = tuple(tensor.shape)
    numel = math.prod(shape)

    def run():
        if consistency._enabled if check is None else check:
            consistency.verify(topo.comm, ("allreduce", ("op", op.name), ("dtype", dt),
                                           ("shape", shape)))
        if numel == 0:
            return out
        if dt in HALF:  # reduce in float32, round once at the end
            work = to_dtype(tensor, reduce_dtype(dt))
            scale_(work, pre)
            _allreduce_buffers(topo, work, work, mop, hier, in_place=True)
            scale_(work, post)
            copy_into(out, work)
            return out
        # Out of place = copy (scaled by ``pre``) into the fresh output, then reduce in place.
        # Touching the new pages here instead of inside MPI matters: measured on 4 ranks, an
        # allreduce writing into fresh memory took 2.6/7.8/38.6 ms at 1/4/16 MiB against
        # 1.0/4.1/14.8 ms for copy + in place (MPICH copies send to receive buffer anyway).
        if out is tensor:
            scale_(out, pre)
        else:
            scaled_copy(out, tensor, pre)
        _allreduce_buffers(topo, out, out, mop, hier, in_place=True)
        scale_(out, post)
        return out

    return run, ("allreduce", op.name, dt, shape)


def _allreduce_buffers(topo, src, dst, mop, hierarchical: bool, in_place: bool) -> None:
    """MPI allreduce of tensor/array ``src`` into ``dst``, staging where needed."""
    d = fast_cpu_view(dst)
    if d is not None and not hierarchical:  # the common case: no wrapper objects at all
        s = d if in_place else fast_cpu_view(src)
        if s is not None:
            topo.comm.Allreduce(MPI.IN_PLACE if in_place else s, d, op=mop)
            return
    if in_place:
        buf = mpi_buffer(dst)
        _allreduce_mpi(topo, buf.obj, buf.obj, mop, hierarchical)
    else:
        sbuf, buf = mpi_buffer(src), mpi_buffer(dst, load=False)
        _allreduce_mpi(topo, sbuf.obj, buf.obj, mop, hierarchical)
    buf.writeback()


def allreduce(tensor, op=Average, *, prescale_factor=1.0, postscale_factor=1.0,
              hierarchical=None, check=None):
    """Reduce ``tensor`` over all ranks; return the result as a new tensor/array.

    ``op`` is one of Average (default), Sum, Min, Max, Product; the result is
    ``postscale * op(prescale * x_i)``. ``hierarchical=True`` uses the two-level algorithm;
    ``None`` takes the global default. ``check`` overrides the agreement check for this call
    (``None``: the global setting); every rank must pass the same.
    """
    rt = runtime.get()
    run, d = _allreduce_run(rt, tensor, empty_like(tensor), op, prescale_factor,
                            postscale_factor, hierarchical, check)
    return _dispatch(rt, run, d, False)


def allreduce_(tensor, op=Average, *, prescale_factor=1.0, postscale_factor=1.0,
               hierarchical=None, check=None):
    """In-place ``allreduce``: the result overwrites ``tensor``, which is returned."""
    rt = runtime.get()
    run, d = _allreduce_run(rt, tensor, tensor, op, prescale_factor, postscale_factor,
                            hierarchical, check)
    return _dispatch(rt, run, d, False)


def allreduce_async(tensor, op=Average, *, prescale_factor=1.0, postscale_factor=1.0,
                    hierarchical=None, check=None) -> Handle:
    """Start an ``allreduce``; ``synchronize(handle)`` returns the new tensor."""
    rt = runtime.get()
    out = empty_like(tensor)
    run, d = _allreduce_run(rt, tensor, out, op, prescale_factor, postscale_factor, hierarchical,
                            check)
    return _dispatch(rt, run, d, True, (tensor, out))


def allreduce_async_(tensor, op=Average, *, prescale_factor=1.0, postscale_factor=1.0,
                     hierarchical=None, check=None) -> Handle:
    """Start an in-place ``allreduce``; do not touch ``tensor`` until it completes."""
    rt = runtime.get()
    run, d = _allreduce_run(rt, tensor, tensor, op, prescale_factor, postscale_factor,
                            hierarchical, check)
    return _dispatch(rt, run, d, True, (tensor,))


# -- grouped allreduce -------------------------------------------------------------------------

def _grouped_run(rt, tensors, outs, op, prescale_factor, postscale_factor, hierarchical):
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("grouped_allreduce needs a non-empty list of tensors")
    kinds = {(type(t).__name__, str(getattr(t, "device", "cpu"))) for t in tensors}
    if len(kinds) > 1:
        raise TypeError(f"grouped_allreduce needs tensors of one kind and device, got {kinds}")
    dts = [dtype_name(t) for t in tensors]
    op = ReduceOp.parse(op)
    groups: dict[str, list[int]] = {}
    for i, dt in enumerate(dts):
        mpi_op(op, dt)
        _check_factor("prescale_factor", prescale_factor, dt)
        _check_factor("postscale_factor", postscale_factor, dt)
        groups.setdefault(reduce_dtype(dt), []).append(i)
    topo = rt.topo
    pre = float(prescale_factor)
    post = float(postscale_factor) / (topo.size if op is Average else 1)
    hier = rt.hierarchical if hierarchical is None else bool(hierarchical)
    signature = ("grouped_allreduce", ("op", op.name), ("dtypes", tuple(dts)),
                 ("shapes", tuple(tuple(t.shape) for t in tensors)))

    def run():
        if consistency._enabled:
            consistency.verify(topo.comm, signature)
        for wire_dt, idx in groups.items():
            fused = _flatten([tensors[i] for i in idx], wire_dt)  # one message per wire dtype
            if fused.shape[0] == 0:
                continue
            scale_(fused, pre)
            _allreduce_buffers(topo, fused, fused, mpi_op(op, wire_dt), hier, in_place=True)
            scale_(fused, post)
            _unflatten(fused, [outs[i] for i in idx])
        return outs

    return run, ("grouped_allreduce", op.name, len(tensors))


def _flatten(tensors, dt: str):
    if isinstance(tensors[0], np.ndarray):
        return np.concatenate([t.reshape(-1) for t in tensors]).astype(dt, copy=False)
    return torch.cat([t.detach().reshape(-1).to(getattr(torch, dt)) for t in tensors])


def _unflatten(fused, outs) -> None:
    offset = 0
    for o in outs:
        n = math.prod(o.shape)
        copy_into(o, fused[offset:offset + n].reshape(o.shape))
        offset += n


def grouped_allreduce(tensors: Sequence, op=Average, *, prescale_factor=1.0,
                      postscale_factor=1.0, hierarchical=None) -> list:
    """Allreduce a list of tensors as one fused message (one per dtype); returns new tensors."""
    rt = runtime.get()
    outs = [empty_like(t) for t in tensors] if isinstance(tensors, (list, tuple)) else None
    run, d = _grouped_run(rt, tensors, outs, op, prescale_factor, postscale_factor, hierarchical)
    return _dispatch(rt, run, d, False)


def grouped_allreduce_(tensors: Sequence, op=Average, *, prescale_factor=1.0,
                       postscale_factor=1.0, hierarchical=None) -> list:
    rt = runtime.get()
    run, d = _grouped_run(rt, tensors, tensors, op, prescale_factor, postscale_factor,
                          hierarchical)
    return _dispatch(rt, run, d, False)


def grouped_allreduce_async(tensors: Sequence, op=Average, *, prescale_factor=1.0,
                            postscale_factor=1.0, hierarchical=None) -> Handle:
    rt = runtime.get()
    outs = [empty_like(t) for t in tensors] if isinstance(tensors, (list, tuple)) else None
    run, d = _grouped_run(rt, tensors, outs, op, prescale_factor, postscale_factor, hierarchical)
    return _dispatch(rt, run, d, True, tuple(tensors) + tuple(outs))


def grouped_allreduce_async_(tensors: Sequence, op=Average, *, prescale_factor=1.0,
                             postscale_factor=1.0, hierarchical=None) -> Handle:
    rt = runtime.get()
    run, d = _grouped_run(rt, tensors, tensors, op, prescale_factor, postscale_factor,
                          hierarchical)
    return _dispatch(rt, run, d, True, tuple(tensors))


# -- allgather ---------------------------------------------------------------------------------

def _allgather_run(rt, tensor):
    dt = dtype_name(tensor)
    x = tensor if tensor.ndim > 0 else tensor.reshape(1)
    shape = tuple(x.shape)
    topo = rt.topo
    row = _row_elems(shape)
    signature = ("allgather", ("dtype", dt), ("trailing_shape", shape[1:]))

    def run():
        # One small Allgather carries both the agreement check and the row counts.
        header = np.array([consistency.signature_hash(signature), shape[0]], dtype=np.int64)
        table = np.empty((topo.size, 2), dtype=np.int64)
        topo.comm.Allgather(header, table)
        consistency.verify_hashes(topo.comm, table[:, 0], signature)
        counts = table[:, 1]
        out = empty_like(x, (int(counts.sum()),) + shape[1:])
        src, dst = mpi_buffer(contiguous(x)), mpi_buffer(out, load=False)
        topo.comm.Allgatherv(src.obj, [dst.obj, counts * row])
        dst.writeback()
        return out

    return run, ("allgather", dt, shape)


def allgather(tensor):
    """Concatenate every rank's tensor along dimension 0 (sizes there may differ by rank)."""
    rt = runtime.get()
    run, d = _allgather_run(rt, tensor)
    return _dispatch(rt, run, d, False)


def allgather_async(tensor) -> Handle:
    rt = runtime.get()
    run, d = _allgather_run(rt, tensor)
    return _dispatch(rt, run, d, True, (tensor,))


# -- broadcast ---------------------------------------------------------------------------------

def _broadcast_run(rt, tensor, out, root_rank):
    dt = dtype_name(tensor)
    topo = rt.topo
    root = _check_root(root_rank, topo.size)
    signature = ("broadcast", ("root", root), ("dtype", dt), ("shape", tuple(tensor.shape)))

    def run():
        if consistency._enabled:
            consistency.verify(topo.comm, signature)
        if out is not tensor and topo.rank == root:
            copy_into(out, tensor)
        buf = mpi_buffer(out, load=topo.rank == root)
        topo.comm.Bcast(buf.obj, root=root)
        buf.writeback()
        return out

    return run, ("broadcast", root, dt, tuple(tensor.shape))


def broadcast(tensor, root_rank: int = 0):
    """Return a copy of ``root_rank``'s tensor on every rank."""
    rt = runtime.get()
    run, d = _broadcast_run(rt, tensor, empty_like(tensor), root_rank)
    return _dispatch(rt, run, d, False)


def broadcast_(tensor, root_rank: int = 0):
    """Overwrite ``tensor`` on every rank with ``root_rank``'s; returns it."""
    rt = runtime.get()
    run, d = _broadcast_run(rt, tensor, tensor, root_rank)
    return _dispatch(rt, run, d, False)


def broadcast_async(tensor, root_rank: int = 0) -> Handle:
    rt = runtime.get()
    out = empty_like(tensor)
    run, d = _broadcast_run(rt, tensor, out, root_rank)
    return _dispatch(rt, run, d, True, (tensor, out))


def broadcast_async_(tensor, root_rank: int = 0) -> Handle:
    rt = runtime.get()
    run, d = _broadcast_run(rt, tensor, tensor, root_rank)
    return _dispatch(rt, run, d, True, (tensor,))


# -- alltoall ----------------------------------------------------------------------------------

def _normalize_splits(splits, rows: int, size: int) -> np.ndarray:
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall without splits needs dimension 0 ({rows}) divisible by "
                             f"the number of ranks ({size}); pass splits=")
        return np.full(size, rows // size, dtype=np.int64)
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    arr = np.asarray(splits)
    if arr.ndim != 1 or arr.shape[0] != size or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"splits must be {size} integers (one per rank), got {splits!r}")
    if (arr < 0).any() or int(arr.sum()) != rows:
        raise ValueError(f"splits must be non-negative and sum to dimension 0 ({rows}), "
                         f"got {arr.tolist()}")
    return arr.astype(np.int64)


def _alltoall_run(rt, tensor, splits, with_splits: bool):
    dt = dtype_name(tensor)
    if tensor.ndim == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    topo = rt.topo
    shape = tuple(tensor.shape)
    send_splits = _normalize_splits(splits, shape[0], topo.size)
    row = _row_elems(shape)
    signature = ("alltoall", ("dtype", dt), ("trailing_shape", shape[1:]))

    def run():
        header = np.empty((topo.size, 2), dtype=np.int64)
        header[:, 0] = consistency.signature_hash(signature)
        header[:, 1] = send_splits
        received = np.empty_like(header)
        topo.comm.Alltoall(header, received)
        consistency.verify_hashes(topo.comm, received[:, 0], signature)
        recv_splits = received[:, 1].copy()
        out = empty_like(tensor, (int(recv_splits.sum()),) + shape[1:])
        src, dst = mpi_buffer(contiguous(tensor)), mpi_buffer(out, load=False)
        topo.comm.Alltoallv([src.obj, send_splits * row], [dst.obj, recv_splits * row])
        dst.writeback()
        return (out, recv_splits) if with_splits else out

    return run, ("alltoall", dt, shape)


def alltoall(tensor, splits=None, *, return_received_splits: bool = False):
    """Scatter slices of dimension 0 to every rank and gather theirs.

    ``splits[j]`` rows go to rank j (default: equal parts). The result concatenates what each
    rank sent here, in rank order; with ``return_received_splits=True`` it is
    ``(tensor, received_splits)``.
    """
    rt = runtime.get()
    run, d = _alltoall_run(rt, tensor, splits, return_received_splits)
    return _dispatch(rt, run, d, False)


def alltoall_async(tensor, splits=None, *, return_received_splits: bool = False) -> Handle:
    rt = runtime.get()
    run, d = _alltoall_run(rt, tensor, splits, return_received_splits)
    return _dispatch(rt, run, d, True, (tensor,))


# -- reducescatter -----------------------------------------------------------------------------

def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Rows of the result each rank keeps: equal parts, the first ``rows % size`` get one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _reducescatter_run(rt, tensor, op, prescale_factor, postscale_factor):
    dt = dtype_name(tensor)
    if tensor.ndim == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    op = ReduceOp.parse(op)
    mop = mpi_op(op, dt)
    pre = _check_factor("prescale_factor", prescale_factor, dt)
    post = _check_factor("postscale_factor", postscale_factor, dt)
    topo = rt.topo
    if op is Average:
        post /= topo.size
    shape = tuple(tensor.shape)
    rows = reducescatter_rows(shape[0], topo.size)
    row = _row_elems(shape)
    out = empty_like(tensor, (rows[topo.rank],) + shape[1:])
    signature = ("reducescatter", ("op", op.name), ("dtype", dt), ("shape", shape))

    def run():
        if consistency._enabled:
            consistency.verify(topo.comm, signature)
        wire = reduce_dtype(dt)
        work = to_dtype(tensor, wire) if (wire != dt or pre != 1.0) else contiguous(tensor)
        scale_(work, pre)
        result = out if wire == dt else empty_like(out, dtype=wire)
        src, dst = mpi_buffer(work), mpi_buffer(result, load=False)
        topo.comm.Reduce_scatter(src.obj, dst.obj, recvcounts=[r * row for r in rows], op=mop)
        dst.writeback()
        scale_(result, post)
        if result is not out:
            copy_into(out, result)
        return out

    return run, ("reducescatter", op.name, dt, shape)


def reducescatter(tensor, op=Average, *, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over ranks and keep this rank's slice of dimension 0 (see ``reducescatter_rows``)."""
    rt = runtime.get()
    run, d = _reducescatter_run(rt, tensor, op, prescale_factor, postscale_factor)
    return _dispatch(rt, run, d, False)


def reducescatter_async(tensor, op=Average, *, prescale_factor=1.0,
                        postscale_factor=1.0) -> Handle:
    rt = runtime.get()
    run, d = _reducescatter_run(rt, tensor, op, prescale_factor, postscale_factor)
    return _dispatch(rt, run, d, True, (tensor,))


# -- barrier, objects, handles -----------------------------------------------------------------

def barrier() -> None:
    """Block until every rank reaches this point (behind any pending asynchronous work)."""
    rt = runtime.get()
    rt.worker.run(rt.topo.comm.Barrier, ("barrier",))


def broadcast_object(obj, root_rank: int = 0):
    """Send a picklable object from ``root_rank`` to all ranks (pickle in transit only)."""
    rt = runtime.get()
    root = _check_root(root_rank, rt.topo.size)
    return rt.worker.run(lambda: rt.topo.comm.bcast(obj, root=root), ("broadcast_object", root))


def allgather_object(obj) -> list:
    """List of every rank's object, in rank order."""
    rt = runtime.get()
    return rt.worker.run(lambda: rt.topo.comm.allgather(obj), ("allgather_object",))


def poll(handle: Handle) -> bool:
    """True once the asynchronous operation behind ``handle`` has finished."""
    if not isinstance(handle, Handle):
        raise TypeError(f"poll() expects a bagua_mpi Handle, got {type(handle).__name__}")
    return handle.done()


def synchronize(handle: Handle, timeout: float | None = None):
    """Wait for ``handle``; return its result or raise its error (a ``BaguaMPIError``)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize() expects a bagua_mpi Handle, got {type(handle).__name__}")
    return handle.wait(timeout)


def submit(fn, describe=("custom",), owned: tuple = ()) -> Handle:
    """Run ``fn()`` on the communication thread, in order with the collectives.

    For algorithms that issue their own MPI sequences (compressed or sparse payloads, peer
    exchanges): they run in the same serial order as every other library operation.
    """
    rt = runtime.get()
    if not callable(fn):
        raise TypeError(f"submit() expects a callable, got {fn!r}")
    return rt.worker.submit(fn, describe, owned)


__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "barrier",
    "broadcast_object", "allgather_object", "poll", "synchronize", "submit",
    "hierarchical_allreduce_", "reducescatter_rows", "BaguaMPIError",
]
