"""Horovod-style collectives on the library's private communicator.

Naming grid (as Horovod): ``op`` returns a new tensor, ``op_`` works in place, ``op_async`` and
``op_async_`` return a ``Handle`` for ``poll``/``synchronize``. Inputs are torch tensors (CPU or
CUDA) or NumPy arrays; outputs are of the same kind and device.

Signatures are Horovod's (``horovod.torch``): the same positional order and keywords
(``average=``, ``name=``, ``compression=``, ``op=``, ``prescale_factor``/``postscale_factor``,
``process_set=``), plus this library's keyword-only extras (``hierarchical=``, ``check=``). For
backward compatibility the second positional argument of the allreduce family and of
reducescatter may also be a reduction op (``allreduce(t, Sum)``). Tensors that require a
gradient go through the differentiable versions in ``autograd_ops``.

Every operation is built in two halves: argument validation runs at once in the caller (bad
arguments raise ``ValueError``/``TypeError`` synchronously, on the rank that passed them), and a
``run`` closure does the MPI work, either inline or on the communication thread (``worker.py``).
Each ``run`` starts with the cross-rank agreement check (``consistency.py``), so a disagreement
raises ``MismatchError`` on every rank instead of a hang.
"""
from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np
import torch
from mpi4py import MPI

from . import consistency, process_sets, runtime, timeline, transport
from .buffers import (HALF, INTEGER, contiguous, copy_into, dtype_name, empty_like,
                      fast_cpu_view, is_cuda, reduce_dtype, scale_, scaled_copy, to_dtype)
from .compression import Compression
from .exceptions import BaguaMPIError
from .ops import Average, ReduceOp, Sum, UnsupportedOp, mpi_op
from .worker import Handle

global_process_set = process_sets.global_process_set
_GLOBAL = global_process_set
_NO_COMPRESSION = Compression.none


# -- plumbing ----------------------------------------------------------------------------------

# Names of asynchronous operations not yet synchronized (Horovod refuses a duplicate name).
_pending_names: dict[str, Handle] = {}
_handle_names: dict[int, str] = {}


def _dispatch(rt, run, describe, asynchronous: bool, owned: tuple = (), name=None):
    if timeline._collective is not None:
        run = timeline._collective.wrap(run, name, describe)
    if asynchronous:
        for t in owned:
            if is_cuda(t):  # the comm thread reads device memory outside torch's stream order
                torch.cuda.current_stream(t.device).synchronize()
                break
        if name is None:
            return rt.worker.submit(run, describe, owned)
        _reserve_name(name)
        handle = rt.worker.submit(run, describe, owned)
        _pending_names[name] = handle
        _handle_names[id(handle)] = name
        return handle
    if name is not None and name in _pending_names:
        _reserve_name(name)
    return rt.worker.run(run, describe)


def _reserve_name(name) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {name!r}")
    if name in _pending_names:
        raise ValueError(f"an operation named {name!r} is still pending: names of operations in "
                         f"flight must be unique (synchronize the first handle before reusing it)")


def _release(handle) -> None:
    name = _handle_names.pop(id(handle), None)
    if name is not None:
        _pending_names.pop(name, None)


def _resolve_op(average, op):
    """Horovod's ``average=`` (deprecated) / ``op=`` pair to one op; ``op`` wins, not both."""
    if op is None:
        if average is None:
            return Average
        if average is True or average is False:
            warnings.warn("average= is deprecated (as in Horovod): use op=Average or op=Sum",
                          DeprecationWarning, stacklevel=3)
            return Average if average else Sum
        return average  # this library's positional op: allreduce(t, Sum)
    if average is not None:
        raise ValueError("the op parameter supersedes average: pass only one of them "
                         f"(got average={average!r}, op={op!r})")
    return op


def _check_factor(name: str, value, dtype: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value != 1.0 and dtype == "bool":
        raise TypeError(f"{name}={value!r} cannot scale a bool tensor")
    return float(value)


def _check_root(root, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root_rank must be an integer in [0, {size}), got {root!r}")
    return int(root)


def _topo(rt, process_set):
    if process_set is _GLOBAL or process_set is None:
        return rt.topo
    return process_sets.topology_of(process_set)


def _root(rt, root_rank, process_set) -> int:
    """Horovod's root_rank is a global rank, also with process sets: its index in the set."""
    if process_set is _GLOBAL or process_set is None:
        return _check_root(root_rank, rt.topo.size)
    _check_root(root_rank, rt.topo.size)
    return process_sets.set_rank_of(process_set, int(root_rank))


def _wants_grad(tensor) -> bool:
    return type(tensor) is not np.ndarray and getattr(tensor, "requires_grad", False) \
        and torch.is_grad_enabled()


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


def _reduction(op, dt: str):
    """(op, MPI op, integer average?): Average of integers sums, then scales by 1/n in float64
    and truncates toward zero, as Horovod does."""
    if type(op) is not ReduceOp:
        op = ReduceOp.parse(op)
    if op is Average and dt in INTEGER:
        return op, MPI.SUM, True
    return op, mpi_op(op, dt), False


# -- allreduce ---------------------------------------------------------------------------------

_NCCL_OPS = ((MPI.SUM, "sum"), (MPI.MIN, "min"), (MPI.MAX, "max"), (MPI.PROD, "product"))


def _nccl_allreduce(topo, src, dst, mop, hier, in_place=True) -> None:
    """In place on a contiguous CUDA tensor with the NCCL backend (``hier`` is the backend's
    own: ``nccl_hierarchical``)."""
    work = dst if dst.is_contiguous() else dst.contiguous()
    op = next((name for m, name in _NCCL_OPS if m == mop), f"MPI op {mop!r}")
    transport.nccl_allreduce_(work, topo, op=op)
    if work is not dst:
        dst.copy_(work)


def _verify_allreduce(comm, op, dt: str, shape: tuple, mop, hier: bool) -> None:
    """The agreement check of an allreduce: one record for the general and the fast path, so
    ranks taking different paths for the same call still agree (and disagreeing calls raise)."""
    consistency.verify(comm, ("allreduce", ("op", op.name), ("dtype", dt), ("shape", shape)),
                       (((reduce_dtype(dt), math.prod(shape)),), mop, hier))


def _allreduce_run(rt, topo, tensor, out, op, prescale_factor, postscale_factor, hierarchical,
                   check=None):
    dt = dtype_name(tensor)
    if type(op) is not ReduceOp:
        op = ReduceOp.parse(op)
    if op is ReduceOp.Adasum:  # Horovod's adaptive summation, flat (hierarchical= ignored)
        from .primitives import adasum
        return adasum.allreduce_run(topo.comm, [tensor], [out],
                                    _check_factor("prescale_factor", prescale_factor, dt),
                                    _check_factor("postscale_factor", postscale_factor, dt),
                                    check)
    int_average = op is Average and dt in INTEGER
    mop = MPI.SUM if int_average else mpi_op(op, dt)
    pre = 1.0 if prescale_factor == 1.0 else _check_factor("prescale_factor", prescale_factor, dt)
    post = (1.0 if postscale_factor == 1.0
            else _check_factor("postscale_factor", postscale_factor, dt))
    if int_average:
        post /= topo.size
    elif op is Average:
        # Average divides *before* the sum, fused into the copy into the output that an
        # out-of-place allreduce makes anyway (MPICH copies send to receive buffer first).
        pre /= topo.size
    hier = rt.hierarchical if hierarchical is None else bool(hierarchical)
    shape = tuple(tensor.shape)
    numel = math.prod(shape)
    reduce_ = _allreduce_buffers
    if getattr(tensor, "is_cuda", False) and topo is rt.topo and transport.uses_nccl(tensor):
        reduce_ = _nccl_allreduce  # the chosen NCCL backend (bagua_mpi.backends)

    def run():
        if consistency._enabled if check is None else check:
            _verify_allreduce(topo.comm, op, dt, shape, mop, hier)
        if numel == 0:
            return out
        if dt in HALF:  # reduce in float32, round once at the end
            work = to_dtype(tensor, reduce_dtype(dt))
            scale_(work, pre)
            reduce_(topo, work, work, mop, hier, in_place=True)
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
        reduce_(topo, out, out, mop, hier, in_place=True)
        scale_(out, post)
        return out

    return run, ("allreduce", op.name, dt, shape)


_FAST_OPS = {"Sum": MPI.SUM, "Average": MPI.SUM, "Min": MPI.MIN, "Max": MPI.MAX}


def _fast_allreduce(rt, tensor, op, in_place: bool, check: bool):
    """The plain case of ``allreduce``/``allreduce_`` with as little Python as possible (small
    allreduces are latency-bound): a contiguous CPU float32/float64 tensor, Sum/Average/Min/
    Max, no scaling factors, flat, on the global set; out of place only below 1 MiB (larger
    outputs come from ``empty_like``'s huge pages). Returns the result, or None (nothing done)
    for anything else; the general path then gives the same bits (Average divides before the
    sum in both, by the same float) and the same agreement check.

    MPI gets the tensors' memory by address: a NumPy view costs ~2 us to make and mpi4py's
    DLPack import of a tensor ~20 us, against ~1.5 us for a small shared-memory allreduce."""
    if type(tensor) is not torch.Tensor or type(op) is not ReduceOp:
        return None  # the general path validates (and names) anything unusual
    kind = _FAST_DTYPES.get(tensor.dtype)
    mop = _FAST_OPS.get(op.name)
    if kind is None or mop is None or tensor.is_cuda or not tensor.is_contiguous():
        return None
    nbytes = tensor.nbytes
    if nbytes == 0 or not in_place and nbytes >= _FAST_OUT_OF_PLACE_BYTES:
        return None
    datatype, name, np_dtype = kind
    comm = rt.topo.comm
    shape = tuple(tensor.shape)
    out = tensor if in_place else torch.empty_like(tensor)

    def run():
        if check:
            _verify_allreduce(comm, op, name, shape, mop, False)
        memory = MPI.buffer.fromaddress(out.data_ptr(), nbytes)
        send = MPI.IN_PLACE
        if op is Average:  # torch's own multiply costs ~8 us of dispatch here, NumPy's ~3
            dst = np.frombuffer(memory, dtype=np_dtype)
            src = dst if in_place else np.frombuffer(
                MPI.buffer.fromaddress(tensor.data_ptr(), nbytes), dtype=np_dtype)
            np.multiply(src, np_dtype(1.0 / comm.Get_size()), out=dst)
        elif not in_place:  # MPI copies the send buffer into the receive buffer first
            send = [MPI.buffer.fromaddress(tensor.data_ptr(), nbytes), datatype]
        comm.Allreduce(send, [memory, datatype], op=mop)
        return out

    return rt.worker.run(run, ("allreduce", op.name, name, shape))


# Out of place, the fast path allocates with torch.empty; from 1 MiB on, ``empty_like``'s
# NumPy allocation (transparent huge pages) is worth its few microseconds.
_FAST_OUT_OF_PLACE_BYTES = 1 << 20
_FAST_DTYPES = {torch.float32: (MPI.FLOAT, "float32", np.float32),
                torch.float64: (MPI.DOUBLE, "float64", np.float64)}


def _allreduce_buffers(topo, src, dst, mop, hierarchical: bool, in_place: bool) -> None:
    """MPI allreduce of tensor/array ``src`` into ``dst``, staging where needed."""
    d = fast_cpu_view(dst)
    if d is not None and not hierarchical:  # the common case: no wrapper objects at all
        s = d if in_place else fast_cpu_view(src)
        if s is not None:
            topo.comm.Allreduce(MPI.IN_PLACE if in_place else s, d, op=mop)
            return
    if in_place:
        buf = transport.mpi_buffer(dst)
        _allreduce_mpi(topo, buf.obj, buf.obj, mop, hierarchical)
    else:
        sbuf, buf = transport.mpi_buffer(src), transport.mpi_buffer(dst, load=False)
        _allreduce_mpi(topo, sbuf.obj, buf.obj, mop, hierarchical)
    buf.writeback()


def _plain(rt, name, process_set, prescale_factor, postscale_factor, hierarchical) -> bool:
    """Options that leave an allreduce to ``_fast_allreduce`` (it checks the tensor itself)."""
    return (name is None and process_set is _GLOBAL and prescale_factor == 1.0
            and postscale_factor == 1.0 and timeline._collective is None
            and not (rt.hierarchical if hierarchical is None else hierarchical))


def allreduce(tensor, average=None, name=None, compression=_NO_COMPRESSION, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set, *,
              hierarchical=None, check=None):
    """Reduce ``tensor`` over all ranks (of ``process_set``); return the result as a new tensor.

    ``op`` is one of Average (default), Sum, Min, Max, Product, Adasum (Horovod's adaptive
    summation: float tensors, power-of-two rank counts; ``primitives/adasum.py``); the result is
    ``postscale * op(prescale * x_i)``. Average of integer tensors sums, then scales by 1/n and
    truncates toward zero (as Horovod). ``average`` is Horovod's deprecated flag; ``name`` labels
    the operation (timeline, duplicate detection); ``compression`` (``Compression.fp16``...)
    casts before and after. ``hierarchical=True`` uses the two-level algorithm; ``check``
    overrides the agreement check for this call (every rank must pass the same).
    Differentiable: a tensor that requires grad gets the allreduce of its gradient.
    """
    if op is None and average is None:
        op = Average
    else:
        op = _resolve_op(average, op)
    if compression is not _NO_COMPRESSION and compression is not None:
        t, ctx = compression.compress(tensor)
        out = allreduce(t, None, name, None, op, prescale_factor, postscale_factor, process_set,
                        hierarchical=hierarchical, check=check)
        return compression.decompress(out, ctx)
    if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
        from .autograd_ops import allreduce_grad
        return allreduce_grad(tensor, op, prescale_factor, postscale_factor, process_set, name,
                              hierarchical)
    rt = runtime.get()
    if _plain(rt, name, process_set, prescale_factor, postscale_factor, hierarchical):
        out = _fast_allreduce(rt, tensor, op, False,
                              check if check is not None else consistency._enabled)
        if out is not None:
            return out
    topo = rt.topo if process_set is _GLOBAL else _topo(rt, process_set)
    run, d = _allreduce_run(rt, topo, tensor, empty_like(tensor), op, prescale_factor,
                            postscale_factor, hierarchical, check)
    if name is None and timeline._collective is None:
        return rt.worker.run(run, d)
    return _dispatch(rt, run, d, False, name=name)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, *, hierarchical=None,
               check=None):
    """In-place ``allreduce``: the result overwrites ``tensor``, which is returned."""
    if op is not None or average is not None:
        op = _resolve_op(average, op)
    else:
        op = Average
    rt = runtime.get()
    if (_plain(rt, name, process_set, prescale_factor, postscale_factor, hierarchical)
            and _fast_allreduce(rt, tensor, op, True, check if check is not None
                                else consistency._enabled) is not None):
        return tensor
    topo = rt.topo if process_set is _GLOBAL else _topo(rt, process_set)
    run, d = _allreduce_run(rt, topo, tensor, tensor, op, prescale_factor, postscale_factor,
                            hierarchical, check)
    if name is None and timeline._collective is None:
        return rt.worker.run(run, d)
    return _dispatch(rt, run, d, False, name=name)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, *, hierarchical=None,
                    check=None) -> Handle:
    """Start an ``allreduce``; ``synchronize(handle)`` returns the new tensor."""
    op = _resolve_op(average, op)
    rt = runtime.get()
    out = empty_like(tensor)
    run, d = _allreduce_run(rt, _topo(rt, process_set), tensor, out, op, prescale_factor,
                            postscale_factor, hierarchical, check)
    return _dispatch(rt, run, d, True, (tensor, out), name)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, *, hierarchical=None,
                     check=None) -> Handle:
    """Start an in-place ``allreduce``; do not touch ``tensor`` until it completes."""
    op = _resolve_op(average, op)
    rt = runtime.get()
    run, d = _allreduce_run(rt, _topo(rt, process_set), tensor, tensor, op, prescale_factor,
                            postscale_factor, hierarchical, check)
    return _dispatch(rt, run, d, True, (tensor,), name)


# -- grouped allreduce -------------------------------------------------------------------------

def _check_list(tensors, what: str) -> None:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"{what} needs a non-empty list of tensors, got {tensors!r}")


def _grouped_run(rt, topo, tensors, outs, op, prescale_factor, postscale_factor, hierarchical):
    _check_list(tensors, "grouped_allreduce")
    kinds = {(type(t).__name__, str(getattr(t, "device", "cpu"))) for t in tensors}
    if len(kinds) > 1:
        raise TypeError(f"grouped_allreduce needs tensors of one kind and device, got {kinds}")
    dts = [dtype_name(t) for t in tensors]
    op = ReduceOp.parse(op)
    if op is ReduceOp.Adasum:  # each tensor combined on its own, as Horovod
        from .primitives import adasum
        return adasum.allreduce_run(topo.comm, tensors, outs,
                                    _check_factor("prescale_factor", prescale_factor, "float32"),
                                    _check_factor("postscale_factor", postscale_factor, "float32"),
                                    grouped=True)
    groups: dict[tuple, list[int]] = {}
    for i, dt in enumerate(dts):
        _, mop, int_average = _reduction(op, dt)
        _check_factor("prescale_factor", prescale_factor, dt)
        _check_factor("postscale_factor", postscale_factor, dt)
        groups.setdefault((reduce_dtype(dt), int_average), []).append(i)
    pre = float(prescale_factor)
    hier = rt.hierarchical if hierarchical is None else bool(hierarchical)
    signature = ("grouped_allreduce", ("op", op.name), ("dtypes", tuple(dts)),
                 ("shapes", tuple(tuple(t.shape) for t in tensors)))
    plan = []  # (wire dtype, indices, MPI op, postscale, element count) per fused message
    for (wire_dt, int_average), idx in groups.items():
        post = float(postscale_factor) / (topo.size if op is Average else 1)
        mop = MPI.SUM if int_average else mpi_op(op, wire_dt)
        plan.append((wire_dt, idx, mop, post,
                     sum(math.prod(tuple(tensors[i].shape)) for i in idx)))
    join_info = (tuple((w, n, m) for w, _, m, _, n in plan), None, hier)

    def run():
        if consistency._enabled:
            consistency.verify(topo.comm, signature, join_info)
        for wire_dt, idx, mop, post, numel in plan:
            if numel == 0:
                continue
            fused = _flatten([tensors[i] for i in idx], wire_dt)  # one message per wire dtype
            scale_(fused, pre)
            _allreduce_buffers(topo, fused, fused, mop, hier, in_place=True)
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


def grouped_allreduce(tensors: Sequence, average=None, name=None, compression=_NO_COMPRESSION,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, *, hierarchical=None) -> list:
    """Allreduce a list of tensors as one fused message (one per dtype); returns new tensors."""
    op = _resolve_op(average, op)
    _check_list(tensors, "grouped_allreduce")
    if compression is not _NO_COMPRESSION and compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        outs = grouped_allreduce([t for t, _ in pairs], None, name, None, op, prescale_factor,
                                 postscale_factor, process_set, hierarchical=hierarchical)
        return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]
    if any(_wants_grad(t) for t in tensors):
        from .autograd_ops import grouped_allreduce_grad
        return grouped_allreduce_grad(tensors, op, prescale_factor, postscale_factor,
                                      process_set, name, hierarchical)
    rt = runtime.get()
    outs = [empty_like(t) for t in tensors]
    run, d = _grouped_run(rt, _topo(rt, process_set), tensors, outs, op, prescale_factor,
                          postscale_factor, hierarchical)
    return _dispatch(rt, run, d, False, name=name)


def grouped_allreduce_(tensors: Sequence, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, *,
                       hierarchical=None) -> list:
    op = _resolve_op(average, op)
    rt = runtime.get()
    run, d = _grouped_run(rt, _topo(rt, process_set), tensors, tensors, op, prescale_factor,
                          postscale_factor, hierarchical)
    return _dispatch(rt, run, d, False, name=name)


def grouped_allreduce_async(tensors: Sequence, average=None, name=None, op=None,
                            prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set, *, hierarchical=None) -> Handle:
    op = _resolve_op(average, op)
    _check_list(tensors, "grouped_allreduce")
    rt = runtime.get()
    outs = [empty_like(t) for t in tensors]
    run, d = _grouped_run(rt, _topo(rt, process_set), tensors, outs, op, prescale_factor,
                          postscale_factor, hierarchical)
    return _dispatch(rt, run, d, True, tuple(tensors) + tuple(outs), name)


def grouped_allreduce_async_(tensors: Sequence, average=None, name=None, op=None,
                             prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set, *, hierarchical=None) -> Handle:
    op = _resolve_op(average, op)
    rt = runtime.get()
    run, d = _grouped_run(rt, _topo(rt, process_set), tensors, tensors, op, prescale_factor,
                          postscale_factor, hierarchical)
    return _dispatch(rt, run, d, True, tuple(tensors), name)


# -- sparse allreduce --------------------------------------------------------------------------

def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Allreduce a sparse COO tensor by allgathering its indices and values (as Horovod).

    ``synchronize(handle)`` returns a sparse tensor of the same size whose (uncoalesced) entries
    are every rank's entries, divided by the number of ranks for Average.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async needs a sparse COO torch tensor, got "
                        f"{type(tensor).__name__}")
    op = ReduceOp.parse(op)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async supports Average and Sum, got {op.name}")
    rt = runtime.get()
    topo = _topo(rt, process_set)
    t = tensor.detach().coalesce()
    run_i, _ = _allgather_run(rt, topo, t.indices().t().contiguous())
    run_v, _ = _allgather_run(rt, topo, t.values().contiguous())

    def run():
        indices, _ = run_i()
        values, _ = run_v()
        if op is Average:
            values = values / topo.size
        return torch.sparse_coo_tensor(indices.t(), values, t.size(), check_invariants=False)

    return _dispatch(rt, run, ("sparse_allreduce", op.name, tuple(t.shape)), True, (t,), name)


# -- allgather ---------------------------------------------------------------------------------

def _allgather_run(rt, topo, tensor):
    """``run()`` returns ``(gathered, rows of every rank)``."""
    dt = dtype_name(tensor)
    x = tensor if tensor.ndim > 0 else tensor.reshape(1)
    shape = tuple(x.shape)
    row = _row_elems(shape)
    signature = ("allgather", ("dtype", dt), ("trailing_shape", shape[1:]))

    def run():
        if consistency._enabled:  # the check message also tells a joined rank what runs
            consistency.verify(topo.comm, signature)
        header = np.array([consistency.signature_hash(signature), shape[0]], dtype=np.int64)
        table = np.empty((topo.size, 2), dtype=np.int64)
        topo.comm.Allgather(header, table)
        consistency.verify_hashes(topo.comm, table[:, 0], signature)
        counts = table[:, 1]
        out = empty_like(x, (int(counts.sum()),) + shape[1:])
        src, dst = transport.mpi_buffer(contiguous(x)), transport.mpi_buffer(out, load=False)
        topo.comm.Allgatherv(src.obj, [dst.obj, counts * row])
        dst.writeback()
        return out, counts

    return run, ("allgather", dt, shape)


def _first(run):
    return lambda: run()[0]


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's tensor along dimension 0 (sizes there may differ by rank).
    Differentiable (backward: average of the gradients, this rank's slice)."""
    if _wants_grad(tensor):
        from .autograd_ops import allgather_grad
        return allgather_grad(tensor, process_set, name)
    rt = runtime.get()
    run, d = _allgather_run(rt, _topo(rt, process_set), tensor)
    return _dispatch(rt, _first(run), d, False, name=name)


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    rt = runtime.get()
    run, d = _allgather_run(rt, _topo(rt, process_set), tensor)
    return _dispatch(rt, _first(run), d, True, (tensor,), name)


def _grouped_allgather_run(rt, topo, tensors):
    _check_list(tensors, "grouped_allgather")
    runs = [_allgather_run(rt, topo, t)[0] for t in tensors]

    def run():
        return [r() for r in runs]

    return run, ("grouped_allgather", len(tensors))


def grouped_allgather(tensors: Sequence, name=None, process_set=global_process_set) -> list:
    """``allgather`` of each tensor of a list, in one operation; returns a list."""
    _check_list(tensors, "grouped_allgather")
    if any(_wants_grad(t) for t in tensors):
        from .autograd_ops import grouped_allgather_grad
        return grouped_allgather_grad(tensors, process_set, name)
    rt = runtime.get()
    run, d = _grouped_allgather_run(rt, _topo(rt, process_set), tensors)
    return _dispatch(rt, lambda: [o for o, _ in run()], d, False, name=name)


def grouped_allgather_async(tensors: Sequence, name=None,
                            process_set=global_process_set) -> Handle:
    rt = runtime.get()
    run, d = _grouped_allgather_run(rt, _topo(rt, process_set), tensors)
    return _dispatch(rt, lambda: [o for o, _ in run()], d, True, tuple(tensors), name)


# -- broadcast ---------------------------------------------------------------------------------

def _broadcast_run(rt, topo, tensor, out, root):
    dt = dtype_name(tensor)
    signature = ("broadcast", ("root", root), ("dtype", dt), ("shape", tuple(tensor.shape)))

    def run():
        if consistency._enabled:
            consistency.verify(topo.comm, signature)
        if out is not tensor and topo.rank == root:
            copy_into(out, tensor)
        buf = transport.mpi_buffer(out, load=topo.rank == root)
        topo.comm.Bcast(buf.obj, root=root)
        buf.writeback()
        return out

    return run, ("broadcast", root, dt, tuple(tensor.shape))


def broadcast(tensor, root_rank: int = 0, name=None, process_set=global_process_set):
    """Return a copy of ``root_rank``'s tensor on every rank (``root_rank`` is a global rank,
    also with a process set). Differentiable (backward: the root gets the average gradient)."""
    if _wants_grad(tensor):
        from .autograd_ops import broadcast_grad
        return broadcast_grad(tensor, root_rank, process_set, name)
    rt = runtime.get()
    run, d = _broadcast_run(rt, _topo(rt, process_set), tensor, empty_like(tensor),
                            _root(rt, root_rank, process_set))
    return _dispatch(rt, run, d, False, name=name)


def broadcast_(tensor, root_rank: int = 0, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` on every rank with ``root_rank``'s; returns it."""
    rt = runtime.get()
    run, d = _broadcast_run(rt, _topo(rt, process_set), tensor, tensor,
                            _root(rt, root_rank, process_set))
    return _dispatch(rt, run, d, False, name=name)


def broadcast_async(tensor, root_rank: int = 0, name=None,
                    process_set=global_process_set) -> Handle:
    rt = runtime.get()
    out = empty_like(tensor)
    run, d = _broadcast_run(rt, _topo(rt, process_set), tensor, out,
                            _root(rt, root_rank, process_set))
    return _dispatch(rt, run, d, True, (tensor, out), name)


def broadcast_async_(tensor, root_rank: int = 0, name=None,
                     process_set=global_process_set) -> Handle:
    rt = runtime.get()
    run, d = _broadcast_run(rt, _topo(rt, process_set), tensor, tensor,
                            _root(rt, root_rank, process_set))
    return _dispatch(rt, run, d, True, (tensor,), name)


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


def _alltoall_run(rt, topo, tensor, splits, with_splits: bool):
    dt = dtype_name(tensor)
    if tensor.ndim == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    shape = tuple(tensor.shape)
    send_splits = _normalize_splits(splits, shape[0], topo.size)
    row = _row_elems(shape)
    signature = ("alltoall", ("dtype", dt), ("trailing_shape", shape[1:]))

    def run():
        if consistency._enabled:
            consistency.verify(topo.comm, signature)
        header = np.empty((topo.size, 2), dtype=np.int64)
        header[:, 0] = consistency.signature_hash(signature)
        header[:, 1] = send_splits
        received = np.empty_like(header)
        topo.comm.Alltoall(header, received)
        consistency.verify_hashes(topo.comm, received[:, 0], signature)
        recv_splits = received[:, 1].copy()
        out = empty_like(tensor, (int(recv_splits.sum()),) + shape[1:])
        src = transport.mpi_buffer(contiguous(tensor))
        dst = transport.mpi_buffer(out, load=False)
        topo.comm.Alltoallv([src.obj, send_splits * row], [dst.obj, recv_splits * row])
        dst.writeback()
        if not with_splits:
            return out
        if isinstance(tensor, torch.Tensor):  # Horovod returns an int32 tensor
            recv_splits = torch.from_numpy(recv_splits.astype(np.int32))
        return out, recv_splits

    return run, ("alltoall", dt, shape)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set, *,
             return_received_splits: bool | None = None):
    """Scatter slices of dimension 0 to every rank and gather theirs.

    ``splits[j]`` rows go to rank j (default: equal parts). The result concatenates what each
    rank sent here, in rank order. As Horovod, it is ``(tensor, received_splits)`` when
    ``splits`` is given and the tensor alone otherwise (``return_received_splits`` forces
    either). Differentiable (backward: alltoall of the gradient with the received splits).
    """
    with_splits = splits is not None if return_received_splits is None \
        else bool(return_received_splits)
    if _wants_grad(tensor):
        from .autograd_ops import alltoall_grad
        return alltoall_grad(tensor, splits, process_set, name, with_splits)
    rt = runtime.get()
    run, d = _alltoall_run(rt, _topo(rt, process_set), tensor, splits, with_splits)
    return _dispatch(rt, run, d, False, name=name)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set, *,
                   return_received_splits: bool | None = None) -> Handle:
    """``synchronize(handle)`` gives ``(tensor, received_splits)`` unless
    ``return_received_splits=False`` (Horovod's handle always gives both)."""
    with_splits = True if return_received_splits is None else bool(return_received_splits)
    rt = runtime.get()
    run, d = _alltoall_run(rt, _topo(rt, process_set), tensor, splits, with_splits)
    return _dispatch(rt, run, d, True, (tensor,), name)


# -- reducescatter -----------------------------------------------------------------------------

def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Rows of the result each rank keeps: equal parts, the first ``rows % size`` get one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _reducescatter_run(rt, topo, tensor, op, prescale_factor, postscale_factor):
    dt = dtype_name(tensor)
    if tensor.ndim == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    if ReduceOp.parse(op) is ReduceOp.Adasum:  # Horovod's core refuses it too
        raise BaguaMPIError("reducescatter does not support op=Adasum (Horovod's reducescatter "
                            "takes Sum and Average only); use allreduce(op=Adasum)")
    op, mop, int_average = _reduction(op, dt)
    pre = _check_factor("prescale_factor", prescale_factor, dt)
    post = _check_factor("postscale_factor", postscale_factor, dt)
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
        src, dst = transport.mpi_buffer(work), transport.mpi_buffer(result, load=False)
        topo.comm.Reduce_scatter(src.obj, dst.obj, recvcounts=[r * row for r in rows], op=mop)
        dst.writeback()
        scale_(result, post)
        if result is not out:
            copy_into(out, result)
        return out

    return run, ("reducescatter", op.name, dt, shape)


def _rs_name_op(name, op):
    """This library's positional op in Horovod's ``name`` slot: reducescatter(t, Sum)."""
    if isinstance(name, (ReduceOp, UnsupportedOp)):
        return None, name
    return name, op


def reducescatter(tensor, name=None, compression=_NO_COMPRESSION, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over ranks and keep this rank's slice of dimension 0 (see ``reducescatter_rows``).
    Differentiable (backward: allgather of the gradient, as Horovod scales it)."""
    name, op = _rs_name_op(name, op)
    if compression is not _NO_COMPRESSION and compression is not None:
        t, ctx = compression.compress(tensor)
        out = reducescatter(t, name, None, op, process_set, prescale_factor, postscale_factor)
        return compression.decompress(out, ctx)
    if _wants_grad(tensor):
        from .autograd_ops import reducescatter_grad
        return reducescatter_grad(tensor, op, process_set, prescale_factor, postscale_factor,
                                  name)
    rt = runtime.get()
    run, d = _reducescatter_run(rt, _topo(rt, process_set), tensor, op, prescale_factor,
                                postscale_factor)
    return _dispatch(rt, run, d, False, name=name)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    name, op = _rs_name_op(name, op)
    rt = runtime.get()
    run, d = _reducescatter_run(rt, _topo(rt, process_set), tensor, op, prescale_factor,
                                postscale_factor)
    return _dispatch(rt, run, d, True, (tensor,), name)


def _grouped_reducescatter_run(rt, topo, tensors, op, prescale_factor, postscale_factor):
    _check_list(tensors, "grouped_reducescatter")
    runs = [_reducescatter_run(rt, topo, t, op, prescale_factor, postscale_factor)[0]
            for t in tensors]

    def run():
        return [r() for r in runs]

    return run, ("grouped_reducescatter", len(tensors))


def grouped_reducescatter(tensors: Sequence, name=None, compression=_NO_COMPRESSION, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    """``reducescatter`` of each tensor of a list, in one operation; returns a list."""
    name, op = _rs_name_op(name, op)
    _check_list(tensors, "grouped_reducescatter")
    if compression is not _NO_COMPRESSION and compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        outs = grouped_reducescatter([t for t, _ in pairs], name, None, op, process_set,
                                     prescale_factor, postscale_factor)
        return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]
    if any(_wants_grad(t) for t in tensors):
        from .autograd_ops import grouped_reducescatter_grad
        return grouped_reducescatter_grad(tensors, op, process_set, prescale_factor,
                                          postscale_factor, name)
    rt = runtime.get()
    run, d = _grouped_reducescatter_run(rt, _topo(rt, process_set), tensors, op,
                                        prescale_factor, postscale_factor)
    return _dispatch(rt, run, d, False, name=name)


def grouped_reducescatter_async(tensors: Sequence, name=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> Handle:
    name, op = _rs_name_op(name, op)
    rt = runtime.get()
    run, d = _grouped_reducescatter_run(rt, _topo(rt, process_set), tensors, op,
                                        prescale_factor, postscale_factor)
    return _dispatch(rt, run, d, True, tuple(tensors), name)


# -- join --------------------------------------------------------------------------------------

def join(device=-1) -> int:
    """This rank has run out of work: until every rank has joined, take part in the other
    ranks' allreduces with zeros (as Horovod). Returns the rank that joined last.

    Works with ``allreduce``/``grouped_allreduce`` called through this API with the agreement
    check on (the default: the check message carries the join flag). Any other collective
    while a rank has joined raises ``JoinedRankError`` on the ranks that called it (this rank
    stays joined, as in Horovod). Global process set only.
    ``device`` is accepted for Horovod compatibility (zeros are made on the CPU).
    """
    rt = runtime.get()
    topo = rt.topo
    if topo.size == 1:
        return 0
    if not consistency._enabled:
        raise BaguaMPIError("join() needs the agreement check (BAGUA_MPI_CHECK=1): its message "
                            "tells the other ranks that this rank has joined")
    comm, me = topo.comm, topo.rank

    def run():
        first, last = True, -1
        while True:
            buf = np.array([consistency._I64_MIN, consistency._I64_MIN, 1,
                            -consistency.NO_ACTIVE, me if first else -1], dtype=np.int64)
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
            first = False
            if buf[4] >= 0:
                last = int(buf[4])
            if buf[3] == -consistency.NO_ACTIVE:  # nobody is working any more
                return last
            root = int(-buf[3])
            signature, info = comm.bcast(None, root=root)
            if info is None:  # the working ranks raise (mismatch, or not an allreduce); as in
                continue      # Horovod, this rank stays joined
            messages, mop, hier = info
            for message in messages:
                wire_dt, numel = message[0], message[1]
                mop_i = message[2] if len(message) > 2 else mop
                if numel:
                    zeros = np.zeros(numel, dtype=np.float32 if wire_dt == "bfloat16"
                                     else np.dtype("bool" if wire_dt == "bool" else wire_dt))
                    _allreduce_mpi(topo, zeros, zeros, mop_i, hier)

    return rt.worker.run(run, ("join",))


# -- barrier, objects, handles -----------------------------------------------------------------

def barrier(process_set=global_process_set) -> None:
    """Block until every rank (of ``process_set``) reaches this point (behind any pending
    asynchronous work)."""
    rt = runtime.get()
    topo = _topo(rt, process_set)

    def run():
        if consistency._enabled:
            consistency.verify(topo.comm, ("barrier",))
        topo.comm.Barrier()

    rt.worker.run(run, ("barrier",))


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=global_process_set):
    """Send a picklable object from ``root_rank`` to all ranks (pickle in transit only)."""
    rt = runtime.get()
    topo = _topo(rt, process_set)
    root = _root(rt, root_rank, process_set)

    def run():
        if consistency._enabled:
            consistency.verify(topo.comm, ("broadcast_object", ("root", root)))
        return topo.comm.bcast(obj, root=root)

    return rt.worker.run(run, ("broadcast_object", root))


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """List of every rank's object, in rank order."""
    rt = runtime.get()
    topo = _topo(rt, process_set)

    def run():
        if consistency._enabled:
            consistency.verify(topo.comm, ("allgather_object",))
        return topo.comm.allgather(obj)

    return rt.worker.run(run, ("allgather_object",))


def poll(handle: Handle) -> bool:
    """True once the asynchronous operation behind ``handle`` has finished."""
    if not isinstance(handle, Handle):
        raise TypeError(f"poll() expects a bagua_mpi Handle, got {type(handle).__name__}")
    return handle.done()


def synchronize(handle: Handle, timeout: float | None = None):
    """Wait for ``handle``; return its result or raise its error (a ``BaguaMPIError``)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize() expects a bagua_mpi Handle, got {type(handle).__name__}")
    if _handle_names:
        try:
            return handle.wait(timeout)
        finally:
            if handle.done():
                _release(handle)
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
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier",
    "broadcast_object", "allgather_object", "poll", "synchronize", "submit",
    "hierarchical_allreduce_", "reducescatter_rows", "global_process_set", "BaguaMPIError",
]
