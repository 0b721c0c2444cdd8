"""``grouped_reducescatter`` on a process group as one exchange, as ``grouped_allgather`` is
there (``_grouped_allgather.py``): one library call for the group instead of one per tensor.

1. one agreement check for the group;
2. each tensor's buffer in its wire dtype, prescaled (``ReducescatterPlan.work``);
3. rank k's block: the rows every tensor leaves to rank k, tensor after tensor, padded with
   zeros to the longest block; the blocks in rank order make the send buffer (one
   concatenation);
4. one reduce-scatter; this rank's block is cut into its tensors' rows, each postscaled into
   its output (``ReducescatterPlan.finish``).

A group is packed when every tensor takes the same process group with the same wire dtype and
op; otherwise, and on MPI (whose reduce-scatter takes per-rank counts straight into each
output), each tensor is its own exchange.
"""
from __future__ import annotations

import numpy as np
import torch

from . import _group_movement as group
from ._core import agree


def grouped_reducescatter_run(topo, plans: list):
    """``run`` for the plans (``_movement.ReducescatterPlan``, one per tensor): their outputs."""
    first = plans[0]
    packed = (len(plans) > 1 and all(p.wire is not None for p in plans)
              and len({(p.wire_dt, p.group_op, str(p.tensor.device)) for p in plans}) == 1)
    if not packed:
        return lambda: [p.run() for p in plans]
    signature = ("grouped_reducescatter", ("op", first.op.name),
                 ("dtypes", tuple(p.dt for p in plans)),
                 ("shapes", tuple(p.shape for p in plans))) + group.wire_field(first.wire,
                                                                             first.tensor)
    # elements of tensor i that rank k keeps, and where they start in that tensor
    share = np.array([[p.rows[k] * p.row for p in plans] for k in range(topo.size)], np.int64)
    starts = np.cumsum(share, axis=0) - share
    lengths = share.sum(axis=1)
    most = int(lengths.max())

    def run():
        agree(topo.comm, signature)
        flats = [p.work().reshape(-1) for p in plans]
        pieces = []
        for k in range(topo.size):
            pieces += [flat[int(starts[k, i]):int(starts[k, i] + share[k, i])]
                       for i, flat in enumerate(flats)]
            pieces.append(flats[0].new_zeros(most - int(lengths[k])))
        send = torch.cat(pieces)
        recv = send.new_empty(most)
        if most:
            first.wire.reduce_scatter(send, recv, first.group_op)
        outs, offset = [], 0
        for i, p in enumerate(plans):
            n = int(share[topo.rank, i])
            outs.append(p.finish(recv[offset:offset + n].view(p.out.shape)))
            offset += n
        return outs

    return run
