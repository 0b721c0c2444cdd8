"""C_FP_S on an arbitrary communicator: the dense exchange every algorithm shares.

``gradient_allreduce`` is nothing but this; the sparse and low-rank algorithms' warm-up stages,
PowerSGD's dense layers, 1-bit Adam's warm-up and the model averaging of ``local_sgd`` use it
too, so ``compression`` (a 16-bit wire), pre/post scaling, staging and byte accounting are
decided here once.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from .. import backends, collectives, node_shared, runtime
from .. import cuda as cuda_support
from ..accounting import WireStats, staging
from ..buffers import scale_
from ..ops import Sum
from ..primitives.centralized import cast_allreduce_, wire_bytes_cast_allreduce
from .staging import reducible


def allreduce_(t: torch.Tensor, comm: MPI.Intracomm, *, prescale: float, postscale: float,
               wire_dtype: torch.dtype | None, stats: WireStats,
               library_comm: MPI.Intracomm | None = None, backend: str | None = None,
               shared: bool = True) -> None:
    """In place: ``t <- postscale x sum over comm of (prescale x t)``.

    With ``wire_dtype`` (float16/bfloat16) a floating tensor travels as 16-bit words through
    the cast scatter-reduce (sums in float32). On the library's own communicator the
    collectives' allreduce runs (its zero-copy fast path); on another one (node leaders) an
    MPI allreduce of the reducible form of ``t``.

    ``shared`` (no rank inside ``join()``): a bucket in node-shared memory is reduced in place
    (``node_shared.py``; full precision inside a node, ``wire_dtype`` for what crosses nodes).

    ``backend`` (default: ``init``'s choice or ``BAGUA_MPI_BACKEND``, see ``backends``): with
    ``nccl``/``nccl_hierarchical`` a CUDA tensor on the library's communicator is summed by
    NCCL (in its own dtype) and scaled on the device; a 16-bit ``wire_dtype`` keeps its cast
    scatter-reduce (float32 sums), and the node leaders' communicator stays MPI. On a
    process set's communicator NCCL runs flat over the set's ranks.
    """
    if t.numel() == 0:
        return
    n = comm.Get_size()
    rows = node_shared.rows_of(t, comm) if shared else None
    if rows is not None:  # a node-shared bucket: reduced in place, 16-bit only across nodes
        rows.allreduce_(prescale * postscale, wire_dtype=wire_dtype)
        stats.shared(*rows.bytes_moved(wire_dtype))
        return
    if wire_dtype is not None and t.is_floating_point() and t.dtype != wire_dtype:
        cast_allreduce_(t, comm, wire_dtype, prescale * postscale)
        stats.add(wire_bytes_cast_allreduce(t.numel(), n, 2))
        return
    if comm is library_comm and backends.uses_nccl(t, backend):
        work = t if t.is_contiguous() else t.contiguous()
        topo = runtime.get().topo
        if comm is topo.comm:
            backends.allreduce_(work, topo, backend)
        else:  # a process set's communicator: one NCCL group over its ranks
            backends.group(comm).allreduce_(work)
        if work is not t:
            t.copy_(work)
        scale_(t, prescale * postscale)
    elif comm is library_comm and comm is runtime.get().topo.comm:
        # the collectives run on the library's global communicator; a process set's own
        # communicator takes the generic path below (it once summed over every rank)
        if t.is_cuda and not cuda_support.mpi_is_cuda_aware():
            staging.d2h(t.numel() * t.element_size(), dense=True)  # collectives stage it
            staging.h2d(t.numel() * t.element_size())
        collectives.allreduce_(t, Sum, prescale_factor=prescale, postscale_factor=postscale,
                               hierarchical=False, check=False)
    else:
        with reducible(t) as buf:
            if n > 1:
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        scale_(t, prescale * postscale)
    stats.allreduce(t.numel() * t.element_size(), n)


def fused_allreduce_(tensors: list[torch.Tensor], comm, **kwargs) -> None:
    """``allreduce_`` of several same-dtype, same-device tensors as one message."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    if len(tensors) == 1:
        allreduce_(tensors[0], comm, **kwargs)
        return
    fused = torch.cat([t.detach().reshape(-1) for t in tensors])
    allreduce_(fused, comm, **kwargs)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(fused[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
