"""Stall watchdog: a collective that never completes is reported, then ends the job.

A rank that skips a collective (a bug, or a dead peer that MPI did not notice) leaves the others
blocked inside MPI forever. The watchdog thread looks at the operation the communication layer
is running; past ``warn_after`` seconds it logs what it waits for, and past ``abort_after`` it
prints the same to stderr and calls ``MPI_Abort`` so the launcher tears the whole job down with
a non-zero exit instead of burning the allocation.

It also ends the job promptly when a peer has *left* (finished its program or exited, see
``faults.ExitMonitor``) while this rank still waits in a collective: once an operation has been
waiting ``faults.PEER_EXIT_GRACE_S`` with a departure known, no one is coming. That check asks
MPI from this thread while the communication thread is inside MPI, so it runs only when MPI
granted ``MPI_THREAD_MULTIPLE``; without it, the leaving rank's exit timeout still ends the job.
"""
from __future__ import annotations

import logging
import threading
import time

from . import faults
from .worker import CommWorker, describe_text

logger = logging.getLogger(__name__)

STALL_EXIT_CODE = 124


class Watchdog:
    def __init__(self, worker: CommWorker, rank: int, warn_after: float, abort_after: float,
                 monitor: faults.ExitMonitor | None = None,
                 peer_grace: float = faults.PEER_EXIT_GRACE_S):
        if warn_after <= 0:
            raise ValueError(f"stall warning time must be positive, got {warn_after!r}")
        if abort_after < 0:
            raise ValueError(f"stall abort time must be >= 0 (0 = never), got {abort_after!r}")
        self.worker = worker
        self.rank = rank
        self.warn_after = warn_after
        self.abort_after = abort_after
        self._stop = threading.Event()
        self._warned_for: object = None
        self.monitor = monitor
        self.peer_grace = peer_grace
        # Check often enough to act within ~10% of the shorter limit, but never spin.
        limits = [t for t in (warn_after, abort_after) if t > 0]
        if monitor is not None:
            limits.append(peer_grace)
        self._interval = max(0.05, min(1.0, min(limits) / 10))
        self._thread = threading.Thread(target=self._loop, name="bagua_mpi-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            current = self.worker.current
            if current is None:
                continue
            describe, started = current
            waited = time.monotonic() - started
            if self.abort_after and waited >= self.abort_after:
                self._abort(describe, waited)
                return
            if self.monitor is not None and waited >= self.peer_grace:
                departed = self.monitor.poll()
                if departed and time.monotonic() - max(started, self.monitor.first_seen) \
                        >= self.peer_grace:
                    self._abort_peer_left(describe, departed)
                    return
            if waited >= self.warn_after and self._warned_for is not current:
                self._warned_for = current
                logger.warning("bagua_mpi rank %d: %s has waited %.1f s for the other ranks",
                               self.rank, describe_text(describe), waited)

    def _abort(self, describe, waited: float) -> None:
        msg = (f"bagua_mpi rank {self.rank}: {describe_text(describe)} has waited {waited:.1f} s "
               f"(abort limit {self.abort_after:g} s, BAGUA_MPI_STALL_ABORT_S); another rank "
               f"never joined it. Aborting the job.")
        if logger.hasHandlers():  # else logging's last resort would print it a second time
            logger.error(msg)
        faults.abort_job(msg, STALL_EXIT_CODE)

    def _abort_peer_left(self, describe, departed: dict) -> None:
        who = "; ".join(faults.describe_departure(r, how, code)
                        for r, (how, code) in sorted(departed.items()))
        codes = [code for how, code in departed.values() if code not in (0, -1)]
        msg = (f"bagua_mpi rank {self.rank}: {who}, while rank {self.rank} still waits in "
               f"{describe_text(describe)}, which cannot complete without it. Aborting the job.")
        if logger.hasHandlers():
            logger.error(msg)
        faults.abort_job(msg, codes[0] if codes else faults.EARLY_EXIT_CODE)
