"""Horovod compatibility: ``import bagua_mpi.horovod as hvd`` (or simply ``import bagua_mpi as
hvd``: every name here is also at the top level of ``bagua_mpi``) runs ``horovod.torch`` code.

See docs/horovod.md ("Coming from Horovod") for the name-by-name table of what is the same,
what differs and what is not supported.
"""

from .. import runtime
from .. import process_sets as _process_sets
from ..collectives import (allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                           allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                           broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                           grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                           grouped_allreduce_async, grouped_allreduce_async_,
                           grouped_reducescatter, grouped_reducescatter_async, join, poll,
                           reducescatter, reducescatter_async, sparse_allreduce_async,
                           synchronize)
from ..compression import Compression
from ..ops import Adasum, Average, Max, Min, Product, Sum
from ..process_sets import (ProcessSet, add_process_set, cross_node_process_set,
                            global_process_set, node_local_process_set, remove_process_set)
from ..runtime import (cross_rank, cross_size, is_initialized, local_rank, local_size,
                       mpi_threads_supported, rank, shutdown, size)
from ..sync_batch_norm import SyncBatchNorm
from ..timeline import start_timeline, stop_timeline
from . import exceptions
from .basics import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                     is_homogeneous, mlsl_built, mpi_built, mpi_enabled, nccl_built, rocm_built,
                     sycl_built)
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .optimizer import DistributedOptimizer


def init(comm=None, process_sets=None, **kwargs) -> None:
    """Horovod's ``init(comm=None, process_sets=None)`` over ``bagua_mpi.runtime.init``.

    ``comm``: an mpi4py communicator (default ``COMM_WORLD``); ``process_sets``: a list of
    ``ProcessSet`` to register (collective), or ``"dynamic"`` (accepted; ``add_process_set``
    always works). Other keywords go to ``bagua_mpi.runtime.init`` (``ranks_per_node=``...).
    """
    if isinstance(comm, (list, tuple)):
        raise ValueError("init(comm=[ranks]) is not supported: pass an mpi4py communicator "
                         "(e.g. MPI.COMM_WORLD.Split(...)) or use process sets")
    runtime.init(comm, **kwargs)
    _process_sets.init_process_sets(process_sets)


# Explicit: what ``horovod.torch`` exports that bagua_mpi supports, plus Horovod's exception
# names and the node-level process sets (tests/test_public_api_unit.py compares the two lists).
__all__ = [
    # set-up and topology
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported",
    # build and feature queries
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "sycl_built", "mlsl_built",
    # collectives
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "sparse_allreduce_async",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "allgather_object", "broadcast_object",
    # ops, compression, process sets
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "node_local_process_set",
    "cross_node_process_set",
    # training, timeline, elastic, errors
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
    "SyncBatchNorm", "start_timeline", "stop_timeline", "elastic", "HorovodInternalError",
    "HostsUpdatedInterrupt",
]


def __getattr__(name: str):
    """``hvd.elastic`` on first use: ``bagua_mpi.elastic`` imports this package's exceptions,
    so importing it here, at the top, would make each package wait on the other half-imported."""
    if name == "elastic":
        from .. import elastic
        return elastic
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
