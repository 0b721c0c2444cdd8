"""A rank that reports what a fresh interpreter would show, or ends in a chosen way
(tests/test_forkserver.py runs it with and without the forkserver and compares)."""
import gc
import json
import os
import signal
import sys
import time
import weakref

import numpy
from mpi4py import MPI

comm = MPI.COMM_WORLD


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write: ranks' lines never merge


class Cycle:
    """Garbage only the cyclic collector frees (the server's frozen objects must not hide it)."""


def collects_cycles() -> bool:
    cycle = Cycle()
    cycle.itself = cycle
    ref = weakref.ref(cycle)
    del cycle
    gc.collect()
    return ref() is None


mode = sys.argv[1]
if mode == "describe":
    seen = {"argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "file": __file__,
            "path": sys.path, "probe_env": os.environ.get("PROBE_VALUE"),
            "flags": list(sys.flags), "stdout_line_buffered": sys.stdout.line_buffering,
            "sum": comm.allreduce(comm.rank + 1),
            "gc": [gc.isenabled(), gc.get_threshold(), collects_cycles()]}
    varies = {"hash": hash("bagua_mpi"), "numpy": numpy.random.random()}
    say(f"SAME {comm.rank} {json.dumps(seen, sort_keys=True)}")
    say(f"VARIES {comm.rank} {json.dumps(varies)}")
elif mode == "exit":
    comm.Barrier()
    sys.exit(7 if comm.rank == comm.size - 1 else 0)
elif mode == "raise":
    comm.Barrier()
    if comm.rank == comm.size - 1:
        raise ValueError("probe raised on purpose")
elif mode == "signal":
    comm.Barrier()
    if comm.rank == comm.size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
elif mode == "hang":
    say(f"PID {comm.rank} {os.getpid()}")
    time.sleep(600)
