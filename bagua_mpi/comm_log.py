"""Communication log: per-operation and per-bucket counts, bytes, time and bandwidth.

Switch on with ``BAGUA_MPI_COMM_LOG=1`` (read at ``init``) or ``bagua_mpi.comm_log.enable()``.
Each rank then adds every library operation the serial executor (``worker.py``) runs to a small
table keyed by the operation's kind (``allreduce``, ``allgather``, ...) or, for the optimizer's
gradient buckets, ``bucket <index>``: calls, bytes and seconds. ``summary()`` (collective) gathers
every rank's mean time per key to rank 0, which prints one table: calls, bytes, mean time,
algorithm and bus bandwidth, the bus bandwidth against a baseline allreduce measured at start-up
on the same communicator, and the straggler. At ``shutdown()`` rank 0 prints it by itself.
``docs/comm_log.md`` shows the output and says how to read it.

Why it hangs off the executor: every library operation already passes through it (one serial
queue per rank, in program order) with its description tuple and its start/end times, the same
ones the flight recorder and the timeline's bucket spans use, so the log needs no hook of its
own in the collectives. When the log is off the executor checks one attribute per operation.

Bytes come from the description tuple (see ``payload_bytes``); bus bandwidth follows nccl-tests
(``busbw = algbw * factor``, ``BUS_FACTORS``). Nothing here imports the runtime: ``runtime.init``
hands the log its executor and communicator (``attach``) and ``shutdown`` takes them back
(``detach``), which keeps the import graph free of circles.
"""
from __future__ import annotations

import logging
import math
import sys
import time

import numpy as np

from . import config

logger = logging.getLogger(__name__)

# The start-up baseline: a raw mpi4py allreduce of this many bytes, timed like nccl-tests.
BASELINE_BYTES = 4 << 20
BASELINE_REPETITIONS = 5

# A rank is named as the straggler only when the ranks' mean times differ by this much (a share
# of the longest mean time, and at least STRAGGLER_MIN_SPREAD_S): below that it is noise.
STRAGGLER_SPREAD_SHARE = 0.25
STRAGGLER_MIN_SPREAD_S = 200e-6

SUMMARY_DESCRIBE = ("comm_log_summary",)
# Not the job's traffic: the executor's local drain marker, and the summary's own gather.
NOT_COUNTED = ("drain", SUMMARY_DESCRIBE)

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8,
             "uint8": 1, "int8": 1, "int16": 2, "bool": 1}


def bus_factor(kind: str, size: int) -> float:
    """nccl-tests' bus bandwidth factor of an operation kind on ``size`` ranks.

    allreduce (and gradient buckets, reduced by allreduce in the default algorithm):
    2(n-1)/n; allgather, reducescatter and alltoall: (n-1)/n; broadcast and anything else: 1.
    """
    if kind in ("allreduce", "bucket"):
        return 2 * (size - 1) / size
    if kind in ("allgather", "reducescatter", "alltoall"):
        return (size - 1) / size
    return 1.0


def _tensor_bytes(dtype: str, shape) -> int | None:
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None or not isinstance(shape, tuple):
        return None
    return itemsize * math.prod(shape)


def payload_bytes(describe, size: int) -> int | None:
    """The bytes one operation moves, as nccl-tests counts them; None when the tuple does not
    say (grouped operations, objects, barriers, custom ones).

    allreduce, reducescatter, broadcast, alltoall: the tensor this rank passes in. allgather:
    the gathered output, ``size`` times this rank's input (exact when all ranks contribute as
    many rows, as nccl-tests assumes). bucket: the bucket's bytes, carried in the tuple."""
    kind = describe[0]
    if kind == "bucket":
        return int(describe[2])
    if kind in ("allreduce", "reducescatter") and len(describe) == 4:
        return _tensor_bytes(describe[2], describe[3])
    if kind == "broadcast" and len(describe) == 4:
        return _tensor_bytes(describe[2], describe[3])
    if kind == "alltoall" and len(describe) == 3:
        return _tensor_bytes(describe[1], describe[2])
    if kind == "allgather" and len(describe) == 3:
        local = _tensor_bytes(describe[1], describe[2])
        return None if local is None else local * size
    return None


def key_of(describe) -> str:
    """The row an operation is counted in: its kind, or ``bucket <index>`` for a bucket."""
    if not isinstance(describe, tuple) or not describe:
        return str(describe)
    if describe[0] == "bucket":
        return f"bucket {describe[1]}"
    return str(describe[0])


class CommLog:
    """One rank's counts: key -> ``[calls, bytes, seconds, kind, bytes_known]``.

    ``record`` runs on the thread that holds the executor (one at a time), so it needs no lock.
    """

    __slots__ = ("size", "rows", "since", "baseline_busbw")

    def __init__(self, size: int, baseline_busbw: float | None = None):
        self.size = size
        self.rows: dict[str, list] = {}
        self.since = time.monotonic()
        self.baseline_busbw = baseline_busbw

    def record(self, describe, started: float, ended: float) -> None:
        """Count one finished operation (the executor's hook)."""
        if describe in NOT_COUNTED:
            return
        is_tuple = isinstance(describe, tuple) and bool(describe)
        key = key_of(describe)
        nbytes = payload_bytes(describe, self.size) if is_tuple else None
        row = self.rows.get(key)
        if row is None:
            kind = describe[0] if is_tuple else describe
            row = self.rows[key] = [0, 0, 0.0, str(kind), nbytes is not None]
        row[0] += 1
        row[1] += nbytes or 0
        row[2] += ended - started

    def stats(self) -> dict[str, dict]:
        """This rank's counts: key -> ``{"calls", "bytes" (None if unknown), "seconds"}``."""
        return {key: {"calls": calls, "bytes": nbytes if known else None, "seconds": seconds}
                for key, (calls, nbytes, seconds, _kind, known) in self.rows.items()}

    def mean_times(self) -> dict[str, float]:
        return {key: row[2] / row[0] for key, row in self.rows.items()}


# -- the baseline ----------------------------------------------------------------------------
def measure_baseline(comm) -> float:
    """Bus bandwidth (bytes/s) of a raw ``BASELINE_BYTES`` allreduce on ``comm``; collective.

    Timed like ``benchmarks/collectives.py``: a warm-up call, then the mean of the repetitions
    on the slowest rank. Runs directly on mpi4py, before or between library operations."""
    from mpi4py import MPI

    send = np.ones(BASELINE_BYTES // 4, dtype=np.float32)
    recv = np.empty_like(send)
    comm.Allreduce(send, recv, op=MPI.SUM)  # warm-up: first-touch and connection set-up
    comm.Barrier()
    started = time.perf_counter()
    for _ in range(BASELINE_REPETITIONS):
        comm.Allreduce(send, recv, op=MPI.SUM)
    mean = (time.perf_counter() - started) / BASELINE_REPETITIONS
    slowest = comm.allreduce(mean, op=MPI.MAX)
    return BASELINE_BYTES / slowest * bus_factor("allreduce", comm.Get_size())


# -- the summary ------------------------------------------------------------------------------
def straggler_of(means_by_rank: dict[int, float]) -> int | None:
    """The rank that reached the operation last, or None when the ranks' times agree.

    In a collective the ranks that arrive early wait inside it for the late one, so the late
    rank is the one with the *shortest* mean time, and the spread is what it cost the others."""
    if len(means_by_rank) < 2:
        return None
    longest = max(means_by_rank.values())
    shortest_rank = min(means_by_rank, key=means_by_rank.get)
    spread = longest - means_by_rank[shortest_rank]
    if spread < max(STRAGGLER_MIN_SPREAD_S, STRAGGLER_SPREAD_SHARE * longest):
        return None
    return shortest_rank


def summary_rows(log: CommLog, everyone: list[dict[str, float]]) -> list[dict]:
    """One dict per key of rank 0's log, with the bandwidths and the straggler; ``everyone``:
    each rank's ``mean_times()``, by rank."""
    rows = []
    for key in sorted(log.rows, key=_row_order):
        calls, nbytes, _seconds, kind, known = log.rows[key]
        means = {rank: times[key] for rank, times in enumerate(everyone) if key in times}
        # the job's time: the longest rank's (as benchmarks/collectives.py times it)
        mean = max(means.values())
        algbw = nbytes / calls / mean if known and mean > 0 else None
        busbw = algbw * bus_factor(kind, log.size) if algbw is not None else None
        rows.append({"key": key, "calls": calls, "bytes": nbytes if known else None,
                     "mean_s": mean, "algbw": algbw, "busbw": busbw,
                     "of_baseline": (busbw / log.baseline_busbw
                                     if busbw is not None and log.baseline_busbw else None),
                     "straggler": straggler_of(means),
                     "spread_s": max(means.values()) - min(means.values())})
    return rows


def _row_order(key: str):
    """Collectives by name first, then buckets by index."""
    if key.startswith("bucket "):
        return (1, int(key.split()[1]), "")
    return (0, 0, key)


def format_summary(log: CommLog, rows: list[dict]) -> str:
    elapsed = time.monotonic() - log.since
    baseline = (f"{log.baseline_busbw / 1e9:.3f} GB/s busbw" if log.baseline_busbw
                else "not measured")
    lines = [f"bagua_mpi communication log: {log.size} rank(s), {elapsed:.1f} s logged; "
             f"baseline ({BASELINE_BYTES >> 20} MiB raw mpi4py allreduce at start-up): "
             f"{baseline}",
             f"{'operation':<20} {'calls':>8} {'bytes':>14} {'mean time':>11} "
             f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'of base':>8} {'straggler':>9} "
             f"{'spread':>10}"]
    for row in rows:
        lines.append(
            f"{row['key']:<20} {row['calls']:>8} {_or_dash(row['bytes'], '{}'):>14} "
            f"{_duration(row['mean_s']):>11} {_or_dash(_gb(row['algbw']), '{:.3g}'):>10} "
            f"{_or_dash(_gb(row['busbw']), '{:.3g}'):>10} "
            f"{_or_dash(row['of_baseline'], '{:.0%}'):>8} "
            f"{_or_dash(row['straggler'], 'rank {}'):>9} {_duration(row['spread_s']):>10}")
    return "\n".join(lines)


def _gb(value: float | None) -> float | None:
    return None if value is None else value / 1e9


def _or_dash(value, form: str) -> str:
    return "-" if value is None else form.format(value)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


# -- the process-wide log: handed the executor by the runtime ---------------------------------
_worker = None  # the runtime's executor while initialized (``attach``)
_comm = None  # the library's communicator, for the baseline and the summary
_requested = False  # enable() before init: start at init


def attach(worker, comm) -> None:
    """``runtime.init``: start the log if ``BAGUA_MPI_COMM_LOG`` or ``enable()`` asked for it
    (collective over ``comm`` then: the baseline)."""
    global _worker, _comm
    _worker, _comm = worker, comm
    if _requested or config.comm_log():
        _start()


def detach(report: bool) -> None:
    """``runtime.shutdown``, after draining and before the executor stops: print the summary
    (collective; only when ``report``, i.e. every rank leaves normally) and forget the log."""
    global _worker, _comm
    try:
        if report and is_enabled():
            summary()
    except Exception:  # noqa: BLE001 - a failed report must not stop the shutdown after it
        logger.exception("bagua_mpi: the communication log's summary failed")
    finally:
        if _worker is not None:
            _worker.comm_log = None
        _worker = _comm = None


def _start() -> None:
    baseline = measure_baseline(_comm)
    _worker.comm_log = CommLog(_comm.Get_size(), baseline)


def enable() -> None:
    """Start logging (no-op when on). After ``init`` it is collective (every rank calls it:
    it measures the baseline); before ``init`` the log starts at ``init``."""
    global _requested
    _requested = True
    if _worker is not None and _worker.comm_log is None:
        _start()


def disable() -> None:
    """Stop logging and drop the counts (local; call it on every rank, as ``summary`` is
    collective among the ranks whose log is on)."""
    global _requested
    _requested = False
    if _worker is not None:
        _worker.comm_log = None


def is_enabled() -> bool:
    return _worker is not None and _worker.comm_log is not None


def reset() -> None:
    """Zero this rank's counts (the baseline is kept)."""
    log = _current()
    if log is not None:
        _worker.comm_log = CommLog(log.size, log.baseline_busbw)


def stats() -> dict[str, dict]:
    """This rank's counts so far (see ``CommLog.stats``); empty when the log is off."""
    log = _current()
    return {} if log is None else log.stats()


def _current() -> CommLog | None:
    return None if _worker is None else _worker.comm_log


def summary(print_table: bool = True) -> str | None:
    """Collective: gather every rank's mean time per key; rank 0 prints the table (to stderr)
    and returns it, the other ranks return None. None everywhere when the log is off.

    Runs as one operation of the executor, so it takes its turn after queued work; it is not
    counted in the log itself."""
    log = _current()
    if log is None:
        return None
    comm = _comm

    def gather():
        return comm.gather(log.mean_times(), root=0)

    everyone = _worker.run(gather, SUMMARY_DESCRIBE)
    if everyone is None:
        return None
    text = format_summary(log, summary_rows(log, everyone))
    if print_table:
        sys.stderr.write(text + "\n")  # one write: other ranks' output cannot split it
        sys.stderr.flush()
    return text
