"""Pre-emption: turn a scheduler's warning signal into a checkpoint at one agreed step, then exit
for requeue.

Slurm sends ``SIGUSR1`` some time before it ends a job (``#SBATCH --signal=USR1@120``: 120 s
before the time limit; ``scancel --signal=USR1 <job>`` by hand). The signal reaches the ranks at
different moments, inside different operations, so nothing may be done in the handler itself:
it only sets a flag. At each step boundary ``should_stop()`` combines the ranks' flags with one
tiny allreduce (MAX), so all ranks see the request at the same step, save together, and leave
with ``REQUEUE_EXIT_CODE``, on which the batch script runs ``scontrol requeue`` (see
``slurm/cpu_single_node.sbatch``). The requeued job resumes from the checkpoint's ``latest``.

Example::

    guard = bagua_mpi.preemption.install()          # early: before the signal can arrive
    for step in range(start, steps):
        train_step(step)
        if guard.should_stop():                     # collective, every rank, every step
            bagua_mpi.checkpoint.save("ckpt", model=model, optimizer=opt, step=step)
            guard.exit()                            # every rank exits 75

Install the guard on every rank from the main thread. Until it is installed, ``SIGUSR1`` keeps
its default action (terminate), so install it before the first long phase.
"""
from __future__ import annotations

import logging
import signal
import sys
import time

import numpy as np

from . import collectives, runtime
from .ops import Max

logger = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "temporary failure, try again later"


class PreemptionGuard:
    """Catches the given signals and answers, collectively, whether to stop at this step.

    Args:
        signals: signal names or numbers to catch (default ``SIGUSR1``; add ``"SIGTERM"`` where
            the site pre-empts with SIGTERM and a grace period).
        check_every: run the agreement every this many ``should_stop()`` calls (all ranks must
            call it equally often); between checks it answers False without communicating.
    """

    def __init__(self, signals=("SIGUSR1",), check_every: int = 1):
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be a positive integer, got {check_every!r}")
        self.check_every = check_every
        self.signals = [_signal_number(s) for s in signals]
        if not self.signals:
            raise ValueError("give at least one signal to catch")
        self.received: int | None = None  # the signal that arrived here, if any
        self.received_at: float | None = None  # time.time() of its arrival
        self._agreed = False
        self._calls = 0
        self._previous = {}
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum, _frame) -> None:
        # Only record: the main thread may be inside MPI or the optimizer right now.
        if self.received is None:
            self.received, self.received_at = signum, time.time()

    def request(self) -> None:
        """Ask for a stop from code (e.g. a wall-clock budget), as if a signal had arrived."""
        self._handler(signal.SIGUSR1, None)

    @property
    def requested_here(self) -> bool:
        """Whether this rank received a signal (no communication)."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Collective: True on every rank once any rank has received a signal."""
        if self._agreed:
            return True
        self._calls += 1
        if self._calls % self.check_every:
            return False
        flag = np.array([1 if self.received is not None else 0], dtype=np.int32)
        self._agreed = bool(collectives.allreduce(flag, Max)[0])
        if self._agreed and runtime.get().topo.rank == 0:
            logger.warning("bagua_mpi: pre-emption requested (%s); stopping at this step",
                           signal.Signals(self.received).name if self.received else
                           "signal on another rank")
        return self._agreed

    def exit(self, code: int = REQUEUE_EXIT_CODE) -> None:
        """Shut the library down cleanly and exit with ``code`` (default: requeue me)."""
        runtime.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(code)

    def uninstall(self) -> None:
        """Give the signals their previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()


def install(signals=("SIGUSR1",), check_every: int = 1) -> PreemptionGuard:
    """Install a ``PreemptionGuard`` for ``signals`` (see the class)."""
    return PreemptionGuard(signals, check_every)


def _signal_number(sig) -> int:
    if isinstance(sig, str):
        name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
        if not hasattr(signal, name):
            raise ValueError(f"unknown signal {sig!r}")
        return int(getattr(signal, name))
    return int(sig)
