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
