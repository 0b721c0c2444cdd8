"""L-GreCo (``lgreco``): layer-wise adaptive compression chosen by a DP (SPEC §6).

Every parameter tensor is a layer with its own compression level (bits of min-max
quantization, top-k density, or PowerSGD rank). Until ``warmup_steps``, all layers use the
family's default. Then every ``period_steps``:

1. each rank has accumulated its layers' local gradients G_l since the last decision (in the
   communication thread, before compression);
2. rank 0 measures error(l, c) = ||G_l - Q^-1 Q_c(G_l)||^2 for every candidate level c (no error
   feedback in this measurement) and size(l, c) in bytes; E_max = sum_l error(l, default);
3. rank 0 solves the DP of ``dp.py`` with 10000 error steps: minimal total bytes with total
   error <= E_max (the time-aware variant minimises sum size(l, c) x seconds-per-byte of the
   layer's bucket instead, from a linear fit time = a + b x bytes of each bucket's transfers);
4. rank 0 broadcasts the assignment; every rank applies it from the next step on, and the
   accumulators restart.

Communication per bucket, each layer at its own level, in one packed exchange: min-max levels
through C_LP_S (``packed_compressed_allreduce_``: one alltoall and one allgather) with
worker/server error feedback per layer (kept across level changes: the error vectors depend
only on the layer's size); top-k densities through gTopKAllReduce (``packed_gtopk_allreduce_``:
one tree and one broadcast) with per-layer residuals; PowerSGD ranks through
``powersgd_allreduce_`` (one allreduce of all P factors and one of all Q factors, warm-started
Q and error feedback per layer; layers too small or thin to gain go dense in one allreduce).
Assignment, accumulators and error-feedback state are in ``state_dict()`` (checkpointed).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from .. import collectives
from ..algorithms.base import Algorithm, AlgorithmImpl
from ..algorithms.layers import copy_back, dense_allreduce_, host_layer_grads
from ..algorithms.registry import register
from ..primitives.codecs import call_seed
from ..primitives.lowprec import (Segment, packed_compressed_allreduce_, padded_length,
                                  partition_length)
from ..primitives.lowrank import LowRankSegment, initial_q, powersgd_allreduce_
from ..primitives.sparse import SparseSegment, packed_gtopk_allreduce_, topk_count
from . import dp
from .families import FAMILIES, matrix_shape


class LGreCoImpl(AlgorithmImpl):
    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        kwargs = {} if algorithm.default is None else {"default": algorithm.default}
        self.family = FAMILIES[algorithm.family](**kwargs)
        self.candidates = self.family.candidates()
        self.default_level = self.family.default
        self.assignment: dict[int, float] = {}  # layer (parameter index) -> level
        self.accumulators: dict[int, torch.Tensor] = {}
        self.errors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # min-max EF per layer
        self.residuals: dict[int, torch.Tensor] = {}  # top-k residual per layer
        self.lowrank: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # PowerSGD q, EF
        self.observations: dict[int, deque] = {}  # bucket -> recent (bytes, seconds)
        self.layer_bucket: dict[int, int] = {}
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.step = 0
        self.decisions = 0
        self.decision_seconds = 0.0
        self.startup_seconds = 0.0  # rank 0's one-time load of the compiled DP, at wrap time
        self.bytes_dense = 0  # float32 bytes the layers would have sent, for the ratio

    # -- buckets and layers ---------------------------------------------------------------------
    def init_buckets(self, buckets) -> None:
        super().init_buckets(buckets)
        if self.ctx.topo.rank == 0 and not self.startup_seconds:
            # Numba loads (or first compiles) the DP's loop on its first call: a fixed cost
            # of ~0.3 s per process that would otherwise land on the first decision
            started = time.perf_counter()
            dp.solve(np.zeros((1, 1)), np.ones((1, 1)), 1.0)
            self.startup_seconds = time.perf_counter() - started
        n = self.ctx.topo.size
        for bucket in buckets:
            for layer, p in zip(bucket.indices, bucket.params):
                numel = p.numel()
                self.layer_bucket[layer] = bucket.index
                self.shapes[layer] = tuple(p.shape)
                self.assignment.setdefault(layer, self.default_level)
                self.accumulators[layer] = torch.zeros(numel, dtype=torch.float32)
                if self.family.name == "minmax" and self.algorithm.error_feedback:
                    self.errors[layer] = (torch.zeros(padded_length(numel, n)),
                                          torch.zeros(partition_length(numel, n)))
                elif self.family.name == "topk":
                    self.residuals[layer] = torch.zeros(numel, dtype=torch.float32)
                elif self.family.name == "powersgd" and any(
                        self.family.compressed(p.shape, r) for r in self.candidates):
                    rows, cols = matrix_shape(p.shape)
                    top = min(max(self.candidates), rows, cols)
                    self.lowrank[layer] = (
                        initial_q(cols, top, self.family.seed + layer),
                        torch.zeros(numel) if self.algorithm.error_feedback else None)

    def on_step_start(self, step: int) -> None:
        self.step = step

    # -- communication (comm thread) ------------------------------------------------------------
    def reduce_bucket(self, bucket, step: int) -> None:
        """One packed exchange for the whole bucket, each layer at its own level."""
        comm = self.ctx.topo.comm
        scale = self.ctx.prescale * self.ctx.postscale
        layers = list(host_layer_grads(bucket))
        for layer, g, _ in layers:
            self.accumulators[layer] += g
        before, started = self.wire.bytes_sent, time.perf_counter()
        if self.family.name == "minmax":
            packed_compressed_allreduce_(
                [Segment(g, self.family.codec(int(self.assignment[layer])),
                         *self.errors.get(layer, (None, None)), seed=call_seed(step, layer))
                 for layer, g, _ in layers], comm, scale=scale, stats=self.wire)
        elif self.family.name == "topk":
            packed_gtopk_allreduce_(
                [SparseSegment(g, topk_count(g.numel(), self.assignment[layer]),
                               self.residuals[layer]) for layer, g, _ in layers],
                comm, scale=scale, stats=self.wire)
        else:
            self._exchange_low_rank(layers, comm, scale)
        self.observations.setdefault(bucket.index, deque(maxlen=256)).append(
            (self.wire.bytes_sent - before, time.perf_counter() - started))
        n = comm.Get_size()
        for _, g, _ in layers:
            self.bytes_dense += 2 * (n - 1) * g.numel() * 4 // max(1, n)
        copy_back(layers)

    def _exchange_low_rank(self, layers, comm, scale: float) -> None:
        """PowerSGD for the layers that compress at their rank (one P and one Q allreduce for
        all of them), one float32 allreduce for the rest."""
        low, dense = [], []
        for layer, g, _ in layers:
            rank = int(self.assignment[layer])
            if layer in self.lowrank and self.family.compressed(self.shapes[layer], rank):
                q, error = self.lowrank[layer]
                low.append(LowRankSegment(g, matrix_shape(self.shapes[layer])[0], rank, q,
                                          error))
            else:
                dense.append(g)
        powersgd_allreduce_(low, comm, scale=scale, stats=self.wire)
        dense_allreduce_(dense, self.ctx, self.wire)

    # -- decisions (main thread, every rank at the same step) -----------------------------------
    def after_step(self, optimizer) -> None:
        done = self.step + 1
        algo = self.algorithm
        if done < algo.warmup_steps or (done - algo.warmup_steps) % algo.period_steps:
            return
        if done == 0 or not self.accumulators:
            return
        started = time.perf_counter()
        proposal = self.decide() if self.ctx.topo.rank == 0 else None
        self.assignment = dict(collectives.broadcast_object(proposal, root_rank=0))
        for acc in self.accumulators.values():
            acc.zero_()
        self.decisions += 1
        self.decision_seconds += time.perf_counter() - started

    def decide(self) -> dict[int, float]:
        """Rank 0: errors and costs of every level for every layer, then the DP."""
        layers = sorted(self.accumulators)
        cands = self.candidates
        err = np.empty((len(layers), len(cands)))
        size = np.empty_like(err)
        for i, layer in enumerate(layers):
            g = self.accumulators[layer].numpy()
            err[i] = self.family.errors(g, cands, self.shapes[layer])
            size[i] = [self.family.size(self.shapes[layer], c) for c in cands]
        default = cands.index(self.default_level)
        e_max = float(err[:, default].sum())
        cost = size * self.seconds_per_byte(layers)[:, None] if self.algorithm.time_aware \
            else size
        solution = dp.solve(err, cost, e_max, default=[default] * len(layers),
                            steps=self.algorithm.dp_steps)
        return {layer: cands[c] for layer, c in zip(layers, solution.choice)}

    def seconds_per_byte(self, layers) -> np.ndarray:
        """Slope b of time = a + b x bytes per bucket (median slope where a fit is not possible)."""
        slopes = {}
        for b, obs in self.observations.items():
            x = np.array([o[0] for o in obs], dtype=np.float64)
            y = np.array([o[1] for o in obs], dtype=np.float64)
            if len(obs) >= 2 and np.ptp(x) > 0:
                slope = np.polyfit(x, y, 1)[0]
                if slope > 0:
                    slopes[b] = slope
        fallback = float(np.median(list(slopes.values()))) if slopes else 1.0
        return np.array([slopes.get(self.layer_bucket[layer], fallback) for layer in layers])

    def compression_ratio(self) -> float:
        return self.bytes_dense / max(1, self.wire.bytes_sent)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        layers = sorted(self.assignment)
        return {"step": self.step, "decisions": self.decisions,
                "layers": torch.tensor(layers, dtype=torch.int64),
                "levels": torch.tensor([float(self.assignment[k]) for k in layers]),
                "accumulators": {str(k): v.clone() for k, v in self.accumulators.items()},
                "errors": {str(k): {"worker": w.clone(), "server": s.clone()}
                           for k, (w, s) in self.errors.items()},
                "residuals": {str(k): v.clone() for k, v in self.residuals.items()},
                "lowrank": {str(k): {"q": q.clone()} | ({} if e is None else {"error": e.clone()})
                            for k, (q, e) in self.lowrank.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.decisions = int(state["decisions"])
        cast = float if self.family.name == "topk" else int
        self.assignment = {int(k): cast(v) for k, v in zip(state["layers"].tolist(),
                                                          state["levels"].tolist())}
        for name, target in (("accumulators", self.accumulators),
                             ("residuals", self.residuals)):
            for k, v in state[name].items():
                target[int(k)].copy_(v)
        for k, pair in state.get("lowrank", {}).items():
            q, error = self.lowrank[int(k)]
            q.copy_(pair["q"])
            if error is not None:
                error.copy_(pair["error"])
        for k, pair in state["errors"].items():
            w, s = self.errors[int(k)]
            w.copy_(pair["worker"])
            s.copy_(pair["server"])


@register
@dataclass(frozen=True)
class LGreCo(Algorithm):
    """Layer-wise adaptive compression: min-max bits, top-k density or PowerSGD rank per
    layer, by DP."""

    name = "lgreco"
    impl_class = LGreCoImpl
    family: str = "minmax"
    default: float | None = None  # 4 bits / density 0.01 / rank 4 when None
    warmup_steps: int = 20
    period_steps: int = 50
    time_aware: bool = False
    error_feedback: bool = True
    dp_steps: int = 10_000

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {self.family!r}")
        if self.default is not None:
            if self.family == "topk":
                if isinstance(self.default, bool) or not 0 < self.default <= 1:
                    raise ValueError(f"the topk family's default is a density in (0, 1], got "
                                     f"{self.default!r}")
            elif (isinstance(self.default, bool) or not float(self.default).is_integer()
                  or self.default < 1 or (self.family == "minmax" and self.default > 8)):
                what = "bits in 1..8" if self.family == "minmax" else "a rank >= 1"
                raise ValueError(f"the {self.family} family's default is {what}, got "
                                 f"{self.default!r}")
            else:  # 4.0 means 4 bits / rank 4: the search ranges need integers
                object.__setattr__(self, "default", int(self.default))
        if self.period_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"need period_steps >= 1 and warmup_steps >= 0, got "
                             f"{self.period_steps!r}, {self.warmup_steps!r}")
