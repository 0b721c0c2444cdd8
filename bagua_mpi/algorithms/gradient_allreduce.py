"""GradientAllReduce: textbook data-parallel SGD (C_FP_S on gradients).

Each bucket's gradients are summed over all ranks and scaled (averaged) with one allreduce of
the flat bucket, or one per tensor when flattening is off. Everything else is the framework's:
the dense exchange (``dense.py``: a 16-bit wire with ``compression``, through the cast
scatter-reduce with float32 sums), the two-level form when hierarchical, and byte counts.
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import Algorithm, AlgorithmImpl
from .registry import register


@register
@dataclass(frozen=True)
class GradientAllReduce(Algorithm):
    """Average gradients with allreduce after each backward (the default algorithm)."""

    name = "gradient_allreduce"
    impl_class = AlgorithmImpl  # the framework's default reduce_bucket is exactly this

    def compression_use(self) -> str | None:
        return "every bucket"
