"""The two errors of ``bagua_mpi.distbelief``, shared by its parameter-server and model-parallel
halves (each half raises both, so they live below either)."""
from __future__ import annotations

from ..exceptions import BaguaMPIError


class DistBeliefError(BaguaMPIError):
    """A parameter-server protocol error: ranks that disagree on the setup, a message from a
    rank with no business sending it, a shard state that does not fit the layout."""


class PartitionError(DistBeliefError, ValueError):
    """A partition that cannot work: blocks that do not cover the units, more partitions than
    units, a replica group size that does not divide the workers, a partition with no
    parameters. Raised before any training message is sent."""
