"""``SyncBatchNorm`` (Horovod's ``hvd.SyncBatchNorm``): batch statistics over all ranks.

In training mode each rank computes its batch's count, mean and biased variance per channel
(``torch.var_mean``, which subtracts the mean before squaring); one differentiable
``allreduce`` (Sum), in float64, of the count, count * mean and count * (variance + mean^2)
gives the global mean and biased variance, which normalise the local batch. Squares are never
summed in the input's precision: float32 sums of x^2 minus the squared mean lose every digit
of the variance when the mean is much larger than the spread (a mean of 1000 and a spread of
0.01), which torch's batch norm keeps. The allreduce's backward is the allreduce of the
gradient, so gradients match ``torch.nn.BatchNorm`` applied to the concatenation of every
rank's batch (loss summed over ranks). Running statistics use the unbiased global variance.
Evaluation mode, or a single rank, is plain batch norm. Ranks may have different batch sizes.
``momentum=None`` keeps the cumulative average, as torch's. ``convert_sync_batchnorm`` swaps a
model's batch norm layers for this class, as DDP scripts do with torch's.
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
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        x = input if input.dtype == torch.float64 else input.float()
        local = input.numel() // c
        if local:
            local_var, local_mean = torch.var_mean(x, dims, correction=0)
        else:  # zeros that keep the graph: every rank must run the allreduce's backward
            local_var = local_mean = x.sum(dims)
        wide_mean = local_mean.double()
        count = torch.full((1,), float(local), dtype=torch.float64, device=input.device)
        stats = torch.cat([count, local * wide_mean,
                           local * (local_var.double() + wide_mean * wide_mean)])
        total = collectives.allreduce(stats, op=Sum, process_set=ps)
        n = total[0]
        # the total is at least this rank's count, so only a rank with one value or none
        # reads it (on a GPU, reading it waits for the device); when the total is 1 every
        # rank has one value or none, so every rank reads it and raises alike
        if local <= 1 and n.item() <= 1:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel over all "
                             f"ranks, got input of size {tuple(input.shape)}")
        wide_mean = total[1:1 + c] / n
        wide_var = (total[1 + c:] / n - wide_mean * wide_mean).clamp_min(0)
        mean, var = wide_mean.to(x.dtype), wide_var.to(x.dtype)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1
                # momentum None: the cumulative average over the batches seen, as torch's
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                          else self.momentum)
                unbiased = wide_var * (n / (n - 1))
                self.running_mean.mul_(1 - factor).add_(factor * wide_mean.detach()
                                                        .to(self.running_mean.dtype))
                self.running_var.mul_(1 - factor).add_(factor * unbiased.detach()
                                                       .to(self.running_var.dtype))
        shape = [1, c] + [1] * (input.dim() - 2)
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y.to(input.dtype)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_set=None) -> torch.nn.Module:
        """``module`` with every batch norm layer (``BatchNorm1d/2d/3d``, and torch's own
        ``SyncBatchNorm``, which without ``torch.distributed``'s default group normalizes each
        rank's batch alone, silently) replaced by this class, as
        ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does for DDP. The new layers hold
        the same parameter tensors (an optimizer built before still trains them) and the same
        running-statistics buffers; the mode (train or eval) carries over. Returns the
        converted module (a new object when ``module`` itself is a batch norm layer)."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_set=process_set)
            if module.affine:
                converted.weight, converted.bias = module.weight, module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return converted
