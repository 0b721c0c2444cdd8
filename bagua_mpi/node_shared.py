"""Gradient buckets in node-shared memory, and the allreduce that reads them in place.

On CPU ranks the dense allreduce is bound by memory bandwidth, not by a wire: MPI's
shared-memory transport copies every byte into its own cells, the peer reduces out of them and
the result is copied again, and the 1/n of Average is one more pass over the bucket. Putting
every rank's flat gradient buffer in one MPI-3 shared window of its node
(``MPI_Win_allocate_shared`` over the node communicator) lets the ranks read each other's
gradients directly:

1. ``Barrier`` on the node: every rank's gradients for this bucket are complete;
2. local rank q sums slice q of the bucket over all rows of the node (row order, so every rank
   gets the same bits), in cache-sized chunks;
3. with several nodes, slice q is allreduced among the ranks with local rank q (one per node,
   the ``inter`` communicator): a two-dimensional allreduce, each rank sending 1/n of the bucket;
4. rank q writes the scaled slice into every row of its node, and a second ``Barrier`` makes
   the result visible: each rank's buffer now holds the synchronized gradients.

Per rank that reads the bucket once and writes it once, with the scale folded in. Measured on
the 2-core development machine (84 MB of float32): 22 ms at 2 ranks and 47 ms at 4, against
52 and 150 ms for ``MPI_Allreduce`` of the same buffer (``benchmarks/step_time.py``).

Used when the bucket is on the CPU, float32/float64, flattened, the communicator is the
optimizer's own, every node has the same number of ranks, the node's shared memory has room
(``/dev/shm``), and no rank is inside ``join()`` (a joined rank adds zeros through MPI, so the
others do too). Otherwise the same exchange runs through MPI. ``BAGUA_MPI_SHARED_BUCKETS=0``
turns it off.

Lifetime: windows are freed collectively at ``bagua_mpi.shutdown()`` (``MPI_Win_free`` is
collective on the node); ``DistributedOptimizer.close()`` and shutdown first give each
parameter a private copy of its gradient, so ``p.grad`` stays valid after either.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from mpi4py import MPI

from . import config
from .primitives.centralized import cast_allreduce_

_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}
CHUNK_BYTES = 128 * 1024  # one chunk of the partial sum stays in L2 while the rows stream by
_SHM_HEADROOM = 1.25  # leave a quarter of /dev/shm free for MPI's own segments

_by_address: dict[int, "SharedRows"] = {}  # data_ptr of a rank's row -> its window
_live: list["SharedRows"] = []  # every window of this runtime, in creation order (same on all ranks)


class SharedRows:
    """One bucket's gradient buffers: row ``local_rank`` of a node-shared [local_size, numel]
    array is this rank's, and ``allreduce_`` synchronizes all rows in place."""

    def __init__(self, topo, numel: int, dtype: torch.dtype):
        self.topo = topo
        self.np_dtype = _NUMPY[dtype]
        itemsize = np.dtype(self.np_dtype).itemsize
        local, n = topo.local_rank, topo.local_size
        # rank 0 allocates every row: one contiguous segment, so rows are a plain 2-D array
        self.win = MPI.Win.Allocate_shared(numel * itemsize * n if local == 0 else 0, itemsize,
                                           comm=topo.intra)
        memory, _ = self.win.Shared_query(0)
        self.rows = np.frombuffer(memory, dtype=self.np_dtype, count=numel * n).reshape(n, numel)
        # MPI leaves a new window's contents undefined, and a bucket's padding must read zero:
        # each rank clears its own row (first touched by the rank that uses it)
        self.rows[local].fill(0)
        self.win.Lock_all()  # a passive epoch for Win.Sync, held for the window's life
        self.tensor = torch.from_numpy(self.rows[local])
        self.used = numel  # the bucket's gradients: a prefix when the row is padded (ZeRO)
        bounds = [numel * q // n for q in range(n + 1)]
        self.lo, self.hi = bounds[local], bounds[local + 1]
        self.chunk = max(1024, CHUNK_BYTES // itemsize)
        self._tmp = np.empty(min(self.chunk, max(self.hi - self.lo, 1)), dtype=self.np_dtype)
        self.freed = False
        self.on_free: list = []  # called before the window goes (buckets privatize their grads)
        _by_address[self.tensor.data_ptr()] = self
        _live.append(self)

    def allreduce_(self, scale: float, wire_dtype: torch.dtype | None = None) -> None:
        """All rows <- scale x (sum of the rows over every rank of the communicator).

        ``wire_dtype`` (float16/bfloat16): the slices that cross nodes travel as 16-bit words
        (summed in float32); inside a node there is no wire, so the node sum is exact."""
        topo, rows, lo, hi = self.topo, self.rows, self.lo, self.hi
        n = rows.shape[0]
        cross = topo.cross_size > 1
        self._barrier()
        factor = self.np_dtype(scale)
        mine = rows[topo.local_rank]
        for start, end, part in self._chunks():
            np.copyto(part, rows[0, start:end])
            for q in range(1, n):
                np.add(part, rows[q, start:end], out=part)
            if cross:  # the node's partial sum waits in this rank's own row for step 3
                mine[start:end] = part
            else:
                self._write_all(part, factor, start, end)
        if cross:
            if hi > lo and wire_dtype is None:
                topo.inter.Allreduce(MPI.IN_PLACE, mine[lo:hi], op=MPI.SUM)
            elif hi > lo:
                cast_allreduce_(torch.from_numpy(mine[lo:hi]), topo.inter, wire_dtype, 1.0)
            for start, end, part in self._chunks():
                np.copyto(part, mine[start:end])
                self._write_all(part, factor, start, end)
        self._barrier()

    def bytes_moved(self, wire_dtype: torch.dtype | None = None) -> tuple[int, int]:
        """(through shared memory, through MPI) for one ``allreduce_`` of this rank, counted
        as a ring allreduce counts it so algorithms compare alike: the peers' parts of its slice
        that it reads plus its reduced slice written into their rows (2 (n-1)/n of the bucket),
        and the slice's allreduce across nodes (16-bit words with ``wire_dtype``)."""
        n, c = self.topo.local_size, self.topo.cross_size
        itemsize = self.rows.itemsize
        node = 2 * (n - 1) * self.rows.shape[1] * itemsize // n
        wire = 2 if wire_dtype is not None else itemsize
        return node, (2 * (c - 1) * (self.hi - self.lo) * wire) // c

    def _chunks(self):
        """(start, end, scratch) over this rank's slice, in cache-sized pieces."""
        for start in range(self.lo, self.hi, self.chunk):
            end = min(start + self.chunk, self.hi)
            yield start, end, self._tmp[:end - start]

    def _write_all(self, part: np.ndarray, factor, start: int, end: int) -> None:
        if factor != 1:
            np.multiply(part, factor, out=part)
        for row in self.rows:
            row[start:end] = part

    def _barrier(self) -> None:
        # Win.Sync orders this rank's stores before the barrier and the peers' after it
        self.win.Sync()
        self.topo.intra.Barrier()
        self.win.Sync()

    def free(self) -> None:
        """Collective over the node: release the window (its row must no longer be used)."""
        if self.freed:
            return
        self.freed = True
        for callback in self.on_free:
            callback()
        _by_address.pop(self.tensor.data_ptr(), None)
        self.win.Unlock_all()
        self.win.Free()


def rows_of(tensor: torch.Tensor, comm) -> SharedRows | None:
    """The window whose row holds ``tensor`` as its bucket's gradients (the row, or its
    unpadded prefix for a sharded bucket), when ``comm`` is the communicator it reduces
    over."""
    if not _by_address or tensor.is_cuda:
        return None
    rows = _by_address.get(tensor.data_ptr())
    # only the bucket's whole gradient: a tensor that merely begins the row (a first
    # parameter's view) is not the bucket
    if rows is None or rows.freed or rows.topo.comm is not comm or tensor.numel() != rows.used:
        return None
    return rows


def usable(topo, total_bytes: int, wanted: bool = True) -> bool:
    """Collective over ``topo.comm``: whether buckets of ``total_bytes`` per rank can live in
    node-shared memory here (every rank gets the same answer; False if any rank is not
    ``wanted``)."""
    ok = (wanted and config.shared_buckets() and topo.local_size > 1
          and _shm_room() >= total_bytes * topo.local_size * _SHM_HEADROOM)
    if topo.simulated_ranks_per_node is not None:  # (every rank takes part: collective)
        # simulated nodes are real shared memory only if every rank of one sits on this host
        ok = len(set(topo.intra.allgather(MPI.Get_processor_name()))) == 1 and ok
    sizes = topo.comm.allgather((topo.local_size, bool(ok)))
    return all(flag for _, flag in sizes) and len({s for s, _ in sizes}) == 1


def _shm_room() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def free_all() -> None:
    """At shutdown (collective): release every window still alive."""
    for rows in _live:  # creation order, the same on every rank of a node
        rows.free()
    _live.clear()
    _by_address.clear()


def allocator(topo, dtype: torch.dtype, device: torch.device):
    """A ``numel -> SharedRows`` allocator (its ``.tensor`` is this rank's row) for buckets of
    ``dtype`` on ``device``,
    or None when such buckets stay private (device tensors, other dtypes)."""
    if device.type != "cpu" or dtype not in _NUMPY:
        return None
    return lambda numel: SharedRows(topo, numel, dtype)
