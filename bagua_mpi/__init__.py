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
                          broadcast_object, grouped_allreduce, grouped_allreduce_,
                          grouped_allreduce_async, grouped_allreduce_async_, poll,
                          reducescatter, reducescatter_async, synchronize, submit)
from .consistency import set_enabled as set_consistency_check
from .cuda import mpi_is_cuda_aware, set_cuda_aware
from .exceptions import (BaguaMPIError, CommunicationError, MismatchError,
                         NotInitializedError)
from .ops import Average, Max, Min, Product, ReduceOp, Sum
from .runtime import (cross_rank, cross_size, init, is_initialized, local_rank, local_size,
                      mpi_threads_supported, rank, set_hierarchical, shutdown, size)
from .worker import Handle
from .compression import Compression
from .optimizer import (DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters,
                        check_models_agree)
from . import algorithms
from . import lgreco  # registers the 'lgreco' algorithm
from . import checkpoint, preemption

__version__ = "0.1.0"
