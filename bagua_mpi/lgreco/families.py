"""Compressor families with a discrete per-layer parameter, as L-GreCo searches them.

A family gives, for a layer of shape ``shape`` with accumulated gradient G and candidate
levels c: ``errors(G, cs, shape)`` = [||G - Q^-1 Q_c(G)||^2 for c in cs] (no error feedback in
this measurement), computed in one pass for all candidates, and ``size(shape, c)``: bytes the
layer's payload takes (``shape`` may be a plain element count where the shape does not matter).
Search spaces around the default D: bits in [D/2, 2D] step 1 (clipped to 1..8); density in
[D/10, 10D] step D/10 (clipped to 1); PowerSGD rank in [D/2, 2D] step 1.

A family also runs its side of the exchange, for the L-GreCo impl ``impl`` (whose ``state``,
``layers`` = {name: (index, parameter)}, ``assignment`` = {name: level}, ``comm``, ``scale``
and ``wire`` it uses): ``init_layer(impl, name)`` allocates a layer's state (error feedback,
residual, Q; keyed by the parameter's name), ``exchange_(impl, bucket, grads, transport,
step)`` synchronizes a bucket's float32 layer gradients (``forms.float32_layers``) in one packed
exchange, each layer at its level, and ``level_type`` is the type of its levels (what a
checkpoint's levels are cast to).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

import numba_kernels as nk

from ..buffers import FusedTensors
from ..primitives.codecs import MinMaxCodec, fit_kernel_threads
from ..primitives.lowprec import CompressedExchange, Segment, padded_length, partition_length
from ..primitives.lowrank import (LowRankExchange, LowRankSegment, initial_q, orthonormalize,
                                  prepare_host_route)
from ..primitives.sparse import GTopKExchange, SparseSegment, index_dtype_for, topk_count


def numel(shape) -> int:
    """Elements of a tensor of ``shape`` (a shape, or an element count). ``math.prod`` of
    Python ints: NumPy's ``prod`` cost some 7 us a call, and the exchanges ask per layer and
    step."""
    if isinstance(shape, (int, np.integer)):
        return int(shape)
    return math.prod(int(d) for d in shape)


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
    level_type = int

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

    @functools.lru_cache(maxsize=16)   # asked per layer and step; there are 8 widths
    def codec(self, bits: int) -> MinMaxCodec:
        return MinMaxCodec(bits, self.chunk)

    # -- the exchange ---------------------------------------------------------------------------
    def layer_errors(self, impl, name: str):
        """(worker error, server error) of layer ``name``, or (None, None) without error
        feedback. Their sizes depend only on the layer's, so they carry over level changes.
        A bucket's layers keep each kind end to end in one memory, so that its exchange runs
        each step of all of them in one launch on a GPU (``lowprec._Together``)."""
        if not impl.algorithm.error_feedback:
            return None, None
        made = impl.state.made("worker_error", name), impl.state.made("server_error", name)
        if made[0] is not None and made[1] is not None:   # every step but the first
            return made
        p, n = impl.layers[name][1], impl.comm.Get_size()
        bucket = impl.layer_bucket[name]

        def lengths(length_of):   # the bucket's layers' lengths, asked once per memory
            return lambda: {member: length_of(impl.layers[member][1].numel(), n)
                            for member in impl.bucket_names[bucket]}
        return (impl.state.tensor_in_group("worker_error", name, (bucket, n),
                                           lengths(padded_length), p.device),
                impl.state.tensor_in_group("server_error", name, (bucket, n),
                                           lengths(partition_length), p.device))

    def init_layer(self, impl, name: str) -> None:
        self.layer_errors(impl, name)

    def exchange_(self, impl, bucket, grads, transport, step: int) -> None:
        """One C_LP_S for all the layers (one alltoall and one allgather), each layer at its
        bits; planned once an assignment (``kept_plan``)."""
        exchange = impl.kept_plan(bucket, grads, lambda: self.plan(impl, bucket, grads),
                                  impl.assignment)
        exchange.run(transport, scale=impl.scale, stats=impl.wire)

    def plan(self, impl, bucket, grads) -> CompressedExchange:
        """The bucket's C_LP_S, each layer with its bits' codec and its error memories.
        Min-max rounds deterministically: no layer needs a random stream, so none is seeded."""
        return CompressedExchange(
            [Segment(g, self.codec(int(impl.assignment[name])), *self.layer_errors(impl, name))
             for name, g in zip(bucket.names, grads)], impl.comm.Get_size())


@dataclass(frozen=True)
class TopKDensity:
    """Top-k sparsification; the level is the density k / n."""

    default: float = 0.01
    name = "topk"
    level_type = float

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

    # -- the exchange ---------------------------------------------------------------------------
    def residual(self, impl, name: str) -> torch.Tensor:
        """What top-k left out of layer ``name``'s gradients so far (error feedback). A
        bucket's residuals lie end to end in one memory, so that its exchange selects and
        decodes all its layers at once (one launch each on a GPU, ``GTopKExchange``).
        """
        p, bucket = impl.layers[name][1], impl.layer_bucket[name]
        return impl.state.tensor_in_group(
            "residual", name, (bucket,),
            lambda: {member: impl.layers[member][1].numel()
                     for member in impl.bucket_names[bucket]}, p.device)

    def init_layer(self, impl, name: str) -> None:
        self.residual(impl, name)

    def exchange_(self, impl, bucket, grads, transport, step: int) -> None:
        """One gTopKAllReduce for all the layers (one tree and one broadcast), each layer at
        its density, with its residual; each step of it for all the layers at once; planned
        once an assignment (``kept_plan``)."""
        exchange = impl.kept_plan(bucket, grads, lambda: self.plan(impl, bucket, grads),
                                  impl.assignment)
        exchange.run(transport, scale=impl.scale, stats=impl.wire)

    def plan(self, impl, bucket, grads) -> GTopKExchange:
        """The bucket's gTopKAllReduce, each layer with its density's k and its residual, the
        indices int64 only where a layer needs them (2^31 elements or more)."""
        return GTopKExchange(
            [SparseSegment(g, topk_count(g.numel(), impl.assignment[name]),
                           self.residual(impl, name)) for name, g in zip(bucket.names, grads)],
            index_dtype_for([g.numel() for g in grads]))


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
    level_type = int

    def candidates(self) -> list[int]:
        return list(range(max(1, self.default // 2), 2 * self.default + 1))

    @staticmethod
    def compressed(shape, rank: int) -> bool:
        rows, cols = matrix_shape(shape)
        return rank <= min(rows, cols) and (rows + cols) * rank < rows * cols

    @functools.lru_cache(maxsize=1024)   # asked per layer and step; a model has few shapes
    def compressible(self, shape: tuple) -> bool:
        """Whether some candidate rank compresses a layer of ``shape``."""
        return any(self.compressed(shape, r) for r in self.candidates())

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

    # -- the exchange ---------------------------------------------------------------------------
    def low_rank(self, impl, name: str):
        """(Q at the largest candidate rank, error memory or None) of layer ``name``, or None
        when no candidate rank compresses it. Q starts from the seeded ``initial_q`` (the same
        on every rank); a smaller rank uses, and warm-starts, its first columns. The Q's of a
        bucket's layers of one shape lie end to end in one memory, and so do their error
        memories, so that the layers of one shape at one rank take their products as one
        batch (``LowRankExchange``)."""
        q, error = impl.state.made("q", name), impl.state.made("error", name)
        if q is not None and (error is not None or not impl.algorithm.error_feedback):
            return q, error   # every step but the first
        index, p = impl.layers[name]
        if not self.compressible(tuple(p.shape)):
            return None
        rows, cols = matrix_shape(p.shape)
        width = min(max(self.candidates()), rows, cols)
        bucket = impl.layer_bucket[name]
        group = (bucket, rows, cols)

        def members(length):   # the bucket's layers of this shape, asked once per memory
            return lambda: {member: length for member in impl.bucket_names[bucket]
                            if matrix_shape(impl.layers[member][1].shape) == (rows, cols)}
        q = impl.state.tensor_in_group(
            "q", name, group, members(cols * width), p.device, shape=(cols, width),
            initial=lambda: initial_q(cols, width, self.seed + index))
        error = (impl.state.tensor_in_group("error", name, group, members(rows * cols),
                                            p.device)
                 if impl.algorithm.error_feedback else None)
        return q, error

    def init_layer(self, impl, name: str) -> None:
        if self.low_rank(impl, name) is not None and not impl.layers[name][1].is_cuda:
            prepare_host_route()

    def exchange_(self, impl, bucket, grads, transport, step: int) -> None:
        """PowerSGD for the layers that compress at their rank (one P and one Q allreduce for
        all of them), one dense allreduce for the rest; planned once an assignment
        (``kept_plan``)."""
        dense, low_rank = impl.kept_plan(bucket, grads,
                                         lambda: self.plan(impl, bucket, grads), impl.assignment)
        low_rank.run(transport, scale=impl.scale, stats=impl.wire)
        impl.dense_allreduce_(dense)

    def plan(self, impl, bucket, grads) -> tuple[FusedTensors, LowRankExchange]:
        """The bucket's dense gradients (layers that do not compress at their rank; summed as
        one message), and the ``LowRankExchange`` of the others."""
        low, dense = [], []
        for name, g in zip(bucket.names, grads):
            rank = int(impl.assignment[name])
            shape = impl.layers[name][1].shape
            state = self.low_rank(impl, name)
            if state is not None and self.compressed(shape, rank):
                low.append(LowRankSegment(g, matrix_shape(shape)[0], rank, *state))
            else:
                dense.append(g)
        return FusedTensors(dense), LowRankExchange(low)


FAMILIES = {"minmax": MinMaxBits, "topk": TopKDensity, "powersgd": PowerSGDRank}
