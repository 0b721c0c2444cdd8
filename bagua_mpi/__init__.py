"""bagua_mpi: MPI-native data-parallel communication for PyTorch.

Quick start (under ``mpiexec -n 4`` or ``srun``)::

    import bagua_mpi as bm
    bm.init()
    avg = bm.allreduce(torch.ones(3))          # average over ranks
    h = bm.allreduce_async_(grad)              # overlaps with other work
    ...
    bm.synchronize(h)

``import bagua_mpi`` itself imports nothing heavy: the public surface (``__all__``) is loaded on
first use of any of its names, all of it at once (``_load_public_api``), and a subpackage on
first use of its own name. So the command lines that need neither torch nor MPI
(``python -m bagua_mpi.checkpoint info``) start without them, and without initializing MPI.
"""
import importlib
import threading

__version__ = "0.1.0"

# The public surface: what ``import bagua_mpi as bm`` (or ``as hvd``) is meant to offer.
# Subpackages with their own namespaces (algorithms, checkpoint, preemption, elastic, horovod,
# primitives) are imported as modules; distbelief is imported on use (``import
# bagua_mpi.distbelief``); internal modules are not listed.
__all__ = [
    # set-up and topology
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "set_hierarchical",
    "set_consistency_check", "mpi_is_cuda_aware", "set_cuda_aware",
    # collectives
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "sparse_allreduce_async", "barrier", "join",
    "broadcast_object", "allgather_object", "poll", "synchronize", "submit", "Handle",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp", "Compression",
    # process sets
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "node_local_process_set", "cross_node_process_set",
    # training
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
    "check_models_agree", "SyncBatchNorm", "algorithms", "lgreco", "checkpoint", "preemption",
    "elastic", "horovod",
    # Horovod's build and feature queries, timeline
    "mpi_built", "mpi_enabled", "nccl_built", "gloo_built", "gloo_enabled", "ccl_built",
    "ddl_built", "mlsl_built", "cuda_built", "rocm_built", "sycl_built", "start_timeline",
    "stop_timeline", "comm_log", "comm_log_summary",
    # errors
    "BaguaMPIError", "CommunicationError", "ConfigError", "MismatchError", "MisuseError",
    "NestedAsyncError", "NotInitializedError", "UnsupportedOptionError", "JoinedRankError",
    "HorovodInternalError", "HostsUpdatedInterrupt", "DiscardedExchangeWarning",
]

# the names of __all__ that are subpackages or modules: each is imported alone, on first use
_PUBLIC_MODULES = frozenset({"algorithms", "lgreco", "checkpoint", "preemption", "elastic",
                             "horovod", "comm_log"})
_load_lock = threading.RLock()
_loading = False
_loaded = False


def _load_public_api() -> None:
    """Import every name of ``__all__`` into this namespace (once, the first time one is used)."""
    global _loading, _loaded
    with _load_lock:  # a second thread waits for the first thread's load
        if _loaded:
            return
        if _loading:  # a module of the package used a public name while it was being imported
            raise ImportError("bagua_mpi's public API was used while it was being imported; "
                              "import the defining module instead")
        _loading = True
        try:
            found = _import_public_api()
            missing = sorted(set(__all__) - _PUBLIC_MODULES - set(found))
            if missing:
                raise ImportError(f"bagua_mpi.__all__ names {missing}, which nothing defines")
            globals().update(found)
            _loaded = True
        finally:
            _loading = False


def _import_public_api() -> dict:
    """The objects ``__all__`` names, by name (what an eager ``__init__`` would import)."""
    from .collectives import (allgather, allgather_async, allgather_object, allreduce, allreduce_,
                              allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
                              broadcast, broadcast_, broadcast_async, broadcast_async_,
                              broadcast_object, grouped_allgather, grouped_allgather_async,
                              grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                              grouped_allreduce_async_, grouped_reducescatter,
                              grouped_reducescatter_async, join, poll, reducescatter,
                              reducescatter_async, sparse_allreduce_async, synchronize, submit)
    from .consistency import set_enabled as set_consistency_check
    from .cuda import mpi_is_cuda_aware, set_cuda_aware
    from .exceptions import (BaguaMPIError, CommunicationError, ConfigError,
                             DiscardedExchangeWarning, MismatchError, MisuseError,
                             NestedAsyncError, NotInitializedError)
    from .ops import Average, Max, Min, Product, ReduceOp, Sum
    from .runtime import (cross_rank, cross_size, is_initialized, local_rank, local_size,
                          mpi_threads_supported, rank, set_hierarchical, shutdown, size)
    from .worker import Handle
    from .compression import Compression
    from .optimizer import check_models_agree
    from . import algorithms
    from .algorithms import UnsupportedOptionError
    from . import lgreco
    from . import checkpoint, preemption
    from . import comm_log
    from .comm_log import summary as comm_log_summary

    # Horovod compatibility (``import bagua_mpi as hvd``): see bagua_mpi/horovod and
    # docs/horovod.md. These four are imported once, from bagua_mpi.horovod, and are supersets of
    # the native ones (docs/design.md, "The public face"): ``init`` also takes Horovod's
    # ``process_sets=``; ``DistributedOptimizer`` takes Horovod's positional order (optimizer,
    # named_parameters, compression, ...) with bagua's options (``algorithm=``...) by keyword, a
    # subclass of optimizer.DistributedOptimizer; ``broadcast_parameters`` /
    # ``broadcast_optimizer_state`` accept what Horovod's do.
    from . import elastic, horovod
    from .consistency import JoinedRankError
    from .horovod import (Adasum, DistributedOptimizer, HorovodInternalError,
                          HostsUpdatedInterrupt, ProcessSet, SyncBatchNorm, add_process_set,
                          broadcast_optimizer_state, broadcast_parameters, ccl_built,
                          cross_node_process_set, cuda_built, ddl_built, gloo_built,
                          gloo_enabled, global_process_set, init, is_homogeneous, mlsl_built,
                          mpi_built, mpi_enabled, nccl_built, node_local_process_set,
                          remove_process_set, rocm_built, start_timeline, stop_timeline,
                          sycl_built)
    from .horovod import exceptions as _horovod_exceptions  # noqa: F401
    return {name: value for name, value in locals().items() if name in __all__}


def __getattr__(name: str):
    """The public names on first use; any other attribute is tried as a submodule."""
    if name in __all__ and name not in _PUBLIC_MODULES:
        _load_public_api()
        return globals()[name]
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":  # the submodule exists but failed to import
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
