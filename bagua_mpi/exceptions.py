"""The library's exceptions: one root (a ``RuntimeError``) so users can catch them all."""


class BaguaMPIError(RuntimeError):
    """Root of every error bagua_mpi raises on its own account."""


class NotInitializedError(BaguaMPIError):
    """A function needs ``bagua_mpi.init()`` to have been called first."""


class MismatchError(BaguaMPIError):
    """Ranks called the same collective with arguments that disagree.

    Raised on *every* rank of the communicator, with each rank's view in the message,
    instead of letting MPI hang or reduce garbage.
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
