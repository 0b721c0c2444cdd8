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
        self.shared_bytes = 0  # the part of bytes_sent moved through node-shared memory
        self.calls = 0

    def add(self, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)
        self.calls += 1

    def shared(self, node_bytes: int, wire_bytes: int) -> None:
        """A node-shared bucket exchange (``node_shared.py``): ``node_bytes`` through shared
        memory (counted as a ring would move them), ``wire_bytes`` through MPI across nodes."""
        self.add(node_bytes + wire_bytes)
        self.shared_bytes += int(node_bytes)

    def allreduce(self, nbytes: int, n: int) -> None:
        self.add(2 * (n - 1) * nbytes // n if n > 1 else 0)

    def node_reduce(self, nbytes: int, local_rank: int, local_size: int) -> None:
        if local_size > 1 and local_rank != 0:
            self.add(nbytes)

    def node_broadcast(self, nbytes: int, local_rank: int, local_size: int) -> None:
        if local_size > 1 and local_rank == 0:
            self.add(nbytes * (local_size - 1))


class StagingStats:
    """Bytes the library copied between device and host memory, process-wide.

    Every staging copy of a device tensor goes through here, tagged ``dense`` when it is a
    whole gradient, model or bucket (``algorithms/staging.py``, dense MPI buffers) and not
    when it is a compressed payload (C_LP_S, Top-k, PowerSGD's P/Q, D_LP_S). With CUDA
    tensors the compressed algorithms leave ``dense_d2h_bytes`` at zero: that is how the
    tests check that no dense gradient makes a host round trip on those paths.
    """

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.d2h_bytes = 0  # device -> host, all staging copies
        self.h2d_bytes = 0  # host -> device
        self.d2h_copies = 0
        self.largest_d2h = 0  # the largest single device -> host copy, in bytes
        self.dense_d2h_bytes = 0  # device -> host copies of whole (dense) tensors

    def d2h(self, nbytes: int, dense: bool = False) -> None:
        with self._lock:
            self.d2h_bytes += int(nbytes)
            self.d2h_copies += 1
            self.largest_d2h = max(self.largest_d2h, int(nbytes))
            if dense:
                self.dense_d2h_bytes += int(nbytes)

    def h2d(self, nbytes: int) -> None:
        with self._lock:
            self.h2d_bytes += int(nbytes)

    def snapshot(self) -> dict:
        with self._lock:
            return {"d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes,
                    "d2h_copies": self.d2h_copies, "largest_d2h": self.largest_d2h,
                    "dense_d2h_bytes": self.dense_d2h_bytes}


staging = StagingStats()


class HostOverhead:
    """The host's cost of driving the device, process-wide: the times the library made the host
    wait for the device (``syncs``), the compression kernels launched (``launches``) and the
    device arrays they allocated, both counted by ``numba_kernels`` (whose kernels never wait).

    ``AlgorithmImpl.communicate_bucket`` reads the counters around each bucket's exchange, so
    ``DistributedOptimizer.communication_stats()`` can report launches and syncs per bucket.
    Counts are process-wide: work on another thread (the async algorithm's) during a bucket's
    exchange counts towards that bucket.
    """

    def __init__(self):
        self.syncs = 0

    def sync(self) -> None:
        self.syncs += 1  # one bytecode-level add under the GIL; a lost update only undercounts

    def snapshot(self) -> tuple[int, int]:
        """(launches, syncs) so far."""
        import numba_kernels as nk

        return getattr(nk, "launch_count", lambda: 0)(), self.syncs

    @staticmethod
    def allocations() -> int:
        """Device arrays the compression kernels allocated so far, for scratch or a result
        (none once each thread's scratch exists, since the primitives give every kernel its
        output: ``numba_kernels.device_allocations``)."""
        import numba_kernels as nk

        return getattr(nk, "device_allocations", lambda: 0)()


overhead = HostOverhead()
