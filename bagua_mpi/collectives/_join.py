"""``join``: a rank out of work keeps taking part in the other ranks' allreduces with zeros,
until every rank has joined (as Horovod). The agreement check's message carries the join
flag (``consistency.py``), so ``join`` needs the check on."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .. import consistency, runtime, transport
from ..exceptions import BaguaMPIError
from ._allreduce_backends import mpi_allreduce_buffer_


def join(device=-1) -> int:
    """This rank has run out of work: until every rank has joined, take part in the other
    ranks' allreduces with zeros (as Horovod). Returns the rank that joined last.

    Works with ``allreduce``/``grouped_allreduce`` called through this API with the agreement
    check on (the default: the check message carries the join flag). Any other collective
    while a rank has joined raises ``JoinedRankError`` on the ranks that called it (this rank
    stays joined, as in Horovod). Global process set only.
    ``device`` is accepted for Horovod compatibility and ignored: the zeros are made where the
    training ranks' wire needs them (host memory for MPI, the current GPU for NCCL, the
    tensor's device for a process group).
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
            messages, mop, hier, *rest = info
            route = rest[0] if rest else ("mpi",)
            for message in messages:
                wire_dt, numel = message[0], message[1]
                mop_i = message[2] if len(message) > 2 else mop
                if numel:
                    _add_zeros(topo, wire_dt, numel, mop_i, hier, route)

    return rt.worker.run(run, ("join",))


def _add_zeros(topo, wire_dt: str, numel: int, mop, hierarchical: bool, route: tuple) -> None:
    """This joined rank's zeros for one message, on the wire the training ranks use
    (``join_route``): MPI, NCCL, or the transport (a process group, MPI on device memory)."""
    kind = route[0]
    dtype = np.float32 if wire_dt == "bfloat16" else np.dtype("bool" if wire_dt == "bool"
                                                              else wire_dt)
    if kind == "mpi":
        mpi_allreduce_buffer_(topo, np.zeros(numel, dtype=dtype), mop, hierarchical)
        return
    import torch

    device = "cuda" if kind == "nccl" else route[2]
    zeros = torch.zeros(numel, dtype=getattr(torch, wire_dt), device=device)
    op = transport.op_named(mop)
    if op is None:
        raise BaguaMPIError(f"join(): no {route[0]} reduction for MPI op {mop!r}")
    if kind == "nccl":
        transport.nccl_allreduce_(zeros, topo, route[1], op=op)
    else:
        transport.Transport(topo.comm, route[1]).allreduce_(zeros, op)

