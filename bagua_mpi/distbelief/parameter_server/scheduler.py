"""Sandblaster's load balancing: portions to whoever is free, backup tasks at the end.

One evaluation (a "batch") is cut into ``n_portions`` portions, many more than there are
workers, so a fast worker simply comes back for more and ends up doing more of them (paper §4.2).
When no unassigned portion is left, a worker asking for work gets a *backup copy* of a portion
still running elsewhere (the one with the fewest copies, oldest first), up to ``max_copies``
copies per portion; the first copy to finish wins and later ones are discarded, as with
MapReduce's backup tasks. A straggler therefore delays a batch by at most one portion's time of
a healthy worker, not by its own.

Data affinity: a worker is handed the next portion after its previous one when it is free
(workers start spread evenly over the batch), so consecutive data goes to the same replica.

The scheduler is pure bookkeeping (no MPI), so its decisions are unit-tested with fake workers.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    """Counts over one or more batches (``add`` merges them)."""

    portions: int = 0  # portions in the batches
    issued: int = 0  # tasks handed out, backups included
    backups_issued: int = 0
    backups_won: int = 0  # portions whose first answer came from a backup copy
    duplicates: int = 0  # answers that arrived after the portion was done (wasted work)
    late: int = 0  # answers that arrived after their whole batch was over (set by the caller)
    won: dict[int, int] = field(default_factory=dict)  # worker -> portions it answered first
    computed: dict[int, int] = field(default_factory=dict)  # worker -> answers, duplicates too

    def add(self, other: "SchedulerStats") -> None:
        self.portions += other.portions
        self.issued += other.issued
        self.backups_issued += other.backups_issued
        self.backups_won += other.backups_won
        self.duplicates += other.duplicates
        self.late += other.late
        for mine, theirs in ((self.won, other.won), (self.computed, other.computed)):
            for w, n in theirs.items():
                mine[w] = mine.get(w, 0) + n

    @property
    def backup_share(self) -> float:
        """Share of portions whose result came from a backup copy."""
        return self.backups_won / self.portions if self.portions else 0.0


class PortionScheduler:
    """Assignment of one batch's portions to workers (identified by any hashable id)."""

    def __init__(self, n_portions: int, workers, max_copies: int = 2):
        if isinstance(n_portions, bool) or not isinstance(n_portions, int) or n_portions < 1:
            raise ValueError(f"n_portions must be a positive integer, got {n_portions!r}")
        if isinstance(max_copies, bool) or not isinstance(max_copies, int) or max_copies < 1:
            raise ValueError(f"max_copies must be a positive integer (1 = no backup tasks), "
                             f"got {max_copies!r}")
        workers = list(workers)
        self.n = n_portions
        self.max_copies = max_copies
        self._unassigned = list(range(n_portions))  # sorted
        self._running: dict[int, list] = {}  # portion -> workers computing it, first issue first
        self._backup_holders: dict[int, set] = {}  # portion -> workers holding a backup copy
        self._first_issue: dict[int, int] = {}  # portion -> sequence number of its first issue
        self._seq = 0
        self._done = [False] * n_portions
        self.n_done = 0
        self.winner: dict[int, object] = {}
        # where each worker starts: spread over the batch for data affinity
        self._next = {w: (i * n_portions) // max(1, len(workers)) for i, w in enumerate(workers)}
        self.stats = SchedulerStats(portions=n_portions)

    @property
    def done(self) -> bool:
        return self.n_done == self.n

    def outstanding(self) -> list[int]:
        """Portions handed out and not finished yet."""
        return sorted(p for p in self._running if not self._done[p])

    def next_task(self, worker) -> tuple[int, bool] | None:
        """``(portion, is_backup)`` for a free worker, or None when it should wait."""
        if self._unassigned:
            start = self._next.get(worker, 0)
            i = bisect.bisect_left(self._unassigned, start)
            p = self._unassigned.pop(i if i < len(self._unassigned) else 0)
            self._running.setdefault(p, []).append(worker)
            self._first_issue.setdefault(p, self._seq)
            self._seq += 1
            self._next[worker] = p + 1
            self.stats.issued += 1
            return p, False
        best = None
        for p, holders in self._running.items():
            if self._done[p] or worker in holders or len(holders) >= self.max_copies:
                continue
            key = (len(holders), self._first_issue[p])
            if best is None or key < best[0]:
                best = (key, p)
        if best is None:
            return None
        p = best[1]
        self._running[p].append(worker)
        self._backup_holders.setdefault(p, set()).add(worker)
        self.stats.issued += 1
        self.stats.backups_issued += 1
        return p, True

    def complete(self, worker, portion: int) -> bool:
        """``worker`` finished ``portion``; True if this is the first (winning) answer."""
        if not 0 <= portion < self.n:
            raise ValueError(f"portion {portion} out of range [0, {self.n})")
        holders = self._running.get(portion, [])
        if worker in holders:
            holders.remove(worker)
        self.stats.computed[worker] = self.stats.computed.get(worker, 0) + 1
        if self._done[portion]:
            self.stats.duplicates += 1
            return False
        self._done[portion] = True
        self.n_done += 1
        self.winner[portion] = worker
        self.stats.won[worker] = self.stats.won.get(worker, 0) + 1
        if worker in self._backup_holders.get(portion, ()):
            self.stats.backups_won += 1
        return True

    def abandon(self, worker, portion: int) -> None:
        """``worker`` will not finish ``portion``; if nobody else runs it, it is reissued."""
        holders = self._running.get(portion)
        if holders is None or worker not in holders:
            return
        holders.remove(worker)
        if not holders and not self._done[portion]:
            del self._running[portion]
            bisect.insort(self._unassigned, portion)

    def worker_lost(self, worker) -> list[int]:
        """Forget a departed worker; return the portions that went back to the pool."""
        back = []
        for p in [p for p, h in self._running.items() if worker in h]:
            self.abandon(worker, p)
            if p in self._unassigned:
                back.append(p)
        self._next.pop(worker, None)
        return back
