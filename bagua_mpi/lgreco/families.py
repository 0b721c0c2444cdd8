"""Compressor families with a discrete per-layer parameter, as L-GreCo searches them.

A family gives, for a layer of shape ``shape`` with accumulated gradient G and candidate
levels c: ``errors(G, cs, shape)`` = [||G - Q^-1 Q_c(G)||^2 for c in cs] (no error feedback in
this measurement), computed in one pass for all candidates, and ``size(shape, c)``: bytes the
layer's payload takes (``shape`` may be a plain element count where the shape does not matter).
Search spaces around the default D: bits in [D/2, 2D] step 1 (clipped to 1..8); density in
[D/10, 10D] step D/10 (clipped to 1); PowerSGD rank in [D/2, 2D] step 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import numba_kernels as nk

from ..primitives.codecs import MinMaxCodec, fit_kernel_threads
from ..primitives.lowrank import initial_q, orthonormalize
from ..primitives.sparse import topk_count


def numel(shape) -> int:
    if isinstance(shape, (int, np.integer)):
        return int(shape)
    return int(np.prod(shape, dtype=np.int64))


def matrix_shape(shape) -> tuple[int, int]:
    """The (rows, cols) view PowerSGD takes of a tensor: first dimension by the rest."""
    if isinstance(shape, (int, np.integer)) or len(shape) < 2:
        return numel(shape), 1
    return int(shape[0]), numel(shape) // int(shape[0])


@dataclass(frozen=True)
class MinMaxBits:
    """Per-chunk min-max quantization; the level is the number of bits (1..8)."""

    default: int = 4
    chunk: int = 1024
    name = "minmax"

    def candidates(self) -> list[int]:
        lo, hi = max(1, self.default // 2), min(8, 2 * self.default)
        return list(range(lo, hi + 1))

    def size(self, shape, bits: int) -> int:
        return nk.MinMaxFormat(numel(shape), bits, self.chunk).nbytes

    def errors(self, g: np.ndarray, levels, shape=None) -> np.ndarray:
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

    def size(self, shape, density: float) -> int:
        n = numel(shape)
        return nk.TopKFormat(n, topk_count(n, density)).nbytes

    def errors(self, g: np.ndarray, levels, shape=None) -> np.ndarray:
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


@dataclass(frozen=True)
class PowerSGDRank:
    """PowerSGD low-rank compression; the level is the rank r of a layer's (rows, cols) view.

    A layer is compressed at rank r only when (rows + cols) r < rows cols; otherwise (biases,
    norms, thin matrices) it goes dense at every level, which the DP sees as zero error at the
    dense size.
    """

    default: int = 4
    seed: int = 0
    name = "powersgd"

    def candidates(self) -> list[int]:
        return list(range(max(1, self.default // 2), 2 * self.default + 1))

    @staticmethod
    def compressed(shape, rank: int) -> bool:
        rows, cols = matrix_shape(shape)
        return rank <= min(rows, cols) and (rows + cols) * rank < rows * cols

    def size(self, shape, rank: int) -> int:
        rows, cols = matrix_shape(shape)
        return 4 * ((rows + cols) * rank if self.compressed(shape, rank) else rows * cols)

    def errors(self, g: np.ndarray, levels, shape=None) -> np.ndarray:
        """One power iteration per rank, from the seeded start PowerSGD itself uses.

        With P^ the orthonormalised G Q0 (``orthonormalize``, the compressor's own
        Gram-Schmidt, keeps its first r columns the same for every r <= R), the rank-r
        approximation is P^_r P^_r^T G and its error is ||G||^2 - ||P^_r^T G||^2: one product
        G^T P^ serves every candidate rank.
        """
        shape = g.size if shape is None else shape
        rows, cols = matrix_shape(shape)
        m = g.astype(np.float64).reshape(rows, cols)
        total = float(np.square(m).sum())
        usable = [r for r in levels if self.compressed(shape, r)]
        kept = np.zeros(max(usable, default=0) + 1)
        if usable:
            q0 = initial_q(cols, max(usable), self.seed).numpy().astype(np.float64)
            basis = orthonormalize(m @ q0)
            kept[1:] = np.cumsum(np.square(m.T @ basis).sum(axis=0))
        return np.array([max(total - kept[r], 0.0) if self.compressed(shape, r) else 0.0
                         for r in levels])


FAMILIES = {"minmax": MinMaxBits, "topk": TopKDensity, "powersgd": PowerSGDRank}
