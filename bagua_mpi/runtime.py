"""Process-wide state: ``init``/``shutdown`` and the topology queries.

``init()`` validates the ``BAGUA_MPI_*`` settings, builds the topology (private communicators),
starts the communication thread and the stall watchdog, and installs the fault hooks
(``faults.py``). ``shutdown()`` is collective: it drains pending operations, then runs the exit
agreement (every rank says it is leaving; a rank whose peers do not all arrive within
``BAGUA_MPI_EXIT_TIMEOUT_S`` aborts the job naming them), then frees the communicators. It runs
at exit too, before mpi4py finalizes MPI, so no rank can deadlock in ``MPI_Finalize`` behind a
half-finished collective, and no rank can leave while its peers wait for it in one.
"""
from __future__ import annotations

import atexit
import inspect
import logging
import time
import weakref
from dataclasses import dataclass

from mpi4py import MPI

from . import (backends, comm_log, config, faults, flight_recorder, node_shared,
               process_groups, topology)
from .exceptions import NotInitializedError
from .watchdog import Watchdog
from .worker import CommWorker

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    topo: topology.Topology
    worker: CommWorker
    watchdog: Watchdog
    hierarchical: bool  # default for allreduce(..., hierarchical=None)
    exit_monitor: faults.ExitMonitor | None = None  # None on one rank
    exit_timeout: float = 600.0  # BAGUA_MPI_EXIT_TIMEOUT_S


_runtime: Runtime | None = None
_atexit_registered = False
_shutdown_callbacks: list = []


def on_shutdown(callback) -> None:
    """Run ``callback()`` at ``shutdown()`` (and so at exit), before the comm thread stops.

    Algorithms with background threads register their ``close`` here so that a job that
    forgets to close its optimizer still stops cleanly on every rank. A bound method is held
    weakly: an object nothing else keeps (an optimizer closed and dropped, whose thread has
    ended) goes with its buffers instead of living until shutdown."""
    if inspect.ismethod(callback):
        method = weakref.WeakMethod(callback)
        _shutdown_callbacks.append(lambda: (method() or (lambda: None))())
    else:
        _shutdown_callbacks.append(callback)


def init(comm: MPI.Intracomm | None = None, *, ranks_per_node: int | None = None,
         hierarchical: bool | None = None, stall_warning_s: float | None = None,
         stall_abort_s: float | None = None, abort_on_exception: bool | None = None,
         backend: str | None = None) -> None:
    """Initialize bagua_mpi on ``comm`` (default ``MPI.COMM_WORLD``); collective over ``comm``.

    Args:
        comm: the communicator whose ranks take part; the library works on a private duplicate.
        ranks_per_node: testing override, see ``topology``; default ``BAGUA_MPI_RANKS_PER_NODE``.
        hierarchical: default for ``allreduce``; default ``BAGUA_MPI_HIERARCHICAL`` (off).
        stall_warning_s / stall_abort_s: watchdog limits; defaults from the environment (60/600).
        abort_on_exception: abort the job on an uncaught exception (any thread) or a non-zero
            ``sys.exit`` on any rank (default ``BAGUA_MPI_ABORT_ON_EXCEPTION``, on).
        backend: who carries the payloads: ``"auto"``, ``"mpi"``, ``"nccl"``,
            ``"nccl_hierarchical"`` or ``"gloo"`` (default ``BAGUA_MPI_BACKEND``, auto; see
            ``bagua_mpi.backends``). A NCCL choice without a GPU or NCCL raises
            ``BackendUnavailableError`` here.

    Raises ``ConfigError`` (a ``ValueError``) naming the variable when a ``BAGUA_MPI_*`` setting
    is malformed.

    Calling ``init`` again after ``shutdown`` starts afresh; calling it twice is a no-op.
    """
    global _runtime, _atexit_registered
    if _runtime is not None:
        return
    settings = config.check_environment()  # every rank fails alike on a malformed value
    backends.set_default(backend)  # checked before anything is built: fails alike everywhere
    backends.check_available(backends.resolve())
    topo = topology.build(comm, ranks_per_node)
    backends.learn_node_gpus(topo.intra)  # collective: which GPU each local rank maps to
    worker = CommWorker(rank=topo.rank)
    warn = stall_warning_s if stall_warning_s is not None else config.stall_warning_s()
    abort = stall_abort_s if stall_abort_s is not None else config.stall_abort_s()
    process_groups.set_timeout(abort)  # NCCL waits on the device, out of the watchdog's view
    monitor = faults.ExitMonitor(topo.comm) if topo.size > 1 else None
    # The watchdog asks the monitor from its own thread while the comm thread is in MPI.
    watched = monitor if topo.thread_level == MPI.THREAD_MULTIPLE else None
    board = flight_recorder.HangBoard.open(topo.comm)  # collective: the job's hang directory
    watchdog = Watchdog(worker, topo.rank, warn, abort, monitor=watched, board=board)
    if hierarchical is None:
        hierarchical = settings["BAGUA_MPI_HIERARCHICAL"]
    _runtime = Runtime(topo, worker, watchdog, bool(hierarchical), monitor,
                       settings["BAGUA_MPI_EXIT_TIMEOUT_S"])
    topology.set_current(topo)
    if abort_on_exception is None:
        abort_on_exception = settings["BAGUA_MPI_ABORT_ON_EXCEPTION"]
    faults.install(bool(abort_on_exception))
    comm_log.attach(worker, topo.comm)  # collective when the log is on (its baseline)
    if not _atexit_registered:
        # runs before mpi4py's own finalize (registered earlier, at import)
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True
    logger.debug("bagua_mpi: rank %d/%d local %d/%d cross %d/%d, %s", topo.rank, topo.size,
                 topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size,
                 topology.thread_level_name(topo.thread_level))


def _shutdown_at_exit() -> None:
    how, code = faults.how_the_process_ends()
    shutdown(_how=how, _code=code)


def shutdown(timeout: float = 60.0, *, _how: int = faults.LEFT_SHUTDOWN, _code: int = 0) -> None:
    """Finish queued operations, agree with the other ranks on leaving, stop the threads and
    free the communicators.

    Collective: every rank calls it (at exit it is called for you). A rank that gets here while
    others still run waits for them up to ``BAGUA_MPI_EXIT_TIMEOUT_S`` (0: for ever), then aborts
    the job naming them; peers blocked in a collective that needs it abort sooner (see
    ``watchdog.py``). ``timeout`` bounds the wait for this rank's own queued operations, and
    as long again for the communication thread to end; an operation still running then (one
    the other ranks never called) aborts the job, naming it.
    """
    global _runtime
    rt = _runtime
    if rt is None:
        return
    while _shutdown_callbacks:
        callback = _shutdown_callbacks.pop()
        try:
            callback()
        except Exception:  # noqa: BLE001 - one failing callback must not stop the others
            logger.exception("bagua_mpi: a shutdown callback failed")
    _runtime = None
    topology.set_current(None)
    began = time.monotonic()
    if not rt.worker.drain(timeout):
        logger.warning("bagua_mpi: operations still pending after %.0f s at shutdown", timeout)
    # The summary is collective: only when this rank leaves normally (a failing one would keep
    # the others waiting in it instead of in the exit agreement, which names it).
    leaving_well = _how != faults.LEFT_EXCEPTION and _code in (0, -1)
    comm_log.detach(report=leaving_well)
    rt.worker.close(timeout)
    if rt.worker.thread_alive():
        # still inside an operation: the steps below would use MPI beside it and free its
        # groups and communicators under it (a crash, where this names the operation)
        rt.watchdog.abort_stuck_at_shutdown(time.monotonic() - began)
    rt.watchdog.stop()
    if rt.exit_monitor is not None and not MPI.Is_finalized():
        _agree_on_leaving(rt, _how, _code)
    faults.uninstall()
    # the process groups and init's choice belong to this runtime; a failing rank does not
    # wait for the device's queued collectives before it takes its groups down
    backends.reset(finish=leaving_well)
    if not MPI.Is_finalized():
        node_shared.free_all()  # collective on each node, like the communicators below
        rt.topo.free()


def _agree_on_leaving(rt: Runtime, how: int, code: int) -> None:
    """The exit agreement (``faults.ExitMonitor``); aborts the job when it fails."""
    monitor = rt.exit_monitor
    rank = rt.topo.rank
    failing = how != faults.LEFT_SHUTDOWN and code not in (0, -1) and faults.installed()
    # A failing rank waits only briefly: the others either fail with it, or must be stopped.
    timeout = (min(rt.exit_timeout, faults.PEER_EXIT_GRACE_S) if rt.exit_timeout
               else faults.PEER_EXIT_GRACE_S) if failing else rt.exit_timeout
    missing = monitor.agree(how, code, timeout)
    if not missing:
        monitor.free()
        return
    me = faults.describe_departure(rank, how, code)
    if rank == 0:
        them = f"rank(s) {', '.join(map(str, missing))} did not reach shutdown within {timeout:g} s"
    else:  # only rank 0 hears from everyone; others may be missing too
        them = f"rank 0 did not reach shutdown within {timeout:g} s"
    if failing:
        faults.abort_job(f"bagua_mpi: {me}, but the others still run ({them}) and would wait "
                         f"for it. Aborting the job (all ranks).", code)
    faults.abort_job(f"bagua_mpi: {me}, but {them} (BAGUA_MPI_EXIT_TIMEOUT_S): still running "
                     f"or blocked. Aborting the job (all ranks).", faults.EXIT_TIMEOUT_CODE)


def get() -> Runtime:
    if _runtime is None:
        raise NotInitializedError("bagua_mpi is not initialized: call bagua_mpi.init() first")
    return _runtime


def is_initialized() -> bool:
    return _runtime is not None


def rank() -> int:
    """Rank of this process in the library's communicator."""
    return get().topo.rank


def size() -> int:
    return get().topo.size


def local_rank() -> int:
    """Rank within this node (or simulated node); use it to pick the GPU."""
    return get().topo.local_rank


def local_size() -> int:
    return get().topo.local_size


def cross_rank() -> int:
    """Index of this node among the nodes (rank in the cross-node communicator)."""
    return get().topo.cross_rank


def cross_size() -> int:
    return get().topo.cross_size


def mpi_threads_supported() -> bool:
    """True when MPI granted MPI_THREAD_MULTIPLE."""
    return get().topo.thread_level == MPI.THREAD_MULTIPLE


def set_hierarchical(value: bool) -> None:
    """Global default for ``allreduce(..., hierarchical=None)``; all ranks must agree."""
    get().hierarchical = bool(value)
