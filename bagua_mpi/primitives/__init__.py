"""Communication primitives over flat tensors, used by the algorithms (SPEC §2)."""
from .centralized import cast_allreduce_, partition_bounds

__all__ = ["cast_allreduce_", "partition_bounds"]
