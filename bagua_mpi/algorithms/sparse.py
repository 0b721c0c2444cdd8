"""Top-k S-SGD and gTop-k S-SGD (SPEC §5): sparse gradients with residuals.

Per bucket, each rank keeps a residual (error feedback): the gradient is added to it, the k =
``density`` x numel largest-magnitude entries are sent, and what is not applied stays for later
steps. ``topk`` all-gathers every rank's pairs (O(kP)); ``gtopk`` reduces them with the
gTopKAllReduce tree (O(k log P)) and returns dropped pairs to their residuals. An optional
``warmup_steps`` of dense allreduce precedes sparsification (the paper's warm-up). Hierarchical
communication does not apply (the tree already is the hierarchy): it runs over all ranks.
Residuals live where the gradients do; with CUDA tensors and a CUDA-aware MPI, gTop-k's
payloads stay on the device (Top-k's all-gather stages through host memory).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import collectives
from ..ops import Sum
from ..primitives.sparse import gtopk_allreduce_, topk_allgather_, topk_count
from .base import Algorithm, AlgorithmImpl
from .registry import register


class SparseImpl(AlgorithmImpl):
    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.step = 0
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}
        self.reduce = gtopk_allreduce_ if algorithm.tree else topk_allgather_

    def init_buckets(self, buckets) -> None:
        super().init_buckets(buckets)
        for bucket in buckets:
            for j, t in enumerate(bucket.communication_tensors()):
                self.residuals.setdefault((bucket.index, j), torch.zeros(
                    t.numel(), dtype=torch.float32, device=t.device))

    def on_step_start(self, step: int) -> None:
        self.step = step

    def reduce_bucket(self, bucket, step: int) -> None:
        ctx = self.ctx
        dense = step < self.algorithm.warmup_steps
        for j, grad in enumerate(bucket.communication_tensors()):
            if dense:
                collectives.allreduce_(grad, Sum, prescale_factor=ctx.prescale,
                                       postscale_factor=ctx.postscale, check=False)
                self.wire.allreduce(grad.numel() * grad.element_size(), ctx.topo.size)
                continue
            flat = grad.reshape(-1)
            work = flat if flat.dtype == torch.float32 and flat.is_contiguous() \
                else flat.float().contiguous()
            self.reduce(work, ctx.topo.comm, topk_count(work.numel(), self.algorithm.density),
                        self.residuals[(bucket.index, j)], scale=ctx.prescale * ctx.postscale,
                        index_dtype=self.algorithm.index_dtype, stats=self.wire)
            if work is not flat:
                flat.copy_(work)

    def state_dict(self) -> dict:
        return {"step": self.step,
                "residuals": {f"{b}.{j}": r.clone() for (b, j), r in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state.get("step", 0))
        for key, value in state.get("residuals", {}).items():
            b, j = (int(v) for v in key.split("."))
            if (b, j) not in self.residuals or self.residuals[(b, j)].shape != value.shape:
                raise ValueError(f"checkpoint residual {key} of shape {tuple(value.shape)} does "
                                 f"not match this model's buckets")
            self.residuals[(b, j)].copy_(value)


@dataclass(frozen=True)
class _Sparse(Algorithm):
    density: float = 0.001
    warmup_steps: int = 0
    index_dtype: str = "int32"

    def __post_init__(self):
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if self.index_dtype not in ("int32", "int64"):
            raise ValueError(f"index_dtype must be 'int32' or 'int64', got {self.index_dtype!r}")


@register
@dataclass(frozen=True)
class TopK(_Sparse):
    """Top-k S-SGD: local top-k with residuals, all-gathered (O(kP))."""

    name = "topk"
    impl_class = SparseImpl
    tree = False


@register
@dataclass(frozen=True)
class GTopK(_Sparse):
    """gTop-k S-SGD: local top-k with residuals, gTopKAllReduce tree (O(k log P))."""

    name = "gtopk"
    impl_class = SparseImpl
    tree = True
