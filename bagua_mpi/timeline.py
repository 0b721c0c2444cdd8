"""Chrome-trace timeline of the execution engine (open in Perfetto or chrome://tracing).

Switch on with ``BAGUA_MPI_TIMELINE=/path/prefix`` or ``DistributedOptimizer(timeline=...)``;
each rank writes ``<prefix>.rank<r>.json`` when the optimizer is closed or the process exits.
Events: per-bucket ``ready`` and ``launch`` (instants, main thread), ``comm bucket i`` (span on the comm thread),
``wait`` (span in ``step``/``synchronize``), ``backward end`` (instant: the last gradient of the
iteration became ready) and ``step``.
"""
from __future__ import annotations

import atexit
import json
import threading
import time

_T0 = time.monotonic()


def _us(t: float) -> float:
    return (t - _T0) * 1e6


class Timeline:
    MAIN_TID, COMM_TID = 1, 2

    def __init__(self, path_prefix: str, rank: int):
        self.path = f"{path_prefix}.rank{rank}.json"
        self.rank = rank
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    def instant(self, name: str, t: float | None = None, tid: int = MAIN_TID, **args) -> None:
        self._add({"name": name, "ph": "i", "s": "t", "ts": _us(t or time.monotonic()),
                   "pid": self.rank, "tid": tid, "args": args})

    def span(self, name: str, start: float, end: float, tid: int = MAIN_TID, **args) -> None:
        self._add({"name": name, "ph": "X", "ts": _us(start), "dur": (end - start) * 1e6,
                   "pid": self.rank, "tid": tid, "args": args})

    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def _add(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        meta = [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                 "args": {"name": label}}
                for tid, label in ((self.MAIN_TID, "main"), (self.COMM_TID, "communication"))]
        with open(self.path, "w") as fh:
            json.dump({"traceEvents": meta + self.events(), "displayTimeUnit": "ms"}, fh)


# -- Horovod's start_timeline/stop_timeline: every collective as a span -------------------------

class CollectiveTimeline(Timeline):
    """Records each collective (named by ``name=`` or its kind) as a span on the thread that ran
    it; written by ``stop_timeline()`` (or at exit)."""

    def __init__(self, path: str, rank: int, mark_cycles: bool = False):
        super().__init__(path, rank)
        self.path = path  # Horovod writes exactly the path it was given
        self.mark_cycles = mark_cycles
        self._counter = 0

    def wrap(self, run, name, describe):
        if name is None:
            self._counter += 1
            kind = describe[0] if isinstance(describe, tuple) and describe else str(describe)
            name = f"{kind}.noname.{self._counter}"
        label = name

        def timed():
            start = time.monotonic()
            try:
                return run()
            finally:
                tid = (self.MAIN_TID if threading.current_thread() is threading.main_thread()
                       else self.COMM_TID)
                self.span(label, start, time.monotonic(), tid=tid,
                          op=str(describe[0]) if isinstance(describe, tuple) else str(describe))

        return timed


_collective: CollectiveTimeline | None = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording every collective of this rank into ``file_path`` (a Chrome trace).

    As Horovod's, rank 0 writes the file (the other ranks record nothing; for every rank's
    view use the optimizer's per-rank timeline, ``BAGUA_MPI_TIMELINE``).
    """
    global _collective
    if not isinstance(file_path, str) or not file_path:
        raise ValueError(f"start_timeline needs a file path, got {file_path!r}")
    from . import runtime
    if _collective is not None:
        stop_timeline()
    if runtime.rank() == 0:
        _collective = CollectiveTimeline(file_path, 0, mark_cycles)


def stop_timeline() -> None:
    """Stop recording and write the timeline file."""
    global _collective
    tl, _collective = _collective, None
    if tl is not None:
        tl.close()
