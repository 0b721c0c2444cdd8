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
