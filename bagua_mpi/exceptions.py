"""The library's exceptions: one root (a ``RuntimeError``) so users can catch them all."""
from .lazy_names import lazy_names


class BaguaMPIError(RuntimeError):
    """Root of every error bagua_mpi raises on its own account."""


class NotInitializedError(BaguaMPIError):
    """A function needs ``bagua_mpi.init()`` to have been called first."""


class MismatchError(BaguaMPIError):
    """Ranks called the same collective with arguments that disagree.

    Raised on *every* rank of the communicator, with each rank's view in the message,
    instead of letting MPI hang or reduce garbage. (One exception: the decentralized
    algorithms compare hyperparameters with ring neighbours only, and raise it on the ranks
    next to a difference; uncaught, it ends the job.)
    """


class CommunicationError(BaguaMPIError):
    """An MPI call failed, or an asynchronous operation ended with an error."""


class ConfigError(BaguaMPIError, ValueError):
    """A ``BAGUA_MPI_*`` environment variable holds a value the library cannot use.

    Also a ``ValueError``, so code that validated settings before this class existed still
    catches it.
    """


class MisuseError(BaguaMPIError):
    """The library was called in a way that would deadlock or corrupt data; the message says
    what to do instead."""


class NestedAsyncError(MisuseError):
    """An asynchronous operation was submitted from inside a running library operation (on the
    communication thread, e.g. in an algorithm's ``reduce_bucket``). It could only run after the
    operation that submitted it, so waiting for it there would deadlock; the synchronous form
    runs inline instead."""


class DiscardedExchangeWarning(UserWarning):
    """``zero_grad()`` discarded gradients that ``DistributedOptimizer`` had already exchanged
    and that no ``step()`` used. Intended when a step is skipped on purpose; otherwise a
    backward pass reached this optimizer's parameters that should not have (run it inside
    ``opt.no_sync()``). Filter it with ``warnings.filterwarnings`` when skips are routine."""


# -- every other exception class of the library, re-exported here ----------------------------------
# They are defined next to the code that raises them, and those modules import this one, so they
# are re-exported lazily (PEP 562): ``from bagua_mpi.exceptions import CheckpointError`` works and
# imports the defining module on first use. Every one derives from ``BaguaMPIError``, except the
# ``numba_kernels`` errors: that package is stand-alone (it must not import bagua_mpi), so its
# root is its own ``KernelError`` (a ``RuntimeError``), re-exported here too.
_REEXPORTS = {
    "JoinedRankError": "bagua_mpi.consistency",
    "UnsupportedOptionError": "bagua_mpi.algorithms.base",
    "BackendError": "bagua_mpi.backends",
    "BackendUnavailableError": "bagua_mpi.backends",
    "StoreUnreachableError": "bagua_mpi.process_groups",
    "CheckpointError": "bagua_mpi.checkpoint.errors",
    "CheckpointNotFoundError": "bagua_mpi.checkpoint.errors",
    "CheckpointCorruptError": "bagua_mpi.checkpoint.errors",
    "CheckpointFormatError": "bagua_mpi.checkpoint.errors",
    "CheckpointWriteError": "bagua_mpi.checkpoint.errors",
    "WorldSizeMismatchError": "bagua_mpi.checkpoint.errors",
    "DistBeliefError": "bagua_mpi.distbelief.errors",
    "PartitionError": "bagua_mpi.distbelief.errors",
    "HorovodInternalError": "bagua_mpi.horovod.exceptions",
    "HostsUpdatedInterrupt": "bagua_mpi.horovod.exceptions",
    "HorovodVersionMismatchError": "bagua_mpi.horovod.exceptions",
    "KernelError": "numba_kernels.errors",
    "KernelParameterError": "numba_kernels.errors",
    "KernelTypeError": "numba_kernels.errors",
    "LayoutError": "numba_kernels.errors",
    "PayloadError": "numba_kernels.errors",
    "DeviceMismatchError": "numba_kernels.errors",
    "CudaUnavailableError": "numba_kernels.errors",
    "WarpDivergence": "numba_kernels.errors",
    "MemoryRace": "numba_kernels.errors",
}

__all__ = ["BaguaMPIError", "NotInitializedError", "MismatchError", "CommunicationError",
           "ConfigError", "MisuseError", "NestedAsyncError", "DiscardedExchangeWarning",
           *_REEXPORTS]

__getattr__, __dir__ = lazy_names(__name__, _REEXPORTS, globals())
