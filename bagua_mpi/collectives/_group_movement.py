"""Allgather, broadcast, alltoall and reducescatter of a tensor whose carrier is a process group:
NCCL for a CUDA tensor (where the backend takes NCCL), gloo for a host tensor under backend
``gloo`` (how CI runs this code without a GPU).

``_movement.py`` builds each operation as for MPI (arguments, the agreement check, the header
of sizes every rank exchanges over MPI) and hands the payload to ``transport.Transport`` here
when ``group_wire`` gives one. So the payload stays on the device, and the sizes, which the
ranks learn from the header, never cost a device-to-host copy. The libraries' collectives take
equal blocks, so uneven rows travel as follows:

* allgather: each rank's rows padded to the most any rank has, one allgather, then one
  concatenation that leaves the padding out;
* alltoall: the library's own counts per rank (``Transport.alltoallv``), nothing padded;
* reducescatter: the first ``rows % size`` ranks keep one row more, so a block is padded by one
  row at most (zeros), one reduce-scatter;
* broadcast: the tensor as it is (a contiguous copy of a strided one).

A grouped allgather or reducescatter packs the whole group into one exchange on the same wire
(``_grouped_allgather.py``, ``_grouped_reducescatter.py``).
"""
from __future__ import annotations

import torch

from .. import backends, process_groups, transport

# wire dtypes that both NCCL and gloo reduce (NCCL has no 16-bit integers, and neither reduces
# bool); 16-bit floats arrive here as float32, as the MPI path reduces them
_REDUCIBLE = frozenset({"float32", "float64", "int32", "int64", "int8", "uint8"})


def group_wire(tensor, topo) -> transport.Transport | None:
    """The transport for a data-movement collective of ``tensor`` over ``topo``, when its
    carrier is a process group (a torch tensor; on a process set, the group over the set's
    communicator); None when MPI carries it (``transport.mpi_buffer``). An explicit NCCL
    choice that cannot run raises ``BackendUnavailableError`` here, when the operation is
    built."""
    if not isinstance(tensor, torch.Tensor):
        return None
    backend = backends.resolve()
    if transport.carrier_of(tensor, backend) not in process_groups.LIBRARIES:
        return None
    return transport.Transport(topo.comm, backend)


def wire_field(wire, tensor) -> tuple:
    """What the agreement check's signature adds for a collective of ``tensor`` on ``wire``
    (``group_wire``'s answer): nothing on MPI, else the library, so ranks that would take
    different wires (an ``auto`` that found a GPU per rank on one node only, one rank under
    ``BAGUA_MPI_BACKEND=gloo``) differ by name instead of waiting in different libraries."""
    return () if wire is None else (("wire", wire.carrier(tensor)),)


def reduction_name(wire_dtype: str, mop) -> str | None:
    """The process groups' name for reducing ``wire_dtype`` with MPI op ``mop``; None when the
    libraries cannot (16-bit integers, bool, a logical op): MPI reduces those."""
    return transport.op_named(mop) if wire_dtype in _REDUCIBLE else None


def allgather(wire, rows, counts, out) -> None:
    """``out`` <- every rank's rows in rank order: ``counts[r]`` rows from rank r, this rank's
    ``rows`` (contiguous, at least one dimension)."""
    if out.numel() == 0:
        return
    most = int(counts.max())
    if (counts == most).all():
        wire.allgather(rows, out)
        return
    trailing = tuple(rows.shape[1:])
    padded = torch.cat([rows, rows.new_zeros((most - rows.shape[0],) + trailing)])
    gathered = rows.new_empty((wire.size * most,) + trailing)
    wire.allgather(padded, gathered)
    torch.cat([gathered[r * most:r * most + int(n)] for r, n in enumerate(counts)], out=out)


def broadcast_(wire, buf, root: int) -> None:
    """``buf`` <- rank ``root``'s ``buf``, in place."""
    work = buf if buf.is_contiguous() else buf.contiguous()
    wire.broadcast_(work, root)
    if work is not buf:
        buf.copy_(work)


def reducescatter(wire, work, rows: list[int], result, op: str) -> None:
    """``result`` <- ``op`` over ranks of their rows of ``work`` that this rank keeps:
    ``rows[k]`` rows for rank k, in order (``reducescatter_rows``)."""
    if work.numel() == 0:
        return
    work = work.contiguous()  # a cast of a strided tensor keeps its strides
    most = rows[0]
    if rows[-1] == most:  # equal blocks
        wire.reduce_scatter(work, result, op)
        return
    pad = work.new_zeros((1,) + tuple(work.shape[1:]))
    blocks = []
    for block, n in zip(torch.split(work, rows), rows):
        blocks += [block] if n == most else [block, pad]
    recv = result if rows[wire.rank] == most else work.new_empty((most,) + tuple(work.shape[1:]))
    wire.reduce_scatter(torch.cat(blocks), recv, op)
    if recv is not result:
        result.copy_(recv[:rows[wire.rank]])
