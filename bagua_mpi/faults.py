"""End the whole job when one rank fails or leaves, instead of leaving the others blocked.

An MPI job lives and dies as a whole, but a Python process can end on its own: an uncaught
exception, ``sys.exit(n)``, or simply reaching the end of the script while its peers still
expect it in the next collective. Without help, the peers then wait inside MPI until the stall
watchdog or the allocation runs out. This module gives every such ending a prompt, named end:

* **Uncaught exception** in the main thread (``sys.excepthook``) or in any other thread
  (``threading.excepthook``): print the traceback with the rank, then ``MPI_Abort``, so
  ``mpiexec``/``srun`` kill every rank and exit non-zero. Opt out with
  ``BAGUA_MPI_ABORT_ON_EXCEPTION=0`` / ``init(abort_on_exception=False)``.
* **Leaving** (any exit, or an explicit ``shutdown()``): ``shutdown`` runs the *exit agreement*
  of ``ExitMonitor``: every rank tells rank 0 it is leaving and waits for rank 0's word that it
  is leaving too. A rank whose peers are still blocked in a collective is thereby noticed by
  them (the stall watchdog polls the monitor, see ``watchdog.py``), and a rank whose peers never
  arrive gives up after ``BAGUA_MPI_EXIT_TIMEOUT_S`` and aborts, naming them.
* **Exit status.** ``SystemExit`` never reaches an excepthook, and an ``atexit`` handler cannot
  see the status either, so ``sys.exit`` is wrapped: it raises a ``SystemExit`` subclass whose
  ``code`` records the status at the moment the interpreter itself reads it to exit (a read with
  no Python frame above it; a ``SystemExit`` caught and inspected by the program does not
  count). A non-zero status is a failure: its rank waits only ``PEER_EXIT_GRACE_S`` for the
  others (who may be failing with it) and then aborts the job with that status.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import numpy as np
from mpi4py import MPI

UNCAUGHT_EXIT_CODE = 1
EARLY_EXIT_CODE = 1  # a rank left while the others still needed it (its own status was 0)
EXIT_TIMEOUT_CODE = 124  # same as the stall watchdog's: other ranks never came

# How long a collective may keep waiting after a peer is known to have left before the job is
# aborted. A collective that a departed peer already took part in still completes (in ms) once
# the remaining ranks progress; only one that needs the departed rank waits on.
PEER_EXIT_GRACE_S = 5.0

# How long a rank's last words get to reach the launcher before MPI_Abort tears it down.
LAST_WORDS_S = 0.5

_previous_hook = None
_previous_thread_hook = None
_previous_exit = None
_exit_status: object = None  # the status the interpreter is exiting with, once known
_exit_status_known = False


def _rank() -> int:
    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else -1


def _abort_on_uncaught(exc_type, exc, tb) -> None:
    rank = _rank()
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


def _abort_on_thread_exception(args) -> None:
    # A SystemExit ends only its thread (Python's own rule); everything else is a failure the
    # main thread will never see, so the job must end as for the main thread.
    if args.exc_type is SystemExit or issubclass(args.exc_type, SystemExit):
        return
    rank = _rank()
    name = args.thread.name if args.thread is not None else "<unknown>"
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                              args.exc_traceback))
    abort_job(f"bagua_mpi rank {rank}: uncaught exception in thread {name!r}, aborting the job "
              f"(all ranks):\n{text}", UNCAUGHT_EXIT_CODE)


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
    # MPI_Abort may return once the launcher has been told (seen during interpreter exit);
    # this process must not go on as if nothing happened.
    os._exit(code)


# -- the exit status --------------------------------------------------------------------------------
class RankExit(SystemExit):
    """What the wrapped ``sys.exit`` raises: a ``SystemExit`` that notices the interpreter
    reading its ``code`` on the way out (see the module docstring)."""

    @property
    def code(self):
        value = SystemExit.code.__get__(self)
        try:
            sys._getframe(1)
        except ValueError:  # no Python caller: the interpreter's own exit handling
            _record_exit_status(value)
        return value


def _record_exit_status(value) -> None:
    global _exit_status, _exit_status_known
    _exit_status, _exit_status_known = value, True


def _exit(status=None):
    raise RankExit(status)


_exit.__doc__ = ("Exit the interpreter by raising SystemExit(status) (wrapped by bagua_mpi to "
                 "learn the status; see bagua_mpi.faults).")


def how_the_process_ends() -> tuple[int, int]:
    """``(how, code)`` for the exit agreement, called at interpreter exit."""
    known, code = exit_status()
    if known:
        return LEFT_EXIT, code
    # CPython sets sys.last_value for the uncaught exception that ends a script (before the
    # excepthook runs); with the abort hooks installed the job never gets here.
    if getattr(sys, "last_value", None) is not None and not hasattr(sys, "ps1"):
        return LEFT_EXCEPTION, UNCAUGHT_EXIT_CODE
    return LEFT_EXIT, _UNKNOWN


def exit_status() -> tuple[bool, int | None]:
    """``(known, code)``: the interpreter's exit status as an int, once ``sys.exit`` took it.

    Follows Python's rule: ``None`` is 0, an int is itself, anything else (a message) is 1.
    """
    if not _exit_status_known:
        return False, None
    value = _exit_status
    if value is None:
        return True, 0
    if isinstance(value, int):
        return True, int(value)
    return True, 1


# -- install / uninstall ------------------------------------------------------------------------------
def install(abort_on_exception: bool = True) -> None:
    """Wrap ``sys.exit``; with ``abort_on_exception`` also install both abort hooks (idempotent)."""
    global _previous_hook, _previous_thread_hook, _previous_exit
    if sys.exit is not _exit:
        _previous_exit = sys.exit
        sys.exit = _exit
    if not abort_on_exception:
        return
    if sys.excepthook is not _abort_on_uncaught:
        _previous_hook = sys.excepthook
        sys.excepthook = _abort_on_uncaught
    if threading.excepthook is not _abort_on_thread_exception:
        _previous_thread_hook = threading.excepthook
        threading.excepthook = _abort_on_thread_exception


def uninstall() -> None:
    global _previous_hook, _previous_thread_hook, _previous_exit
    if sys.excepthook is _abort_on_uncaught and _previous_hook is not None:
        sys.excepthook = _previous_hook
    _previous_hook = None
    if threading.excepthook is _abort_on_thread_exception and _previous_thread_hook is not None:
        threading.excepthook = _previous_thread_hook
    _previous_thread_hook = None
    if sys.exit is _exit and _previous_exit is not None:
        sys.exit = _previous_exit
    _previous_exit = None


def installed() -> bool:
    """Whether uncaught exceptions abort the job (the hooks are in place)."""
    return sys.excepthook is _abort_on_uncaught


# -- the exit agreement -----------------------------------------------------------------------------
# Why a rank left, as sent to the others: an explicit shutdown() call, the end of the process,
# or the end of the process by an uncaught exception (only seen with the abort hooks off).
LEFT_SHUTDOWN, LEFT_EXIT, LEFT_EXCEPTION = 0, 1, 2
_UNKNOWN = -1  # exit status not known (end of script, or SystemExit raised without sys.exit)


def describe_departure(rank: int, how: int, code: int) -> str:
    if how == LEFT_SHUTDOWN:
        return f"rank {rank} called bagua_mpi.shutdown()"
    if how == LEFT_EXCEPTION:
        return f"rank {rank} ended with an uncaught exception (its traceback is above)"
    if code == _UNKNOWN:
        return f"rank {rank} reached the end of its program"
    return f"rank {rank} exited with code {code} (sys.exit({code}))"


class ExitMonitor:
    """Who has left: rank 0 hears from every rank that leaves, the others hear from rank 0.

    Messages go over a private duplicate of the library communicator (so they can never match
    anything else), with one receive always posted: on rank 0 from any source (re-posted after
    each arrival), elsewhere from rank 0. That keeps the cost at 2(n-1) tiny messages per
    shutdown and one posted receive per rank. ``poll()`` may be called from the watchdog thread
    while the communication thread is inside MPI (needs ``MPI_THREAD_MULTIPLE``, checked by the
    caller); ``agree()`` runs once, at shutdown, after the communication thread has stopped.
    """

    _ARRIVE, _NOTICE = 1, 2

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.departed: dict[int, tuple[int, int]] = {}  # rank -> (how, code)
        self.first_seen: float | None = None  # monotonic time the first departure was seen
        self._lock = threading.Lock()
        self._buf = np.zeros(2, dtype=np.int64)
        self._status = MPI.Status()
        self._recv = self._post()

    def _post(self):
        if self.rank == 0:
            return self.comm.Irecv(self._buf, source=MPI.ANY_SOURCE, tag=self._ARRIVE)
        return self.comm.Irecv(self._buf, source=0, tag=self._NOTICE)

    def poll(self) -> dict[int, tuple[int, int]]:
        """Take in any departure messages that have arrived; return all departures seen."""
        with self._lock:
            while self._recv is not None and self._recv.Test(self._status):
                source = self._status.Get_source()
                self.departed[source] = (int(self._buf[0]), int(self._buf[1]))
                if self.first_seen is None:
                    self.first_seen = time.monotonic()
                expected = self.size - 1 if self.rank == 0 else 1
                self._recv = self._post() if len(self.departed) < expected else None
            return dict(self.departed)

    def agree(self, how: int, code: int, timeout: float) -> list[int]:
        """Announce this rank's departure and wait up to ``timeout`` s (0: no limit) for the
        others'. Returns the ranks still missing (empty: everyone left together); rank 0
        names them, the others can only name rank 0."""
        payload = np.array([how, code], dtype=np.int64)
        if self.rank == 0:
            sends = [self.comm.Isend(payload, dest=r, tag=self._NOTICE)
                     for r in range(1, self.size)]
        else:
            sends = [self.comm.Isend(payload, dest=0, tag=self._ARRIVE)]
        deadline = time.monotonic() + timeout if timeout > 0 else None
        pause = 0.0005
        while True:
            departed = self.poll()
            done = self._recv is None and MPI.Request.Testall(sends)
            if done:
                return []
            if deadline is not None and time.monotonic() >= deadline:
                if self.rank == 0:
                    return [r for r in range(1, self.size) if r not in departed]
                return [0] if 0 not in departed else []
            time.sleep(pause)
            pause = min(2 * pause, 0.05)  # answer fast when everyone is there, then idle

    def free(self) -> None:
        if not MPI.Is_finalized():
            if self._recv is not None:  # only after an abandoned agreement: cancel, then free
                self._recv.Cancel()
                self._recv.Wait()
            self.comm.Free()
