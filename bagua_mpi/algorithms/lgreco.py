"""L-GreCo (``lgreco``): layer-wise adaptive compression chosen by a DP .

Every parameter tensor is a layer with its own compression level (bits of min-max
quantization, top-k density, or PowerSGD rank). Until ``warmup_steps``, all layers use the
family's default. Then every ``period_steps``:

1. each rank has accumulated its layers' local gradients G_l since the last decision (in the
   communication thread, before compression);
2. rank 0 measures error(l, c) = ||G_l - Q^-1 Q_c(G_l)||^2 for every candidate level c (no error
   feedback in this measurement) and size(l, c) in bytes; E_max = sum_l error(l, default);
3. rank 0 solves the DP of ``lgreco/dp.py`` with 10000 error steps: minimal total bytes with total
   error <= E_max (the time-aware variant minimises sum size(l, c) x seconds-per-byte of the
   layer's bucket instead, from a linear fit time = a + b x bytes of each bucket's transfers);
4. rank 0 broadcasts the assignment; every rank applies it from the next step on, and the
   accumulators restart.

Communication per bucket, each layer at its own level, in one packed exchange that the family
runs, on state it allocates (``lgreco/families.py``: ``init_layer``, ``exchange_``), planned once
an assignment and kept across steps (``AlgorithmImpl.kept_plan``): min-max levels through C_LP_S
(a ``CompressedExchange``: one alltoall and one allgather) with worker/server error feedback per
layer (kept across level changes: the error vectors depend only on the layer's size); top-k
densities through gTopKAllReduce (a ``GTopKExchange``: one tree and one broadcast) with
per-layer residuals; PowerSGD ranks through a ``LowRankExchange`` (one allreduce of all P
factors and one of all Q factors, warm-started Q and error feedback per layer; layers too small
or thin to gain go dense in one allreduce).
Assignment, accumulators and error-feedback state are per-rank state keyed by parameter name
(checkpointed, independent of bucketing). With ``hierarchical=True`` the node leaders run all
of it on their node's summed gradients (the framework's two-level form).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from .. import collectives
from ..lgreco.dp import solve  # the solver and the compressor families live in bagua_mpi.lgreco;
from ..lgreco.families import FAMILIES  # only the algorithm is here, with the others
from .base import Algorithm, AlgorithmImpl
from .forms import float32_layers
from .registry import register
from .validation import (boolean, chosen_by, fraction, non_negative_int, one_of, optional,
                         positive_int, whole_number)


class LGreCoImpl(AlgorithmImpl):
    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        kwargs = {} if algorithm.default is None else {"default": algorithm.default}
        self.family = FAMILIES[algorithm.family](**kwargs)
        self.candidates = self.family.candidates()
        self.default_level = self.family.default
        self.assignment: dict[str, float] = {}  # parameter name -> level
        self.layers: dict[str, tuple[int, torch.Tensor]] = {}  # name -> (index, parameter)
        self.observations: dict[int, deque] = {}  # bucket -> recent (bytes, seconds)
        self.layer_bucket: dict[str, int] = {}
        self.bucket_names: dict[int, list[str]] = {}   # bucket -> its layers, in order
        self.decisions = 0
        self.decision_seconds = 0.0
        self.startup_seconds = 0.0  # rank 0's one-time load of the compiled DP, when the
        # buckets are built (the end of the first iteration)
        self.bytes_dense = 0  # float32 bytes the layers would have sent, for the ratio

    # -- per-layer state (keyed by parameter name, so independent of bucketing) ---------------
    def accumulator(self, name: str) -> torch.Tensor:
        """Layer ``name``'s local gradients summed since the last decision."""
        p = self.layers[name][1]
        return self.state.tensor("accumulator", name,
                                 lambda: torch.zeros(p.numel(), device=p.device))

    # -- buckets and layers ---------------------------------------------------------------------
    def init_buckets(self, buckets) -> None:
        if self.ctx.topo.rank == 0 and not self.startup_seconds:
            # Numba loads (or first compiles) the DP's loop on its first call: a fixed cost
            # of ~0.3 s per process that would otherwise land on the first decision
            started = time.perf_counter()
            solve(np.zeros((1, 1)), np.ones((1, 1)), 1.0)
            self.startup_seconds = time.perf_counter() - started
        for bucket in buckets:
            self.bucket_names[bucket.index] = list(bucket.names)
            for index, name, p in zip(bucket.indices, bucket.names, bucket.real_params()):
                self.layers[name] = (index, p)
                self.layer_bucket[name] = bucket.index
                self.assignment.setdefault(name, self.default_level)

    def init_exchange(self, buckets) -> None:
        """Each layer's accumulator, then its family's state."""
        for bucket in buckets:
            for name in bucket.names:
                self.accumulator(name)
                self.family.init_layer(self, name)

    # -- communication (comm thread) ------------------------------------------------------------
    def reduce_bucket(self, bucket, step: int) -> None:
        """Accumulate each layer's gradient, then one packed exchange of the family for the
        whole bucket, each layer at its own level (bytes and seconds observed for the
        time-aware DP)."""
        transport = self.transport
        with float32_layers(bucket) as grads:  # where the gradients are
            # one operation for the whole bucket (one launch per layer on a GPU otherwise)
            torch._foreach_add_([self.accumulator(name) for name in bucket.names], grads)
            before, started = self.wire.bytes_sent, time.perf_counter()
            self.family.exchange_(self, bucket, grads, transport, step)
            self.observations.setdefault(bucket.index, deque(maxlen=256)).append(
                (self.wire.bytes_sent - before, time.perf_counter() - started))
            n = transport.Get_size()
            self.bytes_dense += 2 * (n - 1) * bucket.numel * 4 // max(1, n)

    # -- decisions (main thread, every rank at the same step) -----------------------------------
    def after_step(self, optimizer) -> None:
        done = self.step + 1
        algo = self.algorithm
        if done < algo.warmup_steps or (done - algo.warmup_steps) % algo.period_steps:
            return
        if not self.buckets:
            return
        started = time.perf_counter()
        proposal = self.decide() if self.ctx.topo.rank == 0 else None
        self.assignment = dict(collectives.broadcast_object(proposal, root_rank=0))
        accumulators = list(self.state.tensors.get("accumulator", {}).values())
        if accumulators:
            torch._foreach_zero_(accumulators)
        self.decisions += 1
        self.decision_seconds += time.perf_counter() - started

    def decide(self) -> dict[str, float]:
        """Rank 0: errors and costs of every level for every layer, then the DP."""
        names = sorted(self.layers, key=lambda name: self.layers[name][0])
        cands = self.candidates
        err = np.empty((len(names), len(cands)))
        size = np.empty_like(err)
        for i, name in enumerate(names):
            shape = tuple(self.layers[name][1].shape)
            err[i] = self.family.errors(self.accumulator(name).cpu().numpy(), cands, shape)
            size[i] = [self.family.size(shape, c) for c in cands]
        default = cands.index(self.default_level)
        e_max = float(err[:, default].sum())
        cost = size * self.seconds_per_byte(names)[:, None] if self.algorithm.time_aware \
            else size
        solution = solve(err, cost, e_max, default=[default] * len(names),
                            steps=self.algorithm.dp_steps)
        return {name: cands[c] for name, c in zip(names, solution.choice)}

    def seconds_per_byte(self, names) -> np.ndarray:
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
        return np.array([slopes.get(self.layer_bucket[name], fallback) for name in names])

    def compression_ratio(self) -> float:
        return self.bytes_dense / max(1, self.wire.bytes_sent)

    # -- checkpoints (tensors go through self.state) --------------------------------------------
    def extra_state(self) -> dict:
        return {"decisions": self.decisions,
                "assignment": {name: float(level) for name, level in self.assignment.items()}}

    def load_extra_state(self, extra: dict) -> None:
        self.decisions = int(extra.get("decisions", 0))
        cast = self.family.level_type
        # layers the saved assignment lacks (saved before the first step: none had a level
        # yet) start at the default, as init_buckets starts them; it will not run again here
        self.assignment = dict.fromkeys(self.layers, self.default_level)
        self.assignment.update({name: cast(level)
                                for name, level in extra.get("assignment", {}).items()})


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
    validators = {
        "family": one_of(sorted(FAMILIES)),
        # None: the family's own default (4 bits / density 0.01 / rank 4)
        "default": optional(chosen_by("family", {
            # 4.0 means 4 bits / rank 4, stored as 4: the search ranges need integers
            "minmax": whole_number(1, 8, because="the minmax family's default is bits"),
            "topk": fraction(because="the topk family's default is a density"),
            "powersgd": whole_number(1, because="the powersgd family's default is a rank")})),
        "warmup_steps": non_negative_int(), "period_steps": positive_int(),
        "time_aware": boolean(), "error_feedback": boolean(),
        "dp_steps": positive_int(because="the error budget's discretization steps")}

    def compression_use(self) -> str | None:
        return "the dense layers" if self.family == "powersgd" else None
