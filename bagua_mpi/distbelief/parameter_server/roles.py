"""Who does what in a DistBelief job, and how the flattened parameter vector is cut into shards.

Default layout of an N-rank job with ``setup(n_servers=S, coordinator=C)``::

    rank 0 ................ the coordinator (Sandblaster only, C=True)
    ranks 0 or 1 .. N-S-1 .. workers (model replicas), in rank order; worker 0 is the
                             warm-start replica of Downpour
    ranks N-S .. N-1 ....... parameter-server shards 0 .. S-1

``setup(server_ranks=[...])`` places the shards on any ranks instead (for example one per node,
so that shards do not share a node's memory bandwidth with each other).

With ``setup(..., n_partitions=M)`` each model replica is partitioned over M workers (paper §3):
workers ``M r .. M r + M - 1`` form replica r (partitions 0 .. M-1, in rank order), which gets its
own communicator ``roles.group`` for activations. Replica 0 is Downpour's warm-start replica;
each replica's partition 0 is its *leader*, the one Sandblaster's coordinator talks to. Example,
``mpiexec -n 9`` with ``setup(n_servers=3, n_partitions=3)``::

    ranks 0 1 2 | 3 4 5 | 6 7 8
    replica 0   | rep 1 | shards 0 1 2      (partition m of every replica: ranks m, 3 + m)

The vector of P parameters is cut into S contiguous shards whose sizes differ by at most one
(``ShardLayout``). A worker that uses only part of the vector (``param_range``) talks only to the
shards that hold some of it; a partition's range is its own parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ... import runtime
from ..errors import PartitionError

SERVER, WORKER, COORDINATOR = "server", "worker", "coordinator"


class ShardLayout:
    """Balanced contiguous split of ``numel`` parameters over ``n_shards`` shards.

    Shard k holds ``[bounds[k], bounds[k+1])``; the first ``numel % n_shards`` shards hold one
    element more than the others.

    >>> ShardLayout(10, 3).bounds.tolist()
    [0, 4, 7, 10]
    """

    def __init__(self, numel: int, n_shards: int, dtype=np.float32):
        if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel <= 0:
            raise ValueError(f"numel must be a positive integer, got {numel!r}")
        if isinstance(n_shards, bool) or not isinstance(n_shards, (int, np.integer)) \
                or n_shards <= 0:
            raise ValueError(f"n_shards must be a positive integer, got {n_shards!r}")
        if n_shards > numel:
            raise ValueError(f"{n_shards} shards for {numel} parameters: every shard needs at "
                             f"least one parameter; use at most {numel} servers")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"parameters must be float32 or float64, got {self.dtype}")
        self.numel = int(numel)
        self.n_shards = int(n_shards)
        base, extra = divmod(self.numel, self.n_shards)
        sizes = np.full(self.n_shards, base, dtype=np.int64)
        sizes[:extra] += 1
        self.bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def shard_range(self, k: int) -> tuple[int, int]:
        return int(self.bounds[k]), int(self.bounds[k + 1])

    def shard_size(self, k: int) -> int:
        return int(self.bounds[k + 1] - self.bounds[k])

    def overlap(self, k: int, lo: int, hi: int) -> tuple[int, int] | None:
        """The part of ``[lo, hi)`` that shard k holds, in global indices; None if empty."""
        a, b = max(lo, int(self.bounds[k])), min(hi, int(self.bounds[k + 1]))
        return (a, b) if a < b else None

    def shards_overlapping(self, lo: int, hi: int) -> list[int]:
        """The shards a worker using parameters ``[lo, hi)`` needs to talk to."""
        return [k for k in range(self.n_shards) if self.overlap(k, lo, hi) is not None]

    def split(self, vector: np.ndarray) -> list[np.ndarray]:
        """Views of ``vector`` (length ``numel``), one per shard."""
        if vector.shape != (self.numel,):
            raise ValueError(f"expected a vector of {self.numel} parameters, got shape "
                             f"{vector.shape}")
        return [vector[self.bounds[k]:self.bounds[k + 1]] for k in range(self.n_shards)]

    def check_range(self, param_range) -> tuple[int, int]:
        if param_range is None:
            return 0, self.numel
        lo, hi = (int(v) for v in param_range)
        if not 0 <= lo < hi <= self.numel:
            raise ValueError(f"param_range must satisfy 0 <= lo < hi <= {self.numel}, "
                             f"got {param_range!r}")
        return lo, hi

    def __eq__(self, other) -> bool:
        return (isinstance(other, ShardLayout) and self.numel == other.numel
                and self.n_shards == other.n_shards and self.dtype == other.dtype)

    def __repr__(self) -> str:
        return f"ShardLayout(numel={self.numel}, n_shards={self.n_shards}, dtype={self.dtype})"


@dataclass(frozen=True)
class Roles:
    """This rank's role and everybody's, on a private communicator for parameter-server traffic.

    Made by ``setup`` (collective). ``close()`` frees the communicator (collective too).
    """

    comm: MPI.Intracomm  # duplicate of the library's communicator: PS traffic only
    servers: tuple[int, ...]  # ranks of shards 0..S-1
    workers: tuple[int, ...]  # ranks of workers 0..W-1
    coordinator: int | None  # Sandblaster's coordinator rank, if any
    n_partitions: int = 1  # workers per model replica
    group: MPI.Intracomm | None = None  # this worker's replica group (None elsewhere)

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def role(self) -> str:
        if self.rank == self.coordinator:
            return COORDINATOR
        return SERVER if self.rank in self.servers else WORKER

    @property
    def is_server(self) -> bool:
        return self.role == SERVER

    @property
    def is_worker(self) -> bool:
        return self.role == WORKER

    @property
    def is_coordinator(self) -> bool:
        return self.role == COORDINATOR

    @property
    def n_servers(self) -> int:
        return len(self.servers)

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def server_index(self) -> int:
        """This rank's shard number (servers only)."""
        return self.servers.index(self.rank)

    @property
    def worker_index(self) -> int:
        """This rank's worker number (workers only); worker 0 is the warm-start replica."""
        return self.workers.index(self.rank)

    @property
    def n_replicas(self) -> int:
        return self.n_workers // self.n_partitions

    @property
    def replica_index(self) -> int:
        """This worker's replica (workers only)."""
        return self.worker_index // self.n_partitions

    @property
    def partition_index(self) -> int:
        """This worker's partition within its replica (workers only)."""
        return self.worker_index % self.n_partitions

    def replica_ranks(self, r: int) -> tuple[int, ...]:
        """Ranks of replica r's partitions 0 .. M-1."""
        return self.workers[r * self.n_partitions:(r + 1) * self.n_partitions]

    @property
    def leaders(self) -> tuple[int, ...]:
        """Partition 0 of every replica."""
        return self.workers[::self.n_partitions]

    def gather_vector(self, layout: ShardLayout, my_slice: np.ndarray | None,
                      root: int = 0) -> np.ndarray | None:
        """Collective: assemble the full vector from the shards' slices on rank ``root``.

        Servers pass their slice, every other rank ``None``; ``root`` gets the vector (a copy),
        the others ``None``.
        """
        counts = [0] * self.size
        for k, r in enumerate(self.servers):
            counts[r] = layout.shard_size(k)
        displs = [0] * self.size
        for k, r in enumerate(self.servers):
            displs[r] = int(layout.bounds[k])
        mpi_type = MPI.DOUBLE if layout.dtype == np.float64 else MPI.FLOAT
        send = my_slice if self.is_server else np.empty(0, dtype=layout.dtype)
        if self.is_server and send.shape != (layout.shard_size(self.server_index),):
            raise ValueError(f"rank {self.rank}: slice of shape {send.shape} does not fit shard "
                             f"{self.server_index} of {layout}")
        out = np.empty(layout.numel, dtype=layout.dtype) if self.rank == root else None
        self.comm.Gatherv([np.ascontiguousarray(send, dtype=layout.dtype), mpi_type],
                          [out, (counts, displs), mpi_type] if out is not None else None,
                          root=root)
        return out

    def close(self) -> None:
        """Collective: free the parameter-server communicator (and the replica groups)."""
        if MPI.Is_finalized():
            return
        if self.group is not None and self.group != MPI.COMM_NULL:
            self.group.Free()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def plan_roles(size: int, n_servers: int = 1, coordinator: bool = False,
               server_ranks=None) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
    """``(servers, workers, coordinator)`` for a job of ``size`` ranks (see the module doc).

    >>> plan_roles(5, n_servers=2, coordinator=True)
    ((3, 4), (1, 2), 0)
    """
    if server_ranks is None:
        if isinstance(n_servers, bool) or not isinstance(n_servers, int) or n_servers < 1:
            raise ValueError(f"n_servers must be a positive integer, got {n_servers!r}")
        servers = tuple(range(size - n_servers, size)) if n_servers < size else ()
    else:
        servers = tuple(int(r) for r in server_ranks)
        if not servers or len(set(servers)) != len(servers) or \
                any(not 0 <= r < size for r in servers):
            raise ValueError(f"server_ranks must be distinct ranks in [0, {size}), "
                             f"got {server_ranks!r}")
    if not servers:
        raise ValueError(f"{n_servers} server(s) in a job of {size} rank(s) leave no worker; "
                         f"start more ranks or fewer servers")
    coord = None
    if coordinator:
        coord = next((r for r in range(size) if r not in servers), None)
    workers = tuple(r for r in range(size) if r not in servers and r != coord)
    if not workers:
        raise ValueError(f"{size} rank(s) with {len(servers)} server(s)"
                         f"{' and a coordinator' if coordinator else ''} leave no worker; "
                         f"start more ranks or fewer servers")
    return servers, workers, coord


def check_replicas(n_workers: int, n_partitions: int, size: int = 0) -> int:
    """The number of replicas; ``PartitionError`` if the workers do not form whole replicas."""
    if isinstance(n_partitions, bool) or not isinstance(n_partitions, int) or n_partitions < 1:
        raise PartitionError(f"n_partitions must be a positive integer, got {n_partitions!r}")
    if n_workers % n_partitions:
        raise PartitionError(
            f"{n_workers} worker rank(s){f' (of {size})' if size else ''} cannot form replicas "
            f"of {n_partitions} partitions: the replica group size {n_partitions} must divide "
            f"the number of workers; start R * {n_partitions} workers plus the servers")
    return n_workers // n_partitions


def setup(n_servers: int = 1, *, coordinator: bool = False, n_partitions: int = 1,
          server_ranks=None, comm: MPI.Intracomm | None = None) -> Roles:
    """Collective: choose roles and duplicate the communicator for parameter-server traffic.

    Args:
        n_servers: number of parameter-server shards (ignored when ``server_ranks`` is given).
        coordinator: reserve the first non-server rank (rank 0 by default) for Sandblaster's
            coordinator.
        n_partitions: workers per model replica (model parallelism); consecutive workers form
            a replica and share ``roles.group``. Must divide the number of workers.
        server_ranks: explicit ranks for shards 0..S-1 (default: the last ``n_servers`` ranks).
        comm: communicator to duplicate (default: bagua_mpi's own, so ``bagua_mpi.init()`` must
            have run). The duplicate is never used for collectives of the library, so a server
            waiting for pushes can never match (or be matched by) an allreduce.

    Raises ``ValueError`` (on every rank alike) for a layout with no worker or no server, and
    ``PartitionError`` (a ``ValueError``) when the workers do not form whole replicas.
    """
    if comm is None:
        comm = runtime.get().topo.comm
    servers, workers, coord = plan_roles(comm.Get_size(), n_servers, coordinator, server_ranks)
    check_replicas(len(workers), n_partitions, comm.Get_size())
    dup = comm.Dup()
    me = dup.Get_rank()
    # the replica's own communicator, ordered by partition (split is collective on ``dup``)
    color = workers.index(me) // n_partitions if me in workers else MPI.UNDEFINED
    group = dup.Split(color, key=me)
    return Roles(dup, servers, workers, coord, n_partitions,
                 None if group == MPI.COMM_NULL else group)
