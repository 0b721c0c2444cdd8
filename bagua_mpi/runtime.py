"""Process-wide state: ``init``/``shutdown`` and the topology queries.

``init()`` builds the topology (private communicators), starts the communication thread and the
stall watchdog, and installs the abort-on-uncaught-exception hook. ``shutdown()`` drains pending
operations and frees the communicators; it runs at exit too, before mpi4py finalizes MPI, so no
rank can deadlock in ``MPI_Finalize`` behind a half-finished collective.
"""
from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass

from mpi4py import MPI

from . import config, faults, topology
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


_runtime: Runtime | None = None
_atexit_registered = False
_shutdown_callbacks: list = []


def on_shutdown(callback) -> None:
    """Run ``callback()`` at ``shutdown()`` (and so at exit), before the comm thread stops.

    Algorithms with background threads register their ``close`` here so that a job that
    forgets to close its optimizer still stops cleanly on every rank."""
    _shutdown_callbacks.append(callback)


def init(comm: MPI.Intracomm | None = None, *, ranks_per_node: int | None = None,
         hierarchical: bool | None = None, stall_warning_s: float | None = None,
         stall_abort_s: float | None = None, abort_on_exception: bool | None = None) -> None:
    """Initialize bagua_mpi on ``comm`` (default ``MPI.COMM_WORLD``); collective over ``comm``.

    Args:
        comm: the communicator whose ranks take part; the library works on a private duplicate.
        ranks_per_node: testing override, see ``topology``; default ``BAGUA_MPI_RANKS_PER_NODE``.
        hierarchical: default for ``allreduce``; default ``BAGUA_MPI_HIERARCHICAL`` (off).
        stall_warning_s / stall_abort_s: watchdog limits; defaults from the environment (60/600).
        abort_on_exception: abort the job on an uncaught exception on any rank (default on).

    Calling ``init`` again after ``shutdown`` starts afresh; calling it twice is a no-op.
    """
    global _runtime, _atexit_registered
    if _runtime is not None:
        return
    topo = topology.build(comm, ranks_per_node)
    worker = CommWorker()
    warn = stall_warning_s if stall_warning_s is not None else config.env_float(
        "BAGUA_MPI_STALL_WARNING_S", 60.0)
    abort = stall_abort_s if stall_abort_s is not None else config.env_float(
        "BAGUA_MPI_STALL_ABORT_S", 600.0)
    watchdog = Watchdog(worker, topo.rank, warn, abort)
    if hierarchical is None:
        hierarchical = config.env_flag("BAGUA_MPI_HIERARCHICAL", False)
    _runtime = Runtime(topo, worker, watchdog, bool(hierarchical))
    topology.set_current(topo)
    if abort_on_exception is None:
        abort_on_exception = config.env_flag("BAGUA_MPI_ABORT_ON_EXCEPTION", True)
    if abort_on_exception:
        faults.install()
    if not _atexit_registered:
        atexit.register(shutdown)  # runs before mpi4py's own finalize (registered earlier)
        _atexit_registered = True
    logger.debug("bagua_mpi: rank %d/%d local %d/%d cross %d/%d, %s", topo.rank, topo.size,
                 topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size,
                 topology.thread_level_name(topo.thread_level))


def shutdown(timeout: float = 60.0) -> None:
    """Finish queued operations, stop the threads and free the communicators."""
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
    if not rt.worker.drain(timeout):
        logger.warning("bagua_mpi: operations still pending after %.0f s at shutdown", timeout)
    rt.worker.close(timeout)
    rt.watchdog.stop()
    faults.uninstall()
    if not MPI.Is_finalized():
        rt.topo.free()


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
