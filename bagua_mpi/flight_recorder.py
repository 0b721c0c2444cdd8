"""Flight recorder and hang reports: which rank is not where the others wait, and what it does.

Two parts (``docs/hangs.md`` shows their output):

* ``FlightRecorder``: each rank's ring buffer of its last N library operations (sequence number,
  the operation's description tuple, queue/start/end times, state). Every library operation
  passes through the serial executor (``worker.py``), which records it here, so the per-rank
  sequence numbers follow program order: on ranks that call the same collectives they agree.
* ``HangBoard``: the out-of-band channel. A stalled rank cannot ask its peers over the blocked
  communicator, so every rank's watchdog leaves a small state file (running operation or last
  finished one) in a directory all ranks read, and the stalled rank's watchdog reads them all
  to name the ranks that are not in its operation. At a stall abort it also asks every rank,
  through a marker file, to dump its ring buffer to a file there and to stderr.

Why files and not a side communicator polled by a thread: files need no
``MPI_THREAD_MULTIPLE``, cannot be wedged by the MPI progress engine that is itself stuck, and
still tell something about a rank whose MPI state is broken; the price is a directory every rank
shares (``/dev/shm`` on one node, ``BAGUA_MPI_HANG_DIR`` across nodes).

Costs, on purpose small: recording is a few list stores per operation into preallocated lists
(no object per call, under 1 us); the state file is written by the watchdog thread, when a new
state (one operation, or the time between two) has lasted a quarter of the stall warning time,
and at that interval anyway (15 s by default): at most one small file write per rank per
quarter of the warning time, none on the path of an operation.
"""
from __future__ import annotations

import itertools
import json
import os
import socket
import tempfile
import time

from . import config

QUEUED, RUNNING, DONE, FAILED = 0, 1, 2, 3
STATE_NAMES = ("queued", "running", "done", "failed")

# Rows of the ring buffer printed to stderr at an abort; the file gets all of them.
STDERR_ROWS = 16


def describe_text(describe) -> str:
    """Human-readable form of an operation description tuple (built only when reporting)."""
    if isinstance(describe, tuple):
        head, *rest = describe
        return f"{head}(" + ", ".join(str(r) for r in rest) + ")"
    return str(describe)


def kind_of(describe) -> str:
    """The operation's kind (``allreduce``, ``barrier``, ...): what ranks must agree on."""
    if isinstance(describe, tuple) and describe:
        return str(describe[0])
    return str(describe)


def wall_offset() -> float:
    """Add to a ``time.monotonic()`` value to get wall-clock time (for other ranks and humans)."""
    return time.time() - time.monotonic()


class FlightRecorder:
    """This rank's last ``size`` library operations, in preallocated parallel lists.

    Written only by the thread that holds the executor (one at a time); read by the watchdog
    thread without a lock: a row caught half-updated can only make a report slightly stale.
    Slot of sequence number ``s`` is ``s % size``; a slot whose ``seq`` no longer matches was
    overwritten by a newer operation.
    """

    __slots__ = ("size", "_seqs", "seq", "describe", "queued", "started", "ended", "state",
                 "running", "last_finished", "since")

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"flight recorder size must be positive, got {size!r}")
        self.size = size
        self._seqs = itertools.count(1)  # next() is atomic under the GIL: safe from any thread
        self.seq = [0] * size  # 0: empty slot
        self.describe: list = [None] * size
        self.queued = [0.0] * size  # monotonic times; 0.0: not queued (ran inline) / not yet
        self.started = [0.0] * size
        self.ended = [0.0] * size
        self.state = [QUEUED] * size
        self.running = 0  # seq of the operation running now, 0 when none
        self.last_finished = 0  # seq of the last operation that ended (done or failed)
        self.since = time.monotonic()  # when ``running``/``last_finished`` last changed

    # -- the executor's hooks (hot path: keep them to plain stores) ----------------------------
    def queue(self, describe) -> int:
        """An asynchronous operation was submitted; returns its sequence number."""
        seq = next(self._seqs)
        i = seq % self.size
        self.seq[i] = seq
        self.describe[i] = describe
        self.queued[i] = time.monotonic()
        self.started[i] = self.ended[i] = 0.0
        self.state[i] = QUEUED
        return seq

    def start(self, seq: int, now: float) -> None:
        """The queued operation ``seq`` starts running at ``now`` (monotonic)."""
        i = seq % self.size
        if self.seq[i] == seq:
            self.started[i] = now
            self.state[i] = RUNNING
        self.running = seq
        self.since = now

    def begin(self, describe, now: float) -> int:
        """A synchronous operation starts at once (``queue`` + ``start`` in one call)."""
        seq = next(self._seqs)
        i = seq % self.size
        self.seq[i] = seq
        self.describe[i] = describe
        self.queued[i] = self.ended[i] = 0.0
        self.started[i] = now
        self.state[i] = RUNNING
        self.running = seq
        self.since = now
        return seq

    def finish(self, seq: int, failed: bool) -> None:
        now = time.monotonic()
        i = seq % self.size
        if self.seq[i] == seq:
            self.ended[i] = now
            self.state[i] = FAILED if failed else DONE
        self.running = 0
        self.last_finished = seq
        self.since = now

    # -- reading (watchdog thread, reports) -----------------------------------------------------
    def entry(self, seq: int) -> tuple | None:
        """``(seq, describe, state, queued, started, ended)`` of ``seq``, None if gone."""
        i = seq % self.size
        if seq <= 0 or self.seq[i] != seq:
            return None
        return (seq, self.describe[i], self.state[i], self.queued[i], self.started[i],
                self.ended[i])

    def entries(self) -> list[tuple]:
        """Every remembered operation, oldest first (tuples as ``entry``)."""
        rows = [self.entry(s) for s in self.seq if s]
        return sorted((r for r in rows if r is not None), key=lambda r: r[0])

    def status(self) -> dict:
        """Where this rank is, for the other ranks: its running op, else its last finished one.

        Times are wall-clock (other ranks compare them with their own clock)."""
        offset = wall_offset()
        record: dict = {"running": None, "last": None, "since": self.since + offset}
        running = self.entry(self.running) if self.running else None
        if running is not None:
            record["running"] = _op_record(running, offset)
        last = self.entry(self.last_finished) if self.last_finished else None
        if last is not None:
            record["last"] = _op_record(last, offset)
        return record


def _op_record(entry: tuple, offset: float) -> dict:
    seq, describe, state, _queued, started, ended = entry
    return {"seq": seq, "kind": kind_of(describe), "op": describe_text(describe),
            "state": STATE_NAMES[state], "started": started + offset,
            "ended": ended + offset if ended else None}


# -- the dump -----------------------------------------------------------------------------------
def format_flight_record(rank: int, recorder: FlightRecorder, rows: int | None = None) -> str:
    """The ring buffer as a table, oldest first; ``rows`` keeps only the newest ones."""
    entries = recorder.entries()
    shown = entries if rows is None else entries[-rows:]
    now = time.monotonic()
    offset = wall_offset()
    head = (f"bagua_mpi rank {rank} flight record ({socket.gethostname()}, pid {os.getpid()}): "
            f"{'last ' + str(len(shown)) + ' of ' if len(shown) < len(entries) else ''}"
            f"{len(entries)} operation(s) remembered (of {recorder.size}), oldest first")
    lines = [head, f"  {'op #':>7}  {'state':<8} {'started':<15} {'took':>11}  operation"]
    for seq, describe, state, queued, started, ended in shown:
        if state == QUEUED:
            when, took = f"(queued {_clock(queued + offset)})", "-"
        else:
            when = _clock(started + offset)
            took = _seconds((ended or now) - started) + ("" if ended else " so far")
        lines.append(f"  {seq:>7}  {STATE_NAMES[state]:<8} {when:<15} {took:>11}  "
                     f"{describe_text(describe)}")
    return "\n".join(lines)


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall % 1 * 1000):03d}"


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3f} ms" if value < 1 else f"{value:.1f} s"


# -- the shared directory ----------------------------------------------------------------------
class HangBoard:
    """One job's directory of per-rank state files, flight-record dumps and the abort marker.

    All file I/O is best effort: a failing write is logged by the caller once and never ends the
    job (the watchdog thread must not die over a full ``/dev/shm``).
    """

    def __init__(self, directory: str, rank: int, size: int):
        self.directory = directory
        self.rank = rank
        self.size = size

    @classmethod
    def open(cls, comm) -> "HangBoard":
        """Collective over ``comm``: rank 0 draws the job's key, every rank derives the path.

        The base directory comes from each rank's own ``BAGUA_MPI_HANG_DIR`` (or its local
        ``/dev/shm``/temp dir), so ranks on different nodes without a shared directory simply
        see only their node's peers."""
        token = comm.bcast(os.urandom(6).hex() if comm.Get_rank() == 0 else None, root=0)
        base = config.hang_dir() or default_base_directory()
        return cls(os.path.join(base, f"bagua_mpi-{token}"), comm.Get_rank(), comm.Get_size())

    # paths
    def state_path(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank-{rank}.state")

    def dump_path(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank-{rank}.flight")

    @property
    def abort_path(self) -> str:
        return os.path.join(self.directory, "abort")

    # writing
    def publish(self, record: dict) -> None:
        """Replace this rank's state file (atomically: readers never see half a file)."""
        self._write(self.state_path(self.rank), json.dumps(record))

    def write_dump(self, text: str) -> str:
        path = self.dump_path(self.rank)
        self._write(path, text + "\n")
        return path

    def request_dumps(self, reason: str) -> None:
        """Ask every rank's watchdog to dump its flight record (it checks once per tick)."""
        self._write(self.abort_path, json.dumps({"rank": self.rank, "reason": reason}))

    def _write(self, path: str, text: str) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)

    # reading
    def dump_requested(self) -> bool:
        return os.path.exists(self.abort_path)

    def abort_request(self) -> dict:
        return _read_json(self.abort_path) or {}

    def read_states(self) -> dict[int, dict]:
        """Every rank's last published state that can be read here, by rank."""
        states = {}
        for rank in range(self.size):
            record = _read_json(self.state_path(rank))
            if record is not None:
                states[rank] = record
        return states

    def wait_for_dumps(self, ranks, timeout: float) -> list[int]:
        """Wait until each of ``ranks`` has dumped its flight record; returns those that did."""
        deadline = time.monotonic() + timeout
        waiting = set(ranks)
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not os.path.exists(self.dump_path(r))}
            if waiting:
                time.sleep(0.05)
        return sorted(set(ranks) - waiting)

    def leave(self) -> None:
        """Remove this rank's state file; the last rank to leave removes the directory."""
        try:
            os.unlink(self.state_path(self.rank))
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.directory)
        except OSError:  # not empty (peers still there, or dumps kept), or never created
            pass


def default_base_directory() -> str:
    """``/dev/shm`` where it can be written (memory-backed: cheap writes), else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):  # absent, or written by a crashed process
        return None


# -- the report: who is not where this rank waits ----------------------------------------------
def name_laggards(my_rank: int, my_seq: int, my_describe, states: dict[int, dict], size: int,
                  departed: dict[int, str] | None = None, stale_after: float = float("inf"),
                  board_dir: str = "") -> list[str]:
    """Lines for the stall report of ``my_rank``, waiting in operation ``my_seq``.

    A peer is *with* this rank when it runs the same sequence number and kind of operation;
    every other peer is named with where it is (another operation, or its own code since its
    last finished operation) and how that compares with ``my_seq``. Ranks in the same situation
    share a line, so the report stays short on a large job. ``departed``: ranks known to have
    left the job, with how (from the exit monitor).
    """
    now = time.time()
    my_kind = kind_of(my_describe)
    departed = departed or {}
    with_me, missing, stale = [], [], []
    situations: dict[str, list[tuple[int, float]]] = {}  # text -> [(rank, since)]
    for rank in range(size):
        record = states.get(rank)
        if rank == my_rank or rank in departed:
            continue
        if record is None:
            missing.append(rank)
        elif _waits_with(record, my_seq, my_kind):
            with_me.append(rank)
        else:
            situations.setdefault(_situation(record, my_seq), []).append(
                (rank, record["since"]))
            age = now - record.get("written", now)
            if age > stale_after:
                stale.append(f"the state of rank {rank} is {age:.0f} s old: its watchdog thread "
                             f"has not run (process stopped, or a call holding the GIL?)")
    lines = []
    if with_me:
        lines.append(f"waiting in it too: {rank_list(with_me)}")
    for text, ranks in situations.items():
        longest = max(0.0, now - min(since for _, since in ranks))
        lines.append(f"NOT in it: {rank_list(r for r, _ in ranks)}: "
                     + text.format(for_how_long=f"for {longest:.1f} s"))
    lines.extend(f"NOT in it: rank {rank}: {how}" for rank, how in sorted(departed.items()))
    lines.extend(stale)
    odd_one = _majority_elsewhere(states, my_rank, my_seq, my_kind, len(with_me) + 1)
    if odd_one:
        lines.append(odd_one)
    if missing:
        where = f" in {board_dir}" if board_dir else ""
        lines.append(f"no state from {rank_list(missing)}{where} (never published one, or on "
                     f"another node: set BAGUA_MPI_HANG_DIR to a directory all nodes share)")
    return lines


def _waits_with(record: dict, seq: int, kind: str) -> bool:
    running = record.get("running")
    return running is not None and running["seq"] == seq and running["kind"] == kind


def _situation(record: dict, my_seq: int) -> str:
    """Where a peer is, relative to op ``my_seq``; ``{for_how_long}`` is filled in per line."""
    running, last = record.get("running"), record.get("last")
    if running is not None:
        seq = running["seq"]
        if seq == my_seq:
            return (f"in {running['op']} [op #{seq}] instead, {{for_how_long}} (a different call "
                    f"at the same point of the sequence)")
        relation = "behind" if seq < my_seq else "ahead"
        return (f"{_ops(abs(my_seq - seq))} {relation}, in {running['op']} [op #{seq}] "
                f"{{for_how_long}}")
    done = last["seq"] if last is not None else 0
    if done == my_seq - 1:
        opening = "not there yet"
    elif done < my_seq:
        opening = f"{_ops(my_seq - 1 - done)} behind"
    else:
        opening = f"past it (finished op #{done})"
    if last is None:
        after = "and has run no bagua_mpi operation yet"
    else:
        failed = " (which failed)" if last["state"] == "failed" else ""
        after = f"since finishing {last['op']} [op #{done}]{failed}"
    return f"{opening}, in its own code (no bagua_mpi operation) {{for_how_long}} {after}"


def _majority_elsewhere(states: dict[int, dict], my_rank: int, my_seq: int, my_kind: str,
                        mine: int) -> str | None:
    """A line saying most ranks wait in another operation (then *this* rank is out of step)."""
    groups: dict[tuple, list[int]] = {}
    for rank, record in states.items():
        running = record.get("running")
        if rank != my_rank and running is not None and not _waits_with(record, my_seq, my_kind):
            groups.setdefault((running["seq"], running["op"]), []).append(rank)
    if not groups:
        return None
    (seq, op), ranks = max(groups.items(), key=lambda item: len(item[1]))
    if len(ranks) <= mine:
        return None
    return (f"{rank_list(ranks)} all wait in {op} [op #{seq}]: this rank (rank {my_rank}) is "
            f"probably the one out of step")


def _ops(n: int) -> str:
    return f"{n} operation{'s' if n != 1 else ''}"


def rank_list(ranks) -> str:
    """``rank 3`` / ``ranks 0-2, 5``: short even for thousands of ranks."""
    ranks = sorted(ranks)
    spans, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            spans.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)
