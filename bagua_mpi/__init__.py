"""bagua_mpi: MPI-native data-parallel communication for PyTorch.

Quick start (under ``mpiexec -n 4`` or ``srun``)::

    import bagua_mpi as bm
    bm.init()
    avg = bm.allreduce(torch.ones(3))          # average over ranks
    h = bm.allreduce_async_(grad)              # overlaps with other work
    ...
    bm.synchronize(h)
"""
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
from .exceptions import (BaguaMPIError, CommunicationError, ConfigError, MismatchError,
                         MisuseError, NestedAsyncError, NotInitializedError)
from .ops import Average, Max, Min, Product, ReduceOp, Sum
from .runtime import (cross_rank, cross_size, is_initialized, local_rank, local_size,
                      mpi_threads_supported, rank, set_hierarchical, shutdown, size)
from .worker import Handle
from .compression import Compression
from .optimizer import check_models_agree
from . import algorithms
from .algorithms import UnsupportedOptionError
from . import lgreco  # registers the 'lgreco' algorithm
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
from .horovod import (Adasum, DistributedOptimizer, HorovodInternalError, HostsUpdatedInterrupt,
                      ProcessSet, SyncBatchNorm, add_process_set, broadcast_optimizer_state,
                      broadcast_parameters, ccl_built, cross_node_process_set, cuda_built,
                      ddl_built, gloo_built, gloo_enabled, global_process_set, init,
                      is_homogeneous, mlsl_built, mpi_built, mpi_enabled, nccl_built,
                      node_local_process_set, remove_process_set, rocm_built, start_timeline,
                      stop_timeline, sycl_built)
from .horovod import exceptions as _horovod_exceptions  # noqa: F401

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
    "HorovodInternalError", "HostsUpdatedInterrupt",
]
