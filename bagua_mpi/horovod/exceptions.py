"""``horovod.common.exceptions`` names, mapped onto bagua_mpi's errors.

``HorovodInternalError`` is ``bagua_mpi.BaguaMPIError`` itself, so ``except HorovodInternalError``
catches what bagua_mpi raises where Horovod raises it (ranks that disagree on shapes, dtypes or
roots: ``MismatchError``; failed communication: ``CommunicationError``).
"""
from ..exceptions import BaguaMPIError

HorovodInternalError = BaguaMPIError


class HostsUpdatedInterrupt(BaguaMPIError):
    """Horovod Elastic's signal that hosts were added or removed. An MPI job has a fixed set of
    ranks, so bagua_mpi never raises it; it exists so that ``except`` clauses still import. A
    ``RuntimeError`` as in Horovod (through ``BaguaMPIError``)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(BaguaMPIError, ImportError):
    """Kept for imports; bagua_mpi has no compiled extension whose version could mismatch."""


def get_version_mismatch_message(name, version, installed_version):
    return (f"Framework {name} installed with version {installed_version} but found version "
            f"{version}. This can result in unexpected bugs.")
