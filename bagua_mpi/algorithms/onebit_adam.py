"""1-bit Adam (SPEC §3): Adam whose momentum is averaged with 1-bit compression.

How users set it up::

    opt = bagua_mpi.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                         weight_decay=0.0),                 # or torch.optim.AdamW
        algorithm=bagua_mpi.algorithms.OneBitAdam(warmup_steps=100))

lr, betas, eps and weight decay are the wrapped Adam's (read from ``param_groups`` at every step,
so LR schedulers keep working); the warm-up length is the algorithm's.

Stages:

1. **warm-up** (steps < ``warmup_steps``): ordinary Adam on gradients averaged in full
   precision (the wrapped optimizer steps);
2. **switch** (after step ``warmup_steps - 1``): the second moment v is frozen (Adam's
   ``exp_avg_sq``, bias-corrected) and the momentum m taken over from Adam's ``exp_avg``;
3. **compressed stage**: each rank updates its momentum with its *local* gradient,
   ``m <- beta1 m + (1 - beta1) g`` (plus ``weight_decay * p`` for Adam's L2 form), then m is
   averaged with C_LP_S under 1-bit compression (signs + ||.||/sqrt(n) scale per chunk) with error
   feedback on both phases (worker and server errors, per rank, checkpointed); the update is
   ``p <- p - lr m / (sqrt(v) + eps)`` (AdamW also ``p <- p (1 - lr wd)``).

Each rank then sends ~1/32 of the float32 bytes per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import collectives
from ..ops import Sum
from ..primitives.codecs import OneBitCodec
from .base import Algorithm
from .compressed import CompressedAllReduceImpl
from .registry import register


class OneBitAdamImpl(CompressedAllReduceImpl):
    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.error_feedback = True
        self.stage = "warmup"
        self.moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (m, v)
        self.betas: tuple[float, float] | None = None
        self.decoupled = False

    def reduce_bucket(self, bucket, step: int) -> None:
        if self.stage == "warmup":
            ctx = self.ctx
            for grad in bucket.communication_tensors():
                collectives.allreduce_(grad, Sum, prescale_factor=ctx.prescale,
                                       postscale_factor=ctx.postscale,
                                       hierarchical=ctx.hierarchical, check=False)
                self.wire.allreduce(grad.numel() * grad.element_size(), ctx.topo.size)
            return
        m, _ = self.moments[bucket.index]
        beta1 = self.betas[0]
        grad = torch.cat([p.grad.reshape(-1) for p in bucket.params]) \
            if bucket.flat_grad is None else bucket.flat_grad
        if self.l2:
            grad = grad + self.l2 * _flat_params(bucket)
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        self.reduce_tensor(m, bucket.index, 0, step, scale=1.0 / self.ctx.topo.size)

    def after_step(self, optimizer) -> None:
        if self.stage == "warmup" and self.step + 1 >= self.algorithm.warmup_steps:
            self._freeze(optimizer)

    def _freeze(self, optimizer) -> None:
        """Take m and (bias-corrected) v over from Adam's state, bucket by bucket."""
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"onebit_adam needs torch.optim.Adam or AdamW, got "
                            f"{type(optimizer).__name__}")
        betas = {tuple(g["betas"]) for g in optimizer.param_groups}
        if len(betas) != 1:
            raise ValueError(f"onebit_adam needs the same betas in every param group, got {betas}")
        decays = {g["weight_decay"] for g in optimizer.param_groups}
        if not isinstance(optimizer, torch.optim.AdamW) and len(decays) > 1:
            raise ValueError("onebit_adam with Adam's L2 weight decay needs one weight_decay for "
                             f"all param groups, got {sorted(decays)} (AdamW allows several)")
        self.bind_optimizer(optimizer)
        self.betas = betas.pop()
        for bucket in self.buckets:
            m = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in bucket.params])
            v = torch.cat([(optimizer.state[p]["exp_avg_sq"]
                            / (1 - self.betas[1] ** float(optimizer.state[p]["step"]))).reshape(-1)
                           for p in bucket.params])
            self.moments[bucket.index] = (m.float(), v.float())
        self.stage = "compressed"
        self._init_errors()

    @property
    def l2(self) -> float:
        if self.decoupled or not self.buckets:
            return 0.0
        return float(self._group_of[self.buckets[0].params[0]]["weight_decay"])

    def _init_errors(self) -> None:
        comm = self.comm
        if comm is None:
            return
        from ..primitives.lowprec import padded_length, partition_length
        n = comm.Get_size()
        for b, (m, _) in self.moments.items():
            self.errors.setdefault((b, 0), (torch.zeros(padded_length(m.numel(), n)),
                                            torch.zeros(partition_length(m.numel(), n))))

    def init_buckets(self, buckets) -> None:
        self.buckets = buckets  # errors are made at the switch, for the momentum buffers

    def optimizer_step(self, optimizer, closure=None):
        if self.stage == "warmup":
            return super().optimizer_step(optimizer, closure)
        loss = closure() if closure is not None else None
        with torch.no_grad():
            for bucket in self.buckets:
                m, v = self.moments[bucket.index]
                offset = 0
                for p in bucket.params:
                    n = p.numel()
                    group = self._group_of[p]
                    lr, eps = group["lr"], group["eps"]
                    if self.decoupled and group["weight_decay"]:
                        p.mul_(1 - lr * group["weight_decay"])
                    update = m[offset:offset + n] / (v[offset:offset + n].sqrt() + eps)
                    p.add_(update.view_as(p), alpha=-lr)
                    offset += n
        return loss

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["stage"] = self.stage
        state["moments"] = {str(b): {"m": m.clone(), "v": v.clone()}
                            for b, (m, v) in self.moments.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.stage = state["stage"]
        if self.stage == "compressed":
            self.moments = {int(b): (mv["m"].clone().float(), mv["v"].clone().float())
                            for b, mv in state["moments"].items()}
            self._init_errors()
        super().load_state_dict(state)

    def bind_optimizer(self, optimizer) -> None:
        """Know the optimizer's groups (and betas) also when resuming in the compressed stage."""
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            self.betas = tuple(optimizer.param_groups[0]["betas"])
            self.decoupled = isinstance(optimizer, torch.optim.AdamW)
            self._group_of = {p: g for g in optimizer.param_groups for p in g["params"]}


def _flat_params(bucket) -> torch.Tensor:
    if bucket.flat_param is not None:
        return bucket.flat_param
    return torch.cat([p.detach().reshape(-1) for p in bucket.params])


@register
@dataclass(frozen=True)
class OneBitAdam(Algorithm):
    """Adam with 1-bit compressed momentum averaging after ``warmup_steps`` of plain Adam."""

    name = "onebit_adam"
    impl_class = OneBitAdamImpl
    warmup_steps: int = 100
    chunk: int = 4096
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ValueError("onebit_adam needs warmup_steps >= 1 (the frozen variance comes "
                             f"from the warm-up), got {self.warmup_steps!r}")

    def codec(self):
        return OneBitCodec(self.chunk)
