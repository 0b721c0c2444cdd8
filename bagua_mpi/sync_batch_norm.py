"""``SyncBatchNorm`` (Horovod's ``hvd.SyncBatchNorm``): batch statistics over all ranks.

In training mode each rank computes the count, sum and sum of squares of its batch per
channel; one differentiable ``allreduce`` (Sum) of the three gives the global mean and biased
variance, which normalise the local batch. The allreduce's backward is the allreduce of the
gradient, so gradients match ``torch.nn.BatchNorm`` applied to the concatenation of every
rank's batch (loss summed over ranks). Running statistics use the unbiased global variance.
Evaluation mode, or a single rank, is plain batch norm. Ranks may have different batch sizes.
"""
from __future__ import annotations

import torch

from torch.nn.modules.batchnorm import _BatchNorm

from . import collectives, runtime
from .ops import Sum


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` that synchronises statistics over ranks
    (of ``process_set``: every member must call forward the same number of times)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        ps = self.process_set or collectives.global_process_set
        if not self.training or runtime.size() == 1:
            return super().forward(input)
        if self.momentum is None:
            raise ValueError("SyncBatchNorm needs a numeric momentum")
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        x = input if input.dtype == torch.float64 else input.float()
        count = torch.full((1,), float(input.numel() // c), dtype=x.dtype, device=input.device)
        stats = torch.cat([count, x.sum(dims), (x * x).sum(dims)])
        total = collectives.allreduce(stats, op=Sum, process_set=ps)
        n = total[0]
        if n.item() <= 1:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel over all "
                             f"ranks, got input of size {tuple(input.shape)}")
        mean = total[1:1 + c] / n
        var = (total[1 + c:] / n - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1
                unbiased = var * (n / (n - 1))
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean.detach()
                                                               .to(self.running_mean.dtype))
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * unbiased.detach()
                                                              .to(self.running_var.dtype))
        shape = [1, c] + [1] * (input.dim() - 2)
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y.to(input.dtype)


