"""Compressor families with a discrete per-layer parameter, as L-GreCo searches them (SPEC §6).

A family gives, for a layer's accumulated gradient G and a candidate level c:
``error(G, c) = ||G - Q^-1 Q_c(G)||^2`` (no error feedback in this measurement), and
``size(n, c)``: bytes the layer's payload takes. Search spaces around the default D:
bits in [D/2, 2D] step 1 (clipped to 1..8); density in [D/10, 10D] step D/10 (clipped to 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import numba_kernels as nk

from ..primitives.codecs import MinMaxCodec, fit_kernel_threads
from ..primitives.sparse import topk_count


@dataclass(frozen=True)
class MinMaxBits:
    """Per-chunk min-max quantization; the level is the number of bits (1..8)."""

    default: int = 4
    chunk: int = 1024
    name = "minmax"

    def candidates(self) -> list[int]:
        lo, hi = max(1, self.default // 2), min(8, 2 * self.default)
        return list(range(lo, hi + 1))

    def size(self, n: int, bits: int) -> int:
        return nk.MinMaxFormat(n, bits, self.chunk).nbytes

    def error(self, g: np.ndarray, bits: int) -> float:
        fit_kernel_threads()
        payload = nk.compress_minmax(g, bits=bits, chunk=self.chunk)
        return float(np.sum((g - nk.decompress(payload)).astype(np.float64) ** 2))

    def codec(self, bits: int) -> MinMaxCodec:
        return MinMaxCodec(bits, self.chunk)


@dataclass(frozen=True)
class TopKDensity:
    """Top-k sparsification; the level is the density k / n."""

    default: float = 0.01
    name = "topk"

    def candidates(self) -> list[float]:
        return [d for d in (self.default * i / 10 for i in range(1, 101)) if d <= 1.0]

    def size(self, n: int, density: float) -> int:
        return nk.TopKFormat(n, topk_count(n, density)).nbytes

    def error(self, g: np.ndarray, density: float) -> float:
        k = topk_count(g.size, density)
        sq = np.sort(np.square(g.astype(np.float64)))
        return float(sq[:g.size - k].sum())  # what top-k leaves out


FAMILIES = {"minmax": MinMaxBits, "topk": TopKDensity}
