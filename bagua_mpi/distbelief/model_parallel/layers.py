"""Layers that can be cut within themselves: each partition computes a block of output units.

A *block layer* tells the partitioner four things: ``units`` (output units along ``unit_dim``),
``in_units`` (input units along the same dim), ``needs(a, b)`` (the input units the outputs
``[a, b)`` read: their receptive fields) and ``block(a, b)`` (a module owning a copy of the
parameters of outputs ``[a, b)`` that computes them from the input units ``needs(a, b)``).

* ``LocallyConnected2d``: the paper's favourite case (§3, Figure 1): like a convolution, but
  every output position has its own filter (no weight sharing). Units are output *rows*; a
  block of rows needs only the input rows under its filters, so the cut costs a halo of
  ``kernel_size - stride`` rows per neighbour.
* ``LinearBlocks(nn.Linear)``: a fully connected layer cut into blocks of output features;
  every block needs every input feature, so its cut costs the whole input.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PartitionError


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _locally_connected(x, weight, bias, k: int, s: int):
    """Output rows from input rows:
    ``out[n, o, h, w] = sum_(c,i,j) W[h, w, o, (c,i,j)] x[n, c, h*s + i, w*s + j]``."""
    n = x.shape[0]
    h, w, _, ckk = weight.shape
    cols = F.unfold(x, (k, k), stride=s)  # (n, c*k*k, h*w): the receptive field of each output
    cols = cols.view(n, ckk, h, w)
    out = torch.einsum("nkhw,hwok->nohw", cols, weight)
    return out + bias if bias is not None else out


class LocallyConnected2d(nn.Module):
    """Untied 2-d convolution without padding: input ``(N, C_in, H, W)`` -> ``(N, C_out, H', W')``.

    ``H' = (H - k) // stride + 1``. Parameters: ``weight (H', W', C_out, C_in*k*k)`` and
    ``bias (C_out, H', W')``, initialized like ``nn.Conv2d`` (uniform in +-1/sqrt(fan_in)).
    """

    unit_dim = 2

    def __init__(self, in_channels: int, out_channels: int, in_size, kernel_size: int,
                 stride: int = 1, bias: bool = True):
        super().__init__()
        self.in_channels = _positive("in_channels", in_channels)
        self.out_channels = _positive("out_channels", out_channels)
        self.k = _positive("kernel_size", kernel_size)
        self.s = _positive("stride", stride)
        self.in_h, self.in_w = (int(v) for v in in_size)
        if self.in_h < self.k or self.in_w < self.k:
            raise ValueError(f"input {self.in_h}x{self.in_w} is smaller than the kernel {self.k}")
        self.out_h = (self.in_h - self.k) // self.s + 1
        self.out_w = (self.in_w - self.k) // self.s + 1
        fan_in = in_channels * self.k * self.k
        bound = 1.0 / math.sqrt(fan_in)
        self.weight = nn.Parameter(torch.empty(self.out_h, self.out_w, out_channels, fan_in
                                               ).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_channels, self.out_h, self.out_w
                                             ).uniform_(-bound, bound)) if bias else None

    @property
    def units(self) -> int:
        return self.out_h

    @property
    def in_units(self) -> int:
        return self.in_h

    def needs(self, a: int, b: int) -> tuple[int, int]:
        return a * self.s, (b - 1) * self.s + self.k

    def forward(self, x):
        return _locally_connected(x, self.weight, self.bias, self.k, self.s)

    def block(self, a: int, b: int) -> "LocallyConnectedRows":
        return LocallyConnectedRows(self, a, b)

    def macs(self, a: int, b: int, batch: int) -> int:
        """Multiply-adds of output rows ``[a, b)`` for a batch."""
        return batch * (b - a) * self.out_w * self.out_channels * self.weight.shape[-1]


class LocallyConnectedRows(nn.Module):
    """Output rows ``[a, b)`` of a ``LocallyConnected2d`` (own copy of their parameters)."""

    def __init__(self, full: LocallyConnected2d, a: int, b: int):
        super().__init__()
        if not 0 <= a < b <= full.out_h:
            raise PartitionError(f"rows [{a}, {b}) outside the layer's {full.out_h} output rows")
        self.k, self.s = full.k, full.s
        self.weight = nn.Parameter(full.weight.detach()[a:b].clone())
        self.bias = (nn.Parameter(full.bias.detach()[:, a:b].clone())
                     if full.bias is not None else None)

    def forward(self, x_rows):
        return _locally_connected(x_rows, self.weight, self.bias, self.k, self.s)


class LinearBlocks(nn.Module):
    """A fully connected layer (``nn.Linear``) cut into blocks of output features.

    ``LinearBlocks(nn.Linear(...))`` behaves as the linear layer itself; a partition's block
    needs all the input features, so its halo is the whole input.
    """

    unit_dim = 1

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"LinearBlocks wraps an nn.Linear, got {type(linear).__name__}")
        self.linear = linear

    @property
    def units(self) -> int:
        return self.linear.out_features

    @property
    def in_units(self) -> int:
        return self.linear.in_features

    def needs(self, a: int, b: int) -> tuple[int, int]:
        return 0, self.linear.in_features

    def forward(self, x):
        return self.linear(x)

    def block(self, a: int, b: int) -> nn.Linear:
        w = self.linear.weight
        out = nn.Linear(self.linear.in_features, b - a, bias=self.linear.bias is not None,
                        dtype=w.dtype, device=w.device)
        with torch.no_grad():
            out.weight.copy_(self.linear.weight[a:b])
            if out.bias is not None:
                out.bias.copy_(self.linear.bias[a:b])
        return out

    def macs(self, a: int, b: int, batch: int) -> int:
        return batch * (b - a) * self.linear.in_features


def is_block_layer(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("units", "in_units", "needs", "block",
                                                  "unit_dim"))
