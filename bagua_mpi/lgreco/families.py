"""Compressor families with a discrete per-layer parameter, as L-GreCo searches them (SPEC §6).

A family gives, for a layer's accumulated gradient G and candidate levels c:
``errors(G, cs)`` = [||G - Q^-1 Q_c(G)||^2 for c in cs] (no error feedback in this measurement),
computed in one pass for all candidates, and
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

    def errors(self, g: np.ndarray, levels) -> np.ndarray:
        """error(g, b) for every b in ``levels``: one fused pass over g (no payloads made)."""
        fit_kernel_threads()
        return nk.minmax_errors(g, [int(b) for b in levels], chunk=self.chunk)

    def error(self, g: np.ndarray, bits: int) -> float:
        return float(self.errors(g, [bits])[0])

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

    def errors(self, g: np.ndarray, levels) -> np.ndarray:
        """error(g, d) for every density d in ``levels``: the energy top-k leaves out.

        Only the largest max-k squares need an order, so one partition plus a sort of
        those (O(n + k log k)) serves every candidate.
        """
        ks = np.array([topk_count(g.size, d) for d in levels], dtype=np.int64)
        sq = np.square(g.astype(np.float64).reshape(-1))
        kmax = int(ks.max(initial=0))
        split = np.partition(sq, sq.size - kmax) if kmax else sq
        below = float(split[:sq.size - kmax].sum())  # never kept by any candidate
        top = np.concatenate([[0.0], np.cumsum(np.sort(split[sq.size - kmax:]))])
        return below + top[kmax - ks]  # plus the kmax - k smallest of the top kmax

    def error(self, g: np.ndarray, density: float) -> float:
        return float(self.errors(g, [density])[0])


FAMILIES = {"minmax": MinMaxBits, "topk": TopKDensity}
