"""``join``: a rank out of work keeps taking part in the other ranks' allreduces with zeros,
until every rank has joined (as Horovod). The agreement check's message carries the join
flag (``consistency.py``), so ``join`` needs the check on."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .. import consistency, runtime
from ..exceptions import BaguaMPIError
from ._allreduce_backends import mpi_allreduce_buffer_


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
                    mpi_allreduce_buffer_(topo, zeros, mop_i, hier)

    return rt.worker.run(run, ("join",))
