"""Turn an uncaught exception on one rank into the end of the whole job.

Without this, a rank that raises exits while its peers wait in the next collective (or in
``MPI_Finalize``) until the allocation runs out. The hook prints the traceback with the rank,
then calls ``MPI_Abort`` so ``mpiexec``/``srun`` kill every rank and exit non-zero.
"""
from __future__ import annotations

import sys
import time
import traceback

from mpi4py import MPI

UNCAUGHT_EXIT_CODE = 1

_previous_hook = None


def _abort_on_uncaught(exc_type, exc, tb) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    if issubclass(exc_type, KeyboardInterrupt):
        code = 130
    elif issubclass(exc_type, SystemExit):
        # sys.exit(n) does not reach excepthook; kept for completeness.
        code = exc.code if isinstance(exc.code, int) else 1
    else:
        code = UNCAUGHT_EXIT_CODE
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    abort_job(f"bagua_mpi rank {rank}: uncaught exception, aborting the job (all ranks):\n"
              f"{text}", code)


# How long a rank's last words get to reach the launcher before MPI_Abort tears it down.
LAST_WORDS_S = 0.5


def abort_job(message: str, code: int) -> None:
    """Print ``message`` on stderr, give the launcher time to forward it, then ``MPI_Abort``.

    Without the pause, mpiexec can kill the processes (and its output proxies) before the
    flushed line has been forwarded: a loaded machine lost the watchdog's message this way,
    leaving only the exit code.
    """
    sys.stderr.write(message if message.endswith("\n") else message + "\n")
    sys.stderr.flush()
    time.sleep(LAST_WORDS_S)
    MPI.COMM_WORLD.Abort(code)


def install() -> None:
    """Install the abort-on-uncaught-exception hook (idempotent)."""
    global _previous_hook
    if sys.excepthook is _abort_on_uncaught:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _abort_on_uncaught


def uninstall() -> None:
    global _previous_hook
    if sys.excepthook is _abort_on_uncaught and _previous_hook is not None:
        sys.excepthook = _previous_hook
    _previous_hook = None


def installed() -> bool:
    return sys.excepthook is _abort_on_uncaught
