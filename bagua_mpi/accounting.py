"""Byte accounting: what this rank hands to MPI for other ranks.

One ``WireStats`` per algorithm instance; every primitive and the algorithm framework add the
bytes of the messages they actually post, so ``DistributedOptimizer.communication_stats()``
reports the traffic of the path that really ran (hierarchical included).
"""
from __future__ import annotations


class WireStats:
    """Bytes this rank handed to MPI for other ranks.

    Counted from message sizes: point-to-point, alltoall and allgather payloads exactly
    (excluding the part a rank keeps); an allreduce of B bytes as the bandwidth-optimal
    2(n-1)/n x B that a ring sends (MPI picks its own algorithm internally); a reduce to the
    node leader as B from every other rank of the node, and the broadcast back as B for each
    receiving rank, sent by the leader.
    """

    def __init__(self):
        self.bytes_sent = 0
        self.calls = 0

    def add(self, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)
        self.calls += 1

    def allreduce(self, nbytes: int, n: int) -> None:
        self.add(2 * (n - 1) * nbytes // n if n > 1 else 0)

    def node_reduce(self, nbytes: int, local_rank: int, local_size: int) -> None:
        if local_size > 1 and local_rank != 0:
            self.add(nbytes)

    def node_broadcast(self, nbytes: int, local_rank: int, local_size: int) -> None:
        if local_size > 1 and local_rank == 0:
            self.add(nbytes * (local_size - 1))
