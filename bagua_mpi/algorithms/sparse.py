"""Top-k S-SGD and gTop-k S-SGD: sparse gradients with residuals.

Per bucket, each rank keeps a residual (error feedback): the gradient is added to it, the k =
``density`` x numel largest-magnitude entries are sent, and what is not applied stays for later
steps. ``topk`` all-gathers every rank's pairs (O(kP)); ``gtopk`` reduces them with the
gTopKAllReduce tree (O(k log P)) and returns dropped pairs to their residuals. An optional
``warmup_steps`` of dense allreduce precedes sparsification (the paper's warm-up). With
``hierarchical=True`` the node leaders sparsify their node's summed gradient (the framework's
two-level form). A flattened bucket's exchange is planned once and kept across steps
(``AlgorithmImpl.kept_plan``).
Residuals live where the gradients do; with CUDA tensors both keep selection, merges and
decoding on the device, and MPI moves device payloads (CUDA-aware) or staged payloads only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..primitives.sparse import GTopKExchange, SparseSegment, TopKExchange, topk_count
from .base import Algorithm, AlgorithmImpl
from .registry import register
from .forms import float32, float32_flat
from .validation import fraction, non_negative_int, one_of


class SparseImpl(AlgorithmImpl):
    def residual(self, segments, device) -> torch.Tensor:
        """Error feedback of a communicated tensor: a float32 vector on the gradients' device."""
        return self.tensor_state("residual", segments, device=device).data

    def init_tensor(self, segments, device) -> None:
        self.residual(segments, device)

    def reduce_bucket(self, bucket, step: int) -> None:
        """The bucket's flat gradient sparsified with its residual and exchanged, planned once
        and kept across steps (``kept_plan``: the checks and the views of the gradient and the
        residual). Without flattening, each gradient on its own (``reduce_tensor``)."""
        if bucket.flat_grad is None:
            super().reduce_bucket(bucket, step)
            return
        with float32_flat(bucket) as grad:
            exchange = self.kept_plan(bucket, grad, lambda: self.plan(
                grad, self.residual(bucket.segments(), grad.device)))
            exchange.run(self.transport, scale=self.scale, stats=self.wire)

    def plan(self, grad: torch.Tensor, residual: torch.Tensor):
        """gTop-k's tree (``GTopKExchange``) or Top-k's all-gather (``TopKExchange``) of
        ``grad`` at the density's k."""
        algo = self.algorithm
        k = topk_count(grad.numel(), algo.density)
        if algo.tree:
            return GTopKExchange([SparseSegment(grad, k, residual)], algo.index_dtype)
        return TopKExchange(grad, k, residual, algo.index_dtype)

    def reduce_tensor(self, grad, segments, step: int) -> None:
        residual = self.residual(segments, grad.device)
        # where the gradient lives: the exchanges keep device payloads on the device
        with float32(grad) as work:
            self.plan(work, residual).run(self.transport, scale=self.scale, stats=self.wire)


@dataclass(frozen=True)
class _Sparse(Algorithm):
    dense_warmup = True
    density: float = 0.001
    warmup_steps: int = 0
    index_dtype: str = "int32"
    validators = {"density": fraction(because="the share of each tensor's entries sent"),
                  "warmup_steps": non_negative_int(),
                  "index_dtype": one_of(("int32", "int64"),
                                        because="the wire's index words")}


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
