"""PowerSGD (Vogels et al. 2019): rank-r gradient compression with error feedback.

Every parameter is a layer. A layer of shape (n, ...) is viewed as an n x m matrix (m = numel
/ n; a conv weight becomes out_channels x in_channels*kh*kw) and compressed when that saves at
least ``min_compression`` x: n m >= min_compression x (n + m) x rank (then rank < min(n, m)).
Other layers, and every 1-D or scalar tensor (biases, norms), go through a plain allreduce.

Per bucket and step (``primitives.lowrank``):

1. the compressed layers' gradients, plus each layer's error-feedback memory, go through one
   ``LowRankExchange`` (planned at the bucket's first compressed step, then kept): two
   allreduces for the whole bucket (the packed P's and Q's);
2. the dense layers' gradients are concatenated and summed in one allreduce;
3. both results are scaled like the other algorithms' (prescale x postscale: the average).

Each compressed layer keeps Q (m x rank), started from ``initial_q(m, rank, seed + layer)``
(the same on every rank) and warm-started from the previous step's averaged Q, and its error
memory (n m floats) unless ``error_feedback=False``. Until ``warmup_steps`` every bucket is a
dense allreduce (the layers' Q and errors stay untouched). Q and errors are keyed by the
parameter, so they do not depend on bucketing, and are checkpointed. With ``hierarchical=True``
the node leaders compress their node's summed gradient (the framework's two-level form).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..buffers import FusedTensors
from ..primitives.lowrank import (LowRankExchange, LowRankSegment, initial_q,
                                  prepare_host_route)
from .base import Algorithm, AlgorithmImpl
from .registry import register
from .forms import float32_layers
from .validation import boolean, non_negative_int, positive_int, random_seed, real_at_least


class PowerSGDImpl(AlgorithmImpl):
    # -- layers ---------------------------------------------------------------------------------
    def matrix_shape(self, p: torch.Tensor) -> tuple[int, int] | None:
        """(n, m) if parameter ``p`` is compressed, else None (dense)."""
        if p.dim() < 2 or p.numel() == 0:
            return None
        n = p.shape[0]
        m = p.numel() // n
        r = self.algorithm.rank
        return (n, m) if n * m >= self.algorithm.min_compression * (n + m) * r else None

    def layer_state(self, bucket, name: str, p: torch.Tensor, seed: int):
        """(Q, error memory or None) of compressed parameter ``name`` of ``bucket``. The Q's of
        a bucket's layers of one shape lie end to end in one memory, and so do their error
        memories, so that the exchange multiplies them as one batch of matrices
        (``LowRankExchange``); a checkpoint holds them by parameter name all the same."""
        algo = self.algorithm
        q, error = self.state.made("q", name), self.state.made("error", name)
        if q is not None and (error is not None or not algo.error_feedback):
            return q, error   # every step but the first
        shape = self.matrix_shape(p)
        n, m = shape
        group = (bucket.index, shape)

        def members(length):   # the bucket's layers of this shape, asked once per memory
            return lambda: {member: length for member, other in zip(bucket.names,
                                                                   bucket.real_params())
                            if self.matrix_shape(other) == shape}
        q = self.state.tensor_in_group(
            "q", name, group, members(m * algo.rank), p.device, shape=(m, algo.rank),
            initial=lambda: initial_q(m, algo.rank, algo.seed + seed))
        error = (self.state.tensor_in_group("error", name, group, members(n * m), p.device)
                 if algo.error_feedback else None)
        return q, error

    def init_exchange(self, buckets) -> None:
        for bucket in buckets:
            for layer, name, p in zip(bucket.indices, bucket.names, bucket.real_params()):
                if self.matrix_shape(p) is not None:
                    self.layer_state(bucket, name, p, layer)
                    if not p.is_cuda:
                        prepare_host_route()

    # -- communication (comm thread) ------------------------------------------------------------
    def reduce_bucket(self, bucket, step: int) -> None:
        with float32_layers(bucket) as grads:  # where the gradients are
            dense, low_rank = self.kept_plan(bucket, grads, lambda: self.plan(bucket, grads))
            self.dense_allreduce_(dense)
            low_rank.run(self.transport, scale=self.scale, stats=self.wire)

    def plan(self, bucket, grads: list) -> tuple[FusedTensors, LowRankExchange]:
        """The bucket's dense gradients (summed as one message), and the ``LowRankExchange``
        of its compressed layers (kept across steps: ``kept_plan``)."""
        segments, dense = [], []
        for layer, name, p, g in zip(bucket.indices, bucket.names, bucket.real_params(), grads):
            shape = self.matrix_shape(p)
            if shape is None:
                dense.append(g)
                continue
            q, error = self.layer_state(bucket, name, p, layer)
            segments.append(LowRankSegment(g, shape[0], self.algorithm.rank, q, error))
        return FusedTensors(dense), LowRankExchange(segments)


@register
@dataclass(frozen=True)
class PowerSGD(Algorithm):
    """Rank-``rank`` PowerSGD compression of matrix-shaped gradients, with error feedback."""

    name = "powersgd"
    impl_class = PowerSGDImpl
    dense_warmup = True
    rank: int = 4
    warmup_steps: int = 0
    error_feedback: bool = True
    seed: int = 0
    min_compression: float = 2.0
    validators = {
        "rank": positive_int(), "warmup_steps": non_negative_int(),
        "error_feedback": boolean(), "seed": random_seed(),
        # below 1 a "compressed" layer would send more bytes than its dense allreduce (and its
        # rank could exceed min(n, m)); >= 1 keeps rank < min(n, m) for every compressed layer
        "min_compression": real_at_least(1, because="a compressed layer must send fewer bytes "
                                         "than its dense allreduce")}

    def compression_use(self) -> str | None:
        return "the dense layers (biases, norms, small matrices) and the warm-up stage"
