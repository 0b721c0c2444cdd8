"""Allreduce and grouped allreduce, without autograd: the fast path for small plain calls, the
general path (scaling factors, 16-bit floats, integer averages, process sets, two-level,
Adasum, NCCL), and the in-place and asynchronous forms.

``plain_allreduce`` and ``plain_grouped_allreduce`` are the out-of-place forms for tensors that
need no gradient: the public ``allreduce``/``grouped_allreduce`` (``_public.py``) and the
differentiable versions (``_autograd.py``) both come here.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from mpi4py import MPI

from .. import consistency, runtime, timeline
from ..buffers import (HALF, INTEGER, copy_into, copy_split, dtype_name, empty_like,
                       flatten, reduce_dtype, scale_, scaled_copy, to_dtype)
from ..ops import Average, ReduceOp, mpi_op
from ..primitives import adasum
from ..worker import Handle
from ._allreduce_backends import join_route, nccl_allreduce_, reducer_for
from ._complex import allreduce_op, complex_as_real
from ._core import (check_factor, check_list, check_wanted, global_process_set, reduction,
                    resolve_op, run_now, start, topo_of)


# -- one tensor --------------------------------------------------------------------------------

def _verify_allreduce(comm, op, dt: str, shape: tuple, mop, hier: bool,
                      route: tuple = ("mpi",)) -> None:
    """The agreement check of an allreduce: one record for the general and the fast path, so
    ranks taking different paths for the same call still agree (and disagreeing calls raise).
    ``route``: how a joined rank adds its zeros (``join_route``)."""
    signature = ("allreduce", ("op", op.name), ("dtype", dt), ("shape", shape))
    if hier or route[0] == "nccl":  # the flat MPI allreduce (the fast path's) says nothing more
        signature += _route_fields(route, hier)
    consistency.verify(comm, signature, (((reduce_dtype(dt), math.prod(shape)),), mop, hier,
                                         route))


def _route_fields(route: tuple, hier: bool) -> tuple:
    """What the signature says of how the allreduce runs, where that is not the flat MPI
    allreduce (whose signature says nothing of it): ``("wire", "nccl")`` on NCCL, so ranks
    whose ``auto`` decided differently (a node with a GPU per rank and one without) disagree
    in the check by name instead of each waiting in a library the other never calls, and
    ``("wire", "nccl_hierarchical")`` for NCCL's two-level form, whose groups are the node's,
    not the job's; else ``("hierarchical", True)`` for MPI's two-level form (node, leaders,
    node), whose calls never meet a flat allreduce's. NCCL's form is the backend's, so there
    ``hier`` is not said."""
    if route[0] == "nccl":
        return (("wire", route[1]),)
    return (("hierarchical", True),) if hier else ()


def _allreduce_run(rt, topo, tensor, out, op, prescale_factor, postscale_factor, hierarchical,
                   check=None):
    dt = dtype_name(tensor)
    if type(op) is not ReduceOp:
        op = ReduceOp.parse(op)
    if op is ReduceOp.Adasum:  # Horovod's adaptive summation, flat (hierarchical= ignored)
        return adasum.allreduce_run(topo.comm, [tensor], [out],
                                    check_factor("prescale_factor", prescale_factor, dt),
                                    check_factor("postscale_factor", postscale_factor, dt),
                                    check)
    int_average = op is Average and dt in INTEGER
    mop = MPI.SUM if int_average else mpi_op(op, dt)
    pre = 1.0 if prescale_factor == 1.0 else check_factor("prescale_factor", prescale_factor, dt)
    post = (1.0 if postscale_factor == 1.0
            else check_factor("postscale_factor", postscale_factor, dt))
    if int_average:
        post /= topo.size
    elif op is Average:
        # Average divides *before* the sum, fused into the copy into the output that an
        # out-of-place allreduce makes anyway (MPICH copies send to receive buffer first).
        pre /= topo.size
    hier = rt.hierarchical if hierarchical is None else bool(hierarchical)
    shape = tuple(tensor.shape)
    numel = math.prod(shape)
    reduce_ = reducer_for(tensor, topo, [(reduce_dtype(dt), mop)])
    route = join_route(tensor, topo) if reduce_ is nccl_allreduce_ else ("mpi",)

    def run():
        if check_wanted(check):
            _verify_allreduce(topo.comm, op, dt, shape, mop, hier, route)
        if numel == 0:
            return out
        if dt in HALF:  # reduce in float32, round once at the end
            work = to_dtype(tensor, reduce_dtype(dt))
            scale_(work, pre)
            reduce_(topo, work, mop, hier)
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
        reduce_(topo, out, mop, hier)
        scale_(out, post)
        return out

    return run, ("allreduce", op.name, dt, shape)


_FAST_OPS = {"Sum": MPI.SUM, "Average": MPI.SUM, "Min": MPI.MIN, "Max": MPI.MAX}
# Out of place, the fast path allocates with torch.empty; from 1 MiB on, ``empty_like``'s
# NumPy allocation (transparent huge pages) is worth its few microseconds.
_FAST_OUT_OF_PLACE_BYTES = 1 << 20
_FAST_DTYPES = {torch.float32: (MPI.FLOAT, "float32", np.float32),
                torch.float64: (MPI.DOUBLE, "float64", np.float64)}


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


def _fast_path_options(rt, name, process_set, prescale_factor, postscale_factor,
                       hierarchical) -> bool:
    """Options that leave an allreduce to ``_fast_allreduce`` (it checks the tensor itself)."""
    return (name is None and process_set is global_process_set and prescale_factor == 1.0
            and postscale_factor == 1.0 and timeline._collective is None
            and not (rt.hierarchical if hierarchical is None else hierarchical))


def plain_allreduce(tensor, op, name=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set, hierarchical=None, check=None):
    """``allreduce`` of a tensor that needs no gradient, ``op`` already resolved: a new
    tensor."""
    rt = runtime.get()
    if _fast_path_options(rt, name, process_set, prescale_factor, postscale_factor,
                          hierarchical):
        out = _fast_allreduce(rt, tensor, op, False, check_wanted(check))
        if out is not None:
            return out
    run, d = _allreduce_run(rt, topo_of(rt, process_set), tensor, empty_like(tensor), op,
                            prescale_factor, postscale_factor, hierarchical, check)
    return run_now(rt, run, d, (tensor,), name)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, *, hierarchical=None,
               check=None):
    """In-place ``allreduce``: the result overwrites ``tensor``, which is returned."""
    if isinstance(tensor, torch.Tensor) and tensor.is_complex():
        return _complex_allreduce_(tensor, average, name, op, prescale_factor,
                                   postscale_factor, process_set, hierarchical=hierarchical,
                                   check=check)
    op = resolve_op(average, op)
    rt = runtime.get()
    if (_fast_path_options(rt, name, process_set, prescale_factor, postscale_factor,
                           hierarchical)
            and _fast_allreduce(rt, tensor, op, True, check_wanted(check)) is not None):
        return tensor
    run, d = _allreduce_run(rt, topo_of(rt, process_set), tensor, tensor, op, prescale_factor,
                            postscale_factor, hierarchical, check)
    return run_now(rt, run, d, (tensor,), name)


_complex_allreduce_ = complex_as_real(allreduce_, allreduce_op)  # its real view, in place


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, *, hierarchical=None,
                    check=None) -> Handle:
    """Start an ``allreduce``; ``synchronize(handle)`` returns the new tensor."""
    op = resolve_op(average, op)
    rt = runtime.get()
    out = empty_like(tensor)
    run, d = _allreduce_run(rt, topo_of(rt, process_set), tensor, out, op, prescale_factor,
                            postscale_factor, hierarchical, check)
    return start(rt, run, d, (tensor, out), name)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, *, hierarchical=None,
                     check=None) -> Handle:
    """Start an in-place ``allreduce``; do not touch ``tensor`` until it completes."""
    op = resolve_op(average, op)
    rt = runtime.get()
    run, d = _allreduce_run(rt, topo_of(rt, process_set), tensor, tensor, op, prescale_factor,
                            postscale_factor, hierarchical, check)
    return start(rt, run, d, (tensor,), name)


# -- a list of tensors as one message per wire dtype -------------------------------------------

def _grouped_run(rt, topo, tensors, outs, op, prescale_factor, postscale_factor, hierarchical,
                 check=None):
    check_list(tensors, "grouped_allreduce")
    kinds = {(type(t).__name__, str(getattr(t, "device", "cpu"))) for t in tensors}
    if len(kinds) > 1:
        raise TypeError(f"grouped_allreduce needs tensors of one kind and device, got {kinds}")
    dts = [dtype_name(t) for t in tensors]
    op = ReduceOp.parse(op)
    if op is ReduceOp.Adasum:  # each tensor combined on its own, as Horovod
        return adasum.allreduce_run(topo.comm, tensors, outs,
                                    check_factor("prescale_factor", prescale_factor, "float32"),
                                    check_factor("postscale_factor", postscale_factor, "float32"),
                                    check, grouped=True)
    groups: dict[tuple, list[int]] = {}
    for i, dt in enumerate(dts):
        _, mop, int_average = reduction(op, dt)
        check_factor("prescale_factor", prescale_factor, dt)
        check_factor("postscale_factor", postscale_factor, dt)
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
    # one kind and device: one reducer for every message
    reduce_ = reducer_for(tensors[0], topo, [(wire_dt, mop) for wire_dt, _, mop, _, _ in plan])
    route = join_route(tensors[0], topo) if reduce_ is nccl_allreduce_ else ("mpi",)
    signature += _route_fields(route, hier)
    join_info = (tuple((w, n, m) for w, _, m, _, n in plan), None, hier, route)

    def run():
        if check_wanted(check):
            consistency.verify(topo.comm, signature, join_info)
        for wire_dt, idx, mop, post, numel in plan:
            if numel == 0:
                continue
            fused = flatten([tensors[i] for i in idx], wire_dt)  # one message per wire dtype
            scale_(fused, pre)
            reduce_(topo, fused, mop, hier)
            scale_(fused, post)
            copy_split(fused, [outs[i] for i in idx])
        return outs

    return run, ("grouped_allreduce", op.name, len(tensors))


def plain_grouped_allreduce(tensors: Sequence, op, name=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set,
                            hierarchical=None, check=None) -> list:
    """``grouped_allreduce`` of tensors that need no gradient, ``op`` already resolved."""
    rt = runtime.get()
    outs = [empty_like(t) for t in tensors]
    run, d = _grouped_run(rt, topo_of(rt, process_set), tensors, outs, op, prescale_factor,
                          postscale_factor, hierarchical, check)
    return run_now(rt, run, d, tuple(tensors), name)


def grouped_allreduce_(tensors: Sequence, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, *,
                       hierarchical=None, check=None) -> list:
    """In-place ``grouped_allreduce``: the results overwrite ``tensors``."""
    op = resolve_op(average, op)
    rt = runtime.get()
    run, d = _grouped_run(rt, topo_of(rt, process_set), tensors, tensors, op, prescale_factor,
                          postscale_factor, hierarchical, check)
    return run_now(rt, run, d, tuple(tensors), name)


def grouped_allreduce_async(tensors: Sequence, average=None, name=None, op=None,
                            prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set, *, hierarchical=None,
                            check=None) -> Handle:
    op = resolve_op(average, op)
    check_list(tensors, "grouped_allreduce")
    rt = runtime.get()
    outs = [empty_like(t) for t in tensors]
    run, d = _grouped_run(rt, topo_of(rt, process_set), tensors, outs, op, prescale_factor,
                          postscale_factor, hierarchical, check)
    return start(rt, run, d, tuple(tensors) + tuple(outs), name)


def grouped_allreduce_async_(tensors: Sequence, average=None, name=None, op=None,
                             prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set, *, hierarchical=None,
                             check=None) -> Handle:
    op = resolve_op(average, op)
    rt = runtime.get()
    run, d = _grouped_run(rt, topo_of(rt, process_set), tensors, tensors, op, prescale_factor,
                          postscale_factor, hierarchical, check)
    return start(rt, run, d, tuple(tensors), name)
