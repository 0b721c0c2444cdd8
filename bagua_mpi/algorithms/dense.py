"""C_FP_S on an arbitrary communicator: the dense exchange every algorithm shares.

``gradient_allreduce`` is nothing but this; the sparse and low-rank algorithms' warm-up stages,
PowerSGD's dense layers, 1-bit Adam's warm-up and the model averaging of ``local_sgd`` use it
too, so ``compression`` (a 16-bit wire), pre/post scaling, staging and byte accounting are
decided here once.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from .. import collectives, node_shared, process_groups, runtime, transport
from ..accounting import WireStats
from ..buffers import FusedTensors, scale_
from ..ops import Sum
from ..primitives.centralized import (cast_allreduce_, cast_reduce_scatter_,
                                      wire_bytes_cast_allreduce)
from ..transport import Transport


def allreduce_(t: torch.Tensor, comm: MPI.Intracomm, *, prescale: float, postscale: float,
               wire_dtype: torch.dtype | None, stats: WireStats,
               library_comm: MPI.Intracomm | None = None, backend: str | None = None,
               shared: bool = True) -> None:
    """In place: ``t <- postscale x sum over comm of (prescale x t)``.

    With ``wire_dtype`` (float16/bfloat16) a floating tensor travels as 16-bit words through
    the cast scatter-reduce (sums in float32), and so does a 16-bit tensor that MPI carries
    (``_sixteen_bit_words``). A host tensor that MPI carries, on the library's own
    communicator, goes through the collectives' allreduce (its zero-copy fast path); every
    other case through the transport (``transport.py``): NCCL or gloo in the tensor's own
    dtype; scaled by ``prescale`` before the sum and by ``postscale`` after it, where the
    tensor lives.

    ``shared`` (no rank inside ``join()``): a bucket in node-shared memory is reduced in place
    (``node_shared.py``; full precision inside a node, ``wire_dtype`` for what crosses nodes),
    when MPI carries host payloads.

    ``backend`` (default: ``init``'s choice or ``BAGUA_MPI_BACKEND``, see ``backends``):
    ``nccl_hierarchical`` sums a CUDA tensor on the library's communicator with NCCL inside
    each node and MPI among the node leaders; on a process set's communicator NCCL runs flat
    over the set's ranks.
    """
    if t.numel() == 0:
        return
    wire = Transport(comm, backend)
    n = wire.size
    host_mpi = wire.carrier(t) == "mpi"
    rows = node_shared.rows_of(t, comm) if shared and host_mpi else None
    if rows is not None:  # a node-shared bucket: reduced in place, 16-bit only across nodes
        rows.allreduce_(prescale * postscale, wire_dtype=wire_dtype)
        stats.shared(*rows.bytes_moved(wire_dtype))
        return
    words = _sixteen_bit_words(t, wire, wire_dtype)
    if words is not None:
        cast_allreduce_(t, wire, words, prescale * postscale)
        stats.add(wire_bytes_cast_allreduce(t.numel(), n, 2))
        return
    topo = runtime.get().topo
    if host_mpi and comm is library_comm and comm is topo.comm:
        # the collectives' zero-copy fast path, on the library's global communicator only: a
        # process set's own communicator takes the transport below (it once summed over every
        # rank)
        collectives.allreduce_(t, Sum, prescale_factor=prescale, postscale_factor=postscale,
                               hierarchical=False, check=False)
    else:
        work = t if t.is_contiguous() else t.contiguous()
        # scaled before the sum as well as after, as on every other path: NCCL and gloo sum
        # 16-bit floats in their own dtype, and a gradient_predivide_factor is what keeps
        # that sum in range
        scale_(work, prescale)
        # the global communicator: the collectives' chooser (NCCL flat or in the node); a
        # process set's communicator: its own group through the transport below
        if comm is library_comm and comm is topo.comm and collectives.uses_nccl_allreduce(
                work, topo, backend):
            transport.nccl_allreduce_(work, topo, backend)
        else:
            wire.allreduce_(work)
        if work is not t:
            t.copy_(work)
        scale_(t, postscale)
    stats.allreduce(t.numel() * t.element_size(), n)


def reduce_scatter_(padded: torch.Tensor, out: torch.Tensor, comm, *, prescale: float,
                    postscale: float, wire_dtype: torch.dtype | None, stats: WireStats,
                    backend: str | None = None) -> None:
    """``out <- postscale x (block rank of the sum over comm of prescale x padded)``: ZeRO
    stage 2's dense gradient exchange. ``padded`` holds n equal blocks of ``out``'s length (a
    sharded bucket's ``grad_storage``; it is scaled in place). With ``wire_dtype`` a floating
    tensor travels as 16-bit words: an alltoall of 16-bit blocks summed in float32 where the
    data lives (``cast_reduce_scatter_``, the first half of the 16-bit allreduce)."""
    wire = Transport(comm, backend)
    words = _sixteen_bit_words(padded, wire, wire_dtype)
    if words is not None:
        cast_reduce_scatter_(padded, out, wire, words, prescale * postscale)
        stats.add((wire.size - 1) * out.numel() * torch.finfo(words).bits // 8)
        return
    scale_(padded, prescale)
    wire.reduce_scatter(padded, out)
    scale_(out, postscale)
    stats.add((wire.size - 1) * out.numel() * out.element_size())


_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _sixteen_bit_words(t: torch.Tensor, wire: Transport,
                       wire_dtype: torch.dtype | None) -> torch.dtype | None:
    """The 16-bit words ``t`` travels as, summed in float32 where the data lives and rounded
    once (``cast_allreduce_``), or None for its own dtype on the wire: ``wire_dtype`` where it
    casts a floating tensor to another dtype; ``t``'s own dtype where ``t`` is 16-bit and MPI
    carries it (host, staged or CUDA-aware), since MPI, which has no 16-bit sum, moved it as
    float32, twice the bytes (and ``compression`` of its own dtype changed nothing). NCCL and
    gloo sum 16-bit floats themselves."""
    if wire_dtype is not None and t.is_floating_point() and t.dtype != wire_dtype:
        return wire_dtype
    if t.dtype in _SIXTEEN_BIT and wire.size > 1 \
            and wire.carrier(t) not in process_groups.LIBRARIES:
        return t.dtype
    return None


def fused_allreduce_(tensors: "list[torch.Tensor] | FusedTensors", comm, **kwargs) -> None:
    """``allreduce_`` of several same-dtype, same-device tensors as one message (a
    ``FusedTensors`` that a plan keeps, or a list fused for this call)."""
    fused = tensors if isinstance(tensors, FusedTensors) else FusedTensors(tensors)
    if fused.tensors:
        allreduce_(fused.gather(), comm, **kwargs)
        fused.scatter()
