"""How one buffer is allreduced in place, and the one rule that picks NCCL or MPI for it.

``allreduce`` and ``grouped_allreduce`` (and ``join``, which contributes zeros the way the
training ranks reduce: ``join_route``) hand their working buffer, already scaled and in its
wire dtype, to a reducer of this module:

* ``mpi_allreduce_``: MPI on host memory, or on a CUDA tensor through ``transport.mpi_buffer``
  (CUDA-aware MPI or a pinned host copy); flat, or two-level with ``hierarchical``;
* ``nccl_allreduce_``: the NCCL backend (``transport.nccl_allreduce_``), which decides its own
  flat or two-level form (``nccl_hierarchical``).

``uses_nccl_allreduce`` is the rule, ``reducer_for`` applies it.
"""
from __future__ import annotations

from mpi4py import MPI

from .. import backends, transport
from ..buffers import fast_cpu_view
from ._group_movement import reduction_name


def uses_nccl_allreduce(tensor, topo, backend: str | None = None) -> bool:
    """Whether a dense allreduce of ``tensor`` over ``topo`` (the global set's or a process
    set's) runs on NCCL: a CUDA tensor with a NCCL backend (``backend``, default the
    process-wide choice: ``transport.uses_nccl``). An explicit NCCL choice that cannot run
    raises ``BackendUnavailableError``."""
    return getattr(tensor, "is_cuda", False) and transport.uses_nccl(tensor, backend)


def join_route(tensor, topo, backend: str | None = None, comm=None) -> tuple:
    """How a rank inside ``join()`` must add its zeros to a dense allreduce of ``tensor`` over
    ``comm`` (default ``topo.comm``) so that it meets the training ranks on the same wire:
    ``("mpi",)``; ``("nccl", form)`` (``transport.nccl_allreduce_`` in that form: ``nccl``,
    flat, or ``nccl_hierarchical``); or ``("transport", backend, device type)`` (a process
    group, or MPI on device memory). Sent to the joined rank in the agreement message."""
    comm = topo.comm if comm is None else comm
    if comm is topo.comm and uses_nccl_allreduce(tensor, topo, backend):
        hierarchical = backends.resolve(backend) == "nccl_hierarchical"
        return ("nccl", "nccl_hierarchical" if hierarchical else "nccl")
    wire = transport.Transport(comm, backend)
    if wire.carrier(tensor) == "mpi":
        return ("mpi",)
    return ("transport", backend, "cuda" if getattr(tensor, "is_cuda", False) else "cpu")


def reducer_for(tensor, topo, reductions):
    """``nccl_allreduce_`` or ``mpi_allreduce_`` for ``tensor`` (or a buffer made from it),
    whose messages reduce ``reductions``, (wire dtype, MPI op) pairs: MPI where NCCL cannot
    reduce one of them (``reduction_name``: 16-bit integers, bool, a logical op), as for a
    reducescatter. Chosen in the caller, when the operation is built, so a backend error
    raises there."""
    if uses_nccl_allreduce(tensor, topo) and all(reduction_name(wire_dtype, mop) is not None
                                                 for wire_dtype, mop in reductions):
        return nccl_allreduce_
    return mpi_allreduce_


def mpi_allreduce_(topo, buf, mop, hierarchical: bool) -> None:
    """In place over ``topo`` with MPI op ``mop``: a tensor or array, staged where needed."""
    view = fast_cpu_view(buf)
    if view is not None and not hierarchical:  # the common case: no wrapper objects at all
        topo.comm.Allreduce(MPI.IN_PLACE, view, op=mop)
        return
    staged = transport.mpi_buffer(buf)
    mpi_allreduce_buffer_(topo, staged.obj, mop, hierarchical)
    staged.writeback()


def mpi_allreduce_buffer_(topo, buf, mop, hierarchical: bool) -> None:
    """In place on a buffer MPI takes as it is (a NumPy array, or a CUDA tensor for a
    CUDA-aware MPI)."""
    if hierarchical:
        hierarchical_allreduce_(topo, buf, mop)
    else:
        topo.comm.Allreduce(MPI.IN_PLACE, buf, op=mop)


def hierarchical_allreduce_(topo, buf, mop) -> None:
    """Two-level allreduce in place: reduce to each node's leader, allreduce among leaders,
    broadcast inside each node. Same result as the flat one up to summation order."""
    topo.node_reduce_(buf, mop)
    if topo.leaders is not None and topo.leaders.Get_size() > 1:
        topo.leaders.Allreduce(MPI.IN_PLACE, buf, op=mop)
    topo.node_broadcast_(buf)


def nccl_allreduce_(topo, buf, mop, hierarchical: bool) -> None:
    """In place on a CUDA tensor with the NCCL backend (``hierarchical`` is left to the
    backend: ``nccl_hierarchical``)."""
    work = buf if buf.is_contiguous() else buf.contiguous()
    op = transport.op_named(mop) or f"MPI op {mop!r}"
    transport.nccl_allreduce_(work, topo, op=op)
    if work is not buf:
        buf.copy_(work)
