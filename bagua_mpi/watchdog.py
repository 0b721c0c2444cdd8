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

Hang reports (``flight_recorder.py``, ``docs/hangs.md``): with a ``HangBoard``, the warning and
the abort name the ranks that are not in the operation this rank waits in, and what each of
them does instead, from the state files every rank's watchdog leaves in the board's directory
(rewritten once a new state has lasted a quarter of the warning time, and at that interval
anyway). At the
abort every rank that shares the directory dumps its flight recorder there and to stderr
before ``MPI_Abort`` tears the job down.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

from . import faults
from .flight_recorder import (STDERR_ROWS, HangBoard, describe_text, format_flight_record,
                              kind_of, name_laggards, rank_list)
from .worker import CommWorker

logger = logging.getLogger(__name__)

STALL_EXIT_CODE = 124


class Watchdog:
    def __init__(self, worker: CommWorker, rank: int, warn_after: float, abort_after: float,
                 monitor: faults.ExitMonitor | None = None,
                 peer_grace: float = faults.PEER_EXIT_GRACE_S, board: HangBoard | None = None):
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
        self.recorder = worker.recorder
        # The hang reports need both: what this rank did, and a place to tell the others.
        self.board = board if self.recorder is not None else None
        # A rank publishes its state once it has kept it this long: long before any peer's
        # warning can read it, and never for the short states of a job that keeps moving.
        self.publish_after = warn_after / 4
        # A state file older than this, although its rank rewrites it every ``publish_after``,
        # means that rank's watchdog thread has not run.
        self.stale_after = 2 * (self.publish_after + self._interval) + 1.0
        self._published: tuple | None = None  # (running seq, last finished seq) last written
        # the first heartbeat after ``publish_after``: short clean jobs write no file at all
        self._published_at = time.monotonic()
        self._dumped = False  # this rank's flight record has been dumped (at most once)
        self._dump_path: str | None = None  # ... to this file
        self._identity = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}
        self._thread = threading.Thread(target=self._loop, name="bagua_mpi-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; this rank's state file goes too (a clean leave is not a laggard)."""
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1)
        if self.board is not None:
            self.board.leave()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            if self.board is not None:
                self._tend_board()
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
                self._warn(describe, waited)

    # -- the three messages ------------------------------------------------------------------
    def _warn(self, describe, waited: float) -> None:
        seq, details = self._hang_report(describe)
        where = f" [op #{seq} here]" if seq else ""
        logger.warning("%s", _indented(
            f"bagua_mpi rank {self.rank}: {describe_text(describe)} has waited {waited:.1f} s "
            f"for the other ranks{where}", details))

    def _abort(self, describe, waited: float) -> None:
        self._abort_with_report(
            describe, lambda text, where: f"aborts the job: {text}{where} waited {waited:.1f} s",
            lambda text, where: (f"{text} has waited {waited:.1f} s (abort limit "
                                 f"{self.abort_after:g} s, BAGUA_MPI_STALL_ABORT_S); another "
                                 f"rank never joined it."))

    def abort_stuck_at_shutdown(self, waited: float) -> None:
        """Abort the job: ``shutdown`` waited ``waited`` s for the operation the communication
        thread is in, and what comes next (the exit agreement, freeing the groups and
        communicators under it) would crash the process instead of naming the operation."""
        current = self.worker.current
        self._abort_with_report(
            current[0] if current is not None else None,
            lambda text, where: f"aborts the job at shutdown: {text}{where} still runs",
            lambda text, where: (f"{text}{where} still runs {waited:.0f} s after shutdown began "
                                 f"waiting for it; another rank never joined it (an operation "
                                 f"only some ranks called)."))

    def _abort_with_report(self, describe, dump_note, headline) -> None:
        """Dump every rank's flight record and abort the job (``STALL_EXIT_CODE``) with this
        rank's hang report; ``dump_note`` and ``headline`` make their text from the operation's
        description and where it is in this rank's sequence."""
        seq, details = self._hang_report(describe) if describe is not None else (0, [])
        text = describe_text(describe) if describe is not None else "an operation"
        where = f" [op #{seq} here]" if seq else ""
        details.append(self._dump_everywhere(f"rank {self.rank} {dump_note(text, where)}"))
        msg = _indented(f"bagua_mpi rank {self.rank}: {headline(text, where)} Aborting the job.",
                        details)
        if logger.hasHandlers():  # else logging's last resort would print it a second time
            logger.error(msg)
        faults.abort_job(msg, STALL_EXIT_CODE)

    def _abort_peer_left(self, describe, departed: dict) -> None:
        who = "; ".join(faults.describe_departure(r, how, code)
                        for r, (how, code) in sorted(departed.items()))
        codes = [code for how, code in departed.values() if code not in (0, -1)]
        reason = f"rank {self.rank} aborts the job: {who}"
        msg = _indented(
            f"bagua_mpi rank {self.rank}: {who}, while rank {self.rank} still waits in "
            f"{describe_text(describe)}, which cannot complete without it. Aborting the job."
            f"{_uneven_work_hint(describe, departed)}",
            [self._dump_everywhere(reason, gone=departed)])
        if logger.hasHandlers():
            logger.error(msg)
        faults.abort_job(msg, codes[0] if codes else faults.EARLY_EXIT_CODE)

    # -- the hang report ---------------------------------------------------------------------
    def _hang_report(self, describe) -> tuple[int, list[str]]:
        """``(seq, lines)``: this rank's sequence number of the operation it waits in, and the
        lines naming the ranks not in it."""
        seq = self.recorder.running if self.recorder is not None else 0
        if self.board is None or not seq:
            return seq, []
        self._publish()  # first, so the peers' own reports see this rank as it is now
        states = self._read_states()
        departed = {}
        if self.monitor is not None:  # only given with MPI_THREAD_MULTIPLE: may ask MPI here
            departed = {r: faults.describe_departure(r, how, code)
                        for r, (how, code) in self.monitor.poll().items()}
        lines = name_laggards(self.rank, seq, describe, states, self.board.size, departed,
                              self.stale_after, self.board.directory)
        return seq, lines

    def _read_states(self) -> dict:
        if self.board is None:
            return {}
        try:
            return self.board.read_states()
        except OSError as exc:
            self._lose_board(exc)
            return {}

    # -- the board: publish this rank's state, answer dump requests ------------------------------
    def _tend_board(self) -> None:
        """Once per tick: dump if some rank asked; publish this rank's state when a new one has
        settled (kept ``publish_after``), and at least every ``publish_after`` anyway, so that
        a state file older than ``stale_after`` really means a watchdog that could not run.

        The common tick is a ``stat`` and a few attribute reads: nothing written."""
        try:
            if not self._dumped and self.board.dump_requested():
                request = self.board.abort_request()
                self._dump_flight_record(request.get("reason", "a rank aborts the job"))
            recorder = self.recorder
            now = time.monotonic()
            settled = now - recorder.since >= self.publish_after
            changed = (recorder.running, recorder.last_finished) != self._published
            due = now - self._published_at >= self.publish_after
            if (settled and changed) or due:
                self._publish()
        except OSError as exc:
            self._lose_board(exc)

    def _publish(self) -> None:
        if self.board is None:  # lost on a failed write earlier in this tick
            return
        recorder = self.recorder
        state = (recorder.running, recorder.last_finished)
        record = recorder.status()
        record.update(self._identity, written=time.time())
        try:
            self.board.publish(record)
        except OSError as exc:
            self._lose_board(exc)
            return
        self._published, self._published_at = state, time.monotonic()

    def _lose_board(self, exc: OSError) -> None:
        """A board that cannot be written costs the hang reports, never the job."""
        logger.warning("bagua_mpi rank %d: hang reports off, cannot use %s: %s (set "
                       "BAGUA_MPI_HANG_DIR to a writable directory)", self.rank,
                       self.board.directory if self.board else "?", exc)
        self.board = None

    # -- the dumps at an abort -------------------------------------------------------------------
    def _dump_everywhere(self, reason: str, gone=()) -> str:
        """Dump this rank's flight record and have every rank that shares the board dump its own;
        returns the line that says where they are. Waits a few ticks for the others (all but
        those ``gone`` from the job): the ``MPI_Abort`` that follows would kill them mid-dump.
        Ranks that cannot see the board (another node, no shared directory) cost that wait."""
        if self.recorder is None:
            return "flight recorder off (BAGUA_MPI_FLIGHT_RECORDER_SIZE=0)"
        board = self.board
        if board is not None:
            try:
                board.request_dumps(reason)
            except OSError as exc:
                self._lose_board(exc)
                board = None
        mine = self._dump_path if self._dumped else self._dump_flight_record(reason)
        if board is None:
            return "flight record of this rank above (stderr only: no board)"
        others = set(range(board.size)) - {self.rank} - set(gone)
        dumped = board.wait_for_dumps(others, timeout=2 * self._interval + 1.0)
        missing = sorted(others - set(dumped))
        written = dumped + ([self.rank] if mine else [])
        line = (f"flight records of {rank_list(written)}: "
                f"{os.path.join(board.directory, 'rank-<N>.flight')}" if written
                else "no flight record could be written")
        if missing:
            line += f"; none from {rank_list(missing)}"
        return line

    def _dump_flight_record(self, reason: str) -> str | None:
        """This rank's ring buffer: all of it to its file, the newest rows to stderr."""
        self._dumped = True
        path = None
        if self.board is not None:
            try:
                path = self.board.write_dump(format_flight_record(self.rank, self.recorder))
            except OSError as exc:
                self._lose_board(exc)
        tail = format_flight_record(self.rank, self.recorder, rows=STDERR_ROWS)
        where = f"all of it in {path}" if path else "not written to a file"
        sys.stderr.write(f"{tail}\n  ({reason}; {where})\n")
        sys.stderr.flush()
        self._dump_path = path
        return path


def _indented(head: str, lines: list[str]) -> str:
    return "\n".join([head] + [f"  {line}" for line in lines])


# the exchanges a rank inside join() takes part in with zeros (collectives/_join.py)
_JOINABLE = ("bucket", "allreduce", "grouped_allreduce")


def _uneven_work_hint(describe, departed: dict) -> str:
    """The likeliest cause when ranks ended their programs cleanly while this one still waits
    in a gradient exchange or an allreduce: the ranks ran different numbers of steps (uneven
    data). Nothing for a crash or a non-zero exit, whose own message is the cause."""
    clean = all(how in (faults.LEFT_SHUTDOWN, faults.LEFT_EXIT) and code in (0, -1)
                for how, code in departed.values())
    if not clean or kind_of(describe) not in _JOINABLE:
        return ""
    return (" If the ranks run different numbers of steps (uneven data), give them equal "
            "numbers of batches (torch's DistributedSampler does), or call bagua_mpi.join() "
            "on every rank after its loop, so that the ranks still training exchange with "
            "zeros from those that ran out.")
