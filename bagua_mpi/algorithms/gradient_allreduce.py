"""GradientAllReduce: textbook data-parallel SGD (C_FP_S on gradients).

Each bucket's gradients are averaged (or summed) over all ranks with one allreduce of the flat
bucket, or one per tensor when flattening is off; hierarchical when the context says so. With a
16-bit ``compression`` the bucket travels as float16/bfloat16 words through the scatter-reduce
scheme of ``primitives.centralized`` (half the bytes; sums in float32).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import collectives
from ..ops import Sum
from ..primitives.centralized import (cast_allreduce_, hierarchical_cast_allreduce_,
                                     wire_bytes_cast_allreduce)
from .base import Algorithm, AlgorithmImpl
from .registry import register


class GradientAllReduceImpl(AlgorithmImpl):
    def reduce_bucket(self, bucket, step: int) -> None:
        ctx = self.ctx
        wire = ctx.compression.wire_dtype
        for grad in bucket.communication_tensors():
            if wire is not None and grad.is_floating_point() and grad.dtype != wire:
                scale = ctx.prescale * ctx.postscale
                if ctx.hierarchical:
                    hierarchical_cast_allreduce_(grad, ctx.topo, wire, scale)
                else:
                    cast_allreduce_(grad, ctx.topo.comm, wire, scale)
                self.wire.add(wire_bytes_cast_allreduce(grad.numel(), ctx.topo.size, 2))
            else:
                collectives.allreduce_(grad, Sum, prescale_factor=ctx.prescale,
                                       postscale_factor=ctx.postscale,
                                       hierarchical=ctx.hierarchical, check=False)
                self.wire.allreduce(grad.numel() * grad.element_size(), ctx.topo.size)


@register
@dataclass(frozen=True)
class GradientAllReduce(Algorithm):
    """Average gradients with allreduce after each backward (the default algorithm)."""

    name = "gradient_allreduce"
    impl_class = GradientAllReduceImpl
