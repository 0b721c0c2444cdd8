"""PowerSGD (Vogels et al. 2019): rank-r gradient compression with error feedback.

Every parameter is a layer. A layer of shape (n, ...) is viewed as an n x m matrix (m = numel
/ n; a conv weight becomes out_channels x in_channels*kh*kw) and compressed when that saves at
least ``min_compression`` x: n m >= min_compression x (n + m) x rank (then rank < min(n, m)).
Other layers, and every 1-D or scalar tensor (biases, norms), go through a plain allreduce.

Per bucket and step (``primitives.lowrank``):

1. the compressed layers' gradients, plus each layer's error-feedback memory, go through one
   ``powersgd_allreduce_``: two allreduces for the whole bucket (the packed P's and Q's);
2. the dense layers' gradients are concatenated and summed in one allreduce;
3. both results are scaled like the other algorithms' (prescale x postscale: the average).

Each compressed layer keeps Q (m x rank), started from ``initial_q(m, rank, seed + layer)``
(the same on every rank) and warm-started from the previous step's averaged Q, and its error
memory (n m floats) unless ``error_feedback=False``. Until ``warmup_steps`` every bucket is a
dense allreduce (the layers' Q and errors stay untouched). Q and errors are keyed by the
parameter's index, so they do not depend on bucketing, and are checkpointed (``state_dict``).
Hierarchical communication is not used: every exchange runs over all ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..primitives.lowrank import LowRankSegment, initial_q, powersgd_allreduce_
from .base import Algorithm, AlgorithmImpl
from .layers import copy_back, dense_allreduce_, host_layer_grads
from .registry import register


class PowerSGDImpl(AlgorithmImpl):
    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.step = 0
        self.shapes: dict[int, tuple[int, int]] = {}  # compressed layer -> (n, m)
        self.qs: dict[int, torch.Tensor] = {}  # compressed layer -> (m, rank) warm start
        self.errors: dict[int, torch.Tensor] = {}  # compressed layer -> (n m,) memory
        self.pending: dict | None = None  # state loaded before the buckets existed

    # -- layers ---------------------------------------------------------------------------------
    def matrix_shape(self, p: torch.Tensor) -> tuple[int, int] | None:
        """(n, m) if parameter ``p`` is compressed, else None (dense)."""
        if p.dim() < 2 or p.numel() == 0:
            return None
        n = p.shape[0]
        m = p.numel() // n
        r = self.algorithm.rank
        return (n, m) if n * m >= self.algorithm.min_compression * (n + m) * r else None

    def init_buckets(self, buckets) -> None:
        super().init_buckets(buckets)
        algo = self.algorithm
        for bucket in buckets:
            for layer, p in zip(bucket.indices, bucket.params):
                shape = self.matrix_shape(p)
                if shape is None:
                    continue
                self.shapes[layer] = shape
                self.qs.setdefault(layer, initial_q(shape[1], algo.rank, algo.seed + layer))
                if algo.error_feedback:
                    self.errors.setdefault(layer, torch.zeros(p.numel(), dtype=torch.float32))
        if self.pending is not None:
            state, self.pending = self.pending, None
            self.load_state_dict(state)

    def on_step_start(self, step: int) -> None:
        self.step = step

    # -- communication (comm thread) ------------------------------------------------------------
    def reduce_bucket(self, bucket, step: int) -> None:
        ctx = self.ctx
        if step < self.algorithm.warmup_steps:  # gradient_allreduce's exchange
            for grad in bucket.communication_tensors():
                dense_allreduce_([grad], ctx, self.wire)
            return
        layers = list(host_layer_grads(bucket))
        segments, dense = [], []
        for layer, g, _ in layers:
            if layer in self.shapes:
                segments.append(LowRankSegment(g, self.shapes[layer][0], self.algorithm.rank,
                                               self.qs[layer], self.errors.get(layer)))
            else:
                dense.append(g)
        dense_allreduce_(dense, ctx, self.wire)
        if segments:
            powersgd_allreduce_(segments, ctx.topo.comm, scale=ctx.prescale * ctx.postscale,
                                stats=self.wire)
        copy_back(layers)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step,
                "q": {str(k): q.clone() for k, q in self.qs.items()},
                "errors": {str(k): e.clone() for k, e in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not self.buckets:  # before the first step builds the buckets: apply it then
            self.pending = state
            self.step = int(state.get("step", 0))
            return
        self.step = int(state.get("step", 0))
        for name, target in (("q", self.qs), ("errors", self.errors)):
            for key, value in state.get(name, {}).items():
                layer = int(key)
                if layer not in target:
                    how = "compress" if name == "q" else "compress with error feedback"
                    raise ValueError(f"checkpoint has PowerSGD {name} state for parameter "
                                     f"{layer}, which this model does not {how}")
                if tuple(value.shape) != tuple(target[layer].shape):
                    raise ValueError(f"checkpoint PowerSGD {name} of parameter {layer} has shape "
                                     f"{tuple(value.shape)}, expected {tuple(target[layer].shape)}"
                                     f" (another rank or model?)")
        for name, target in (("q", self.qs), ("errors", self.errors)):
            for key, value in state.get(name, {}).items():
                target[int(key)].copy_(value)


@register
@dataclass(frozen=True)
class PowerSGD(Algorithm):
    """Rank-``rank`` PowerSGD compression of matrix-shaped gradients, with error feedback."""

    name = "powersgd"
    impl_class = PowerSGDImpl
    rank: int = 4
    warmup_steps: int = 0
    error_feedback: bool = True
    seed: int = 0
    min_compression: float = 2.0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be a positive integer, got {self.rank!r}")
        if (isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int)
                or self.warmup_steps < 0):
            raise ValueError(f"warmup_steps must be a non-negative integer, "
                             f"got {self.warmup_steps!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        # below 1 a "compressed" layer would send more bytes than its dense allreduce (and its
        # rank could exceed min(n, m)); >= 1 keeps rank < min(n, m) for every compressed layer
        if (isinstance(self.min_compression, bool)
                or not isinstance(self.min_compression, (int, float))
                or not math.isfinite(self.min_compression) or self.min_compression < 1):
            raise ValueError(f"min_compression must be a finite number >= 1, "
                             f"got {self.min_compression!r}")
