"""Data movement without autograd: allgather, broadcast, alltoall and reducescatter, with their
grouped, in-place and asynchronous forms.

Each runs on MPI (``transport.mpi_buffer``: host memory, a CUDA-aware MPI, or a pinned host
copy), or on a process group where the tensor's carrier is one (NCCL for a CUDA tensor, gloo
for a host tensor under backend ``gloo``): ``_group_movement.py``. The agreement check and the
header of sizes go over MPI either way.

The ``plain_*`` functions are the out-of-place forms for tensors that need no gradient: the
public functions (``_public.py``) and the differentiable versions (``_autograd.py``) both come
here.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .. import consistency, runtime, transport
from ..buffers import (contiguous, copy_into, dtype_name, empty_like, reduce_dtype, scale_,
                       scaled_copy, to_dtype)
from ..exceptions import BaguaMPIError
from ..ops import Average, ReduceOp
from ..worker import Handle
from . import _group_movement as group
from ._grouped_allgather import grouped_allgather_run
from ._grouped_reducescatter import grouped_reducescatter_run
from ._core import (agree, check_factor, check_list, global_process_set, name_and_op, reduction,
                    root_of, row_elems, rows_of_every_rank, run_now, start, topo_of)


# -- allgather ---------------------------------------------------------------------------------

def allgather_run(rt, topo, tensor):
    """``(run, describe)``; ``run()`` returns ``(gathered, rows of every rank)``."""
    dt = dtype_name(tensor)
    x = tensor if tensor.ndim > 0 else tensor.reshape(1)
    shape = tuple(x.shape)
    row = row_elems(shape)
    wire = group.group_wire(x, topo)
    signature = ("allgather", ("dtype", dt), ("trailing_shape", shape[1:])) + group.wire_field(
        wire, x)

    def run():
        counts = rows_of_every_rank(topo.comm, signature, [shape[0]])[:, 0]
        out = empty_like(x, (int(counts.sum()),) + shape[1:])
        if wire is not None:
            group.allgather(wire, contiguous(x), counts, out)
            return out, counts
        src, dst = transport.mpi_buffer(contiguous(x)), transport.mpi_buffer(out, load=False)
        topo.comm.Allgatherv(src.obj, [dst.obj, counts * row])
        dst.writeback()
        return out, counts

    return run, ("allgather", dt, shape)


def _gathered(run):
    return lambda: run()[0]


def allgather_with_rows(tensor, process_set=global_process_set, name=None):
    """``(gathered, rows of every rank)``: the allgather a gradient needs the rows of."""
    rt = runtime.get()
    run, d = allgather_run(rt, topo_of(rt, process_set), tensor)
    return run_now(rt, run, d, (tensor,), name)


def plain_allgather(tensor, name=None, process_set=global_process_set):
    """``allgather`` of a tensor that needs no gradient."""
    rt = runtime.get()
    run, d = allgather_run(rt, topo_of(rt, process_set), tensor)
    return run_now(rt, _gathered(run), d, (tensor,), name)


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    rt = runtime.get()
    run, d = allgather_run(rt, topo_of(rt, process_set), tensor)
    return start(rt, _gathered(run), d, (tensor,), name)


def _grouped_allgather_run(rt, topo, tensors):
    return grouped_allgather_run(topo, tensors, lambda t: allgather_run(rt, topo, t)[0])


def grouped_allgather_with_rows(tensors: Sequence, process_set=global_process_set,
                                name=None) -> list:
    """``[(gathered, rows of every rank), ...]``, one pair per tensor."""
    rt = runtime.get()
    run, d = _grouped_allgather_run(rt, topo_of(rt, process_set), tensors)
    return run_now(rt, run, d, tuple(tensors), name)


def _all_gathered(run):
    return lambda: [out for out, _ in run()]


def plain_grouped_allgather(tensors: Sequence, name=None,
                            process_set=global_process_set) -> list:
    """``grouped_allgather`` of tensors that need no gradient."""
    rt = runtime.get()
    run, d = _grouped_allgather_run(rt, topo_of(rt, process_set), tensors)
    return run_now(rt, _all_gathered(run), d, tuple(tensors), name)


def grouped_allgather_async(tensors: Sequence, name=None,
                            process_set=global_process_set) -> Handle:
    rt = runtime.get()
    run, d = _grouped_allgather_run(rt, topo_of(rt, process_set), tensors)
    return start(rt, _all_gathered(run), d, tuple(tensors), name)


# -- broadcast ---------------------------------------------------------------------------------

def _broadcast_run(rt, topo, tensor, out, root):
    dt = dtype_name(tensor)
    wire = group.group_wire(tensor, topo)
    signature = ("broadcast", ("root", root), ("dtype", dt),
                 ("shape", tuple(tensor.shape))) + group.wire_field(wire, tensor)

    def run():
        agree(topo.comm, signature)
        if out is not tensor and topo.rank == root:
            copy_into(out, tensor)
        if wire is not None:
            group.broadcast_(wire, out, root)
            return out
        buf = transport.mpi_buffer(out, load=topo.rank == root)
        topo.comm.Bcast(buf.obj, root=root)
        buf.writeback()
        return out

    return run, ("broadcast", root, dt, tuple(tensor.shape))


def plain_broadcast(tensor, root_rank: int = 0, name=None, process_set=global_process_set):
    """``broadcast`` of a tensor that needs no gradient."""
    rt = runtime.get()
    run, d = _broadcast_run(rt, topo_of(rt, process_set), tensor, empty_like(tensor),
                            root_of(rt, root_rank, process_set))
    return run_now(rt, run, d, (tensor,), name)


def broadcast_(tensor, root_rank: int = 0, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` on every rank with ``root_rank``'s; returns it."""
    rt = runtime.get()
    run, d = _broadcast_run(rt, topo_of(rt, process_set), tensor, tensor,
                            root_of(rt, root_rank, process_set))
    return run_now(rt, run, d, (tensor,), name)


def broadcast_async(tensor, root_rank: int = 0, name=None,
                    process_set=global_process_set) -> Handle:
    rt = runtime.get()
    out = empty_like(tensor)
    run, d = _broadcast_run(rt, topo_of(rt, process_set), tensor, out,
                            root_of(rt, root_rank, process_set))
    return start(rt, run, d, (tensor, out), name)


def broadcast_async_(tensor, root_rank: int = 0, name=None,
                     process_set=global_process_set) -> Handle:
    rt = runtime.get()
    run, d = _broadcast_run(rt, topo_of(rt, process_set), tensor, tensor,
                            root_of(rt, root_rank, process_set))
    return start(rt, run, d, (tensor,), name)


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
    row = row_elems(shape)
    wire = group.group_wire(tensor, topo)
    signature = ("alltoall", ("dtype", dt), ("trailing_shape", shape[1:])) + group.wire_field(
        wire, tensor)

    def run():
        agree(topo.comm, signature)
        header = np.empty((topo.size, 2), dtype=np.int64)
        header[:, 0] = consistency.signature_hash(signature)
        header[:, 1] = send_splits
        received = np.empty_like(header)
        topo.comm.Alltoall(header, received)
        consistency.verify_hashes(topo.comm, received[:, 0], signature)
        recv_splits = received[:, 1].copy()
        out = empty_like(tensor, (int(recv_splits.sum()),) + shape[1:])
        if wire is not None:
            wire.alltoallv(contiguous(tensor), send_splits * row, out, recv_splits * row)
        else:
            src = transport.mpi_buffer(contiguous(tensor))
            dst = transport.mpi_buffer(out, load=False)
            topo.comm.Alltoallv([src.obj, send_splits * row], [dst.obj, recv_splits * row])
            dst.writeback()
        if not with_splits:
            return out
        if isinstance(tensor, torch.Tensor):
            recv_splits = splits_tensor(recv_splits)
        return out, recv_splits

    return run, ("alltoall", dt, shape)


def splits_tensor(splits: np.ndarray) -> torch.Tensor:
    """Received splits as Horovod returns them, an int32 tensor, or int64 where a split is
    2^31 rows or more (int32 would wrap it negative, and a backward pass given it refuses)."""
    fits = splits.size == 0 or int(splits.max()) <= np.iinfo(np.int32).max
    return torch.from_numpy(splits.astype(np.int32 if fits else np.int64))


def plain_alltoall(tensor, splits=None, name=None, process_set=global_process_set,
                   with_splits: bool = False):
    """``alltoall`` of a tensor that needs no gradient: ``(tensor, received_splits)`` when
    ``with_splits``, else the tensor."""
    rt = runtime.get()
    run, d = _alltoall_run(rt, topo_of(rt, process_set), tensor, splits, with_splits)
    return run_now(rt, run, d, (tensor,), name)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set, *,
                   return_received_splits: bool | None = None) -> Handle:
    """``synchronize(handle)`` gives ``(tensor, received_splits)`` unless
    ``return_received_splits=False`` (Horovod's handle always gives both)."""
    with_splits = True if return_received_splits is None else bool(return_received_splits)
    rt = runtime.get()
    run, d = _alltoall_run(rt, topo_of(rt, process_set), tensor, splits, with_splits)
    return start(rt, run, d, (tensor,), name)


# -- reducescatter -----------------------------------------------------------------------------

def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Rows of the result each rank keeps: equal parts, the first ``rows % size`` get one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


class ReducescatterPlan:
    """One tensor's reducescatter, checked and sized when the call is made: ``work()`` gives
    the buffer to reduce (in its wire dtype, prescaled), ``exchange`` reduces it on its wire,
    ``finish(result)`` postscales this rank's rows into the output. ``wire`` is the process
    group's transport, or None for MPI; a group packs several plans into one exchange
    (``_grouped_reducescatter.py``)."""

    def __init__(self, topo, tensor, op, prescale_factor, postscale_factor):
        self.dt = dt = dtype_name(tensor)
        if tensor.ndim == 0:
            raise ValueError("reducescatter needs a tensor with at least one dimension")
        if ReduceOp.parse(op) is ReduceOp.Adasum:  # Horovod's core refuses it too
            raise BaguaMPIError("reducescatter does not support op=Adasum (Horovod's "
                                "reducescatter takes Sum and Average only); use "
                                "allreduce(op=Adasum)")
        self.op, self.mop, _ = reduction(op, dt)
        self.pre = check_factor("prescale_factor", prescale_factor, dt)
        self.post = check_factor("postscale_factor", postscale_factor, dt)
        if self.op is Average:
            self.post /= topo.size
        self.topo, self.tensor, self.shape = topo, tensor, tuple(tensor.shape)
        self.rows = reducescatter_rows(self.shape[0], topo.size)
        self.row = row_elems(self.shape)
        self.out = empty_like(tensor, (self.rows[topo.rank],) + self.shape[1:])
        self.wire_dt = reduce_dtype(dt)
        wire = group.group_wire(tensor, topo)
        self.group_op = None if wire is None else group.reduction_name(self.wire_dt, self.mop)
        # an op or dtype the libraries do not reduce: MPI, as for host tensors
        self.wire = wire if self.group_op is not None else None
        self.signature = ("reducescatter", ("op", self.op.name), ("dtype", dt),
                          ("shape", self.shape)) + group.wire_field(self.wire, tensor)

    def work(self):
        tensor, dt, pre = self.tensor, self.dt, self.pre
        if self.wire_dt != dt:  # 16-bit floats: a float32 copy, scaled in float32
            work = to_dtype(tensor, self.wire_dt)
            scale_(work, pre)
        elif pre != 1.0:  # a scaled copy: the caller's tensor stays as it was (integers are
            work = empty_like(tensor)  # scaled in float64 and truncated, as Horovod)
            scaled_copy(work, contiguous(tensor), pre)
        else:
            work = contiguous(tensor)
        return work

    def result_buffer(self):
        return self.out if self.wire_dt == self.dt else empty_like(self.out, dtype=self.wire_dt)

    def exchange(self, work, result) -> None:
        if self.wire is not None:
            group.reducescatter(self.wire, work, self.rows, result, self.group_op)
            return
        src, dst = transport.mpi_buffer(work), transport.mpi_buffer(result, load=False)
        self.topo.comm.Reduce_scatter(src.obj, dst.obj,
                                      recvcounts=[r * self.row for r in self.rows], op=self.mop)
        dst.writeback()

    def finish(self, result):
        scale_(result, self.post)
        if result is not self.out:
            copy_into(self.out, result)
        return self.out

    def run(self):
        agree(self.topo.comm, self.signature)
        work, result = self.work(), self.result_buffer()
        self.exchange(work, result)
        return self.finish(result)


def _reducescatter_run(rt, topo, tensor, op, prescale_factor, postscale_factor):
    plan = ReducescatterPlan(topo, tensor, op, prescale_factor, postscale_factor)
    return plan.run, ("reducescatter", plan.op.name, plan.dt, plan.shape)


def plain_reducescatter(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """``reducescatter`` of a tensor that needs no gradient (``name``/``op`` sorted out)."""
    rt = runtime.get()
    run, d = _reducescatter_run(rt, topo_of(rt, process_set), tensor, op, prescale_factor,
                                postscale_factor)
    return run_now(rt, run, d, (tensor,), name)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    name, op = name_and_op(name, op)
    rt = runtime.get()
    run, d = _reducescatter_run(rt, topo_of(rt, process_set), tensor, op, prescale_factor,
                                postscale_factor)
    return start(rt, run, d, (tensor,), name)


def _grouped_reducescatter_run(rt, topo, tensors, op, prescale_factor, postscale_factor):
    check_list(tensors, "grouped_reducescatter")
    plans = [ReducescatterPlan(topo, t, op, prescale_factor, postscale_factor) for t in tensors]
    return grouped_reducescatter_run(topo, plans), ("grouped_reducescatter", len(tensors))


def plain_grouped_reducescatter(tensors: Sequence, name=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> list:
    """``grouped_reducescatter`` of tensors that need no gradient."""
    rt = runtime.get()
    run, d = _grouped_reducescatter_run(rt, topo_of(rt, process_set), tensors, op,
                                        prescale_factor, postscale_factor)
    return run_now(rt, run, d, tuple(tensors), name)


def grouped_reducescatter_async(tensors: Sequence, name=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> Handle:
    name, op = name_and_op(name, op)
    rt = runtime.get()
    run, d = _grouped_reducescatter_run(rt, topo_of(rt, process_set), tensors, op,
                                        prescale_factor, postscale_factor)
    return start(rt, run, d, tuple(tensors), name)
