"""Turn an uncaught exception on one rank into the end of the whole job.

Without this, a rank that raises exits while its peers wait in the next collective (or in
``MPI_Finalize``) until the allocation runs out. The hook prints the traceback with the rank,
then calls ``MPI_Abort`` so ``mpiexec``/``srun`` kill every rank and exit non-zero.
"""
from __future__ import annotations

import sys
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
    sys.stderr.write(f"bagua_mpi rank {rank}: uncaught exception, aborting the job "
                     f"(all ranks):\n{text}")
    sys.stderr.flush()
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
