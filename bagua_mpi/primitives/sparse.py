"""Sparse allreduces of top-k (index, value) payloads (the gTop-k paper, arXiv 1901.04359).

Both start the same way on each rank, for a flat float32 gradient g and residual r:
``r <- r + g``; select the k largest |r| (ties: lower index); the payload holds those k
(index, value) pairs; r keeps every unselected entry (fused in ``numba_kernels.compress_topk`` /
``compress_topk_segments``).

* ``topk_allgather_`` (Top-k S-SGD): all-gather every rank's k pairs and scatter-add them all:
  each rank sends its k pairs to P-1 others, O(kP) traffic.
* ``gtopk_allreduce_`` (gTopKAllReduce): a binomial tree towards rank 0 in ceil(log2 P)
  rounds, for any P: in round j (mask = 2^j) a rank whose bit j is set sends its current k
  pairs to rank - mask and leaves; the receiver merges them into its own (summing equal
  indices, ``merge_topk``) and keeps the top-k of the merge. Rank 0 ends with the global
  top-k and broadcasts it (a binomial broadcast of point-to-point sends, log2 P rounds; each
  byte crosses P - 1 edges, half of Top-k's P(P - 1)k pairs on a shared link at P = 4). Per
  rank: O(k log P). At P = 2 the two ranks swap payloads and both merge (one hop instead of
  two). Afterwards each rank puts back into r the pairs it sent whose index did not make the
  global set (``restore_unselected``), as the paper does.

The result (``flat``) is the scatter of the global pairs, times ``scale`` (1/P to average);
the scale is applied to the k values before scattering, not to the n-element result.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

import numba_kernels as nk

from .. import transport
from ..accounting import WireStats
from . import device_arrays
from .codecs import fit_kernel_threads

_TAG = 7401


def topk_count(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` elements at ``density`` (at least 1 of a non-empty tensor)."""
    return min(numel, max(1, int(round(density * numel)))) if numel else 0


def index_dtype_for(lengths) -> str:
    """The narrowest payload index dtype for segments of ``lengths`` elements: int32, or int64
    where one has 2^31 elements or more (an embedding table on a large GPU)."""
    return "int64" if max(lengths, default=0) > np.iinfo(np.int32).max else "int32"


@dataclass
class SparseSegment:
    """One tensor of a packed gTop-k exchange: a contiguous 1-D float32 ``flat`` (host or
    CUDA), its own k, and its residual (float32, same shape)."""

    flat: torch.Tensor
    k: int
    residual: torch.Tensor


def topk_allgather_(flat: torch.Tensor, comm: MPI.Intracomm, k: int, residual: torch.Tensor, *,
                    scale: float = 1.0, index_dtype: str = "int32",
                    stats: WireStats | None = None) -> torch.Tensor:
    """Top-k S-SGD aggregation in place (see the module docstring).

    Contiguous float32 CUDA tensors (flat and residual) stay on the device: selection,
    scaling and the scatter-add run as the CUDA kernels, and only the k-pair payloads move
    (NCCL or a CUDA-aware MPI on the device buffers, else reused pinned host buffers). One call
    plans the exchange and runs it once (``TopKExchange``, which a caller keeps to run it
    every step)."""
    TopKExchange(flat, k, residual, index_dtype).run(comm, scale=scale, stats=stats)
    return flat


class TopKExchange:
    """Top-k S-SGD's all-gather of one tensor: planned once (the checks and the views of the
    tensor and its residual: a view of a CUDA tensor costs some 24 us of host time), run
    every step. It holds views of the two: a caller that keeps it across steps makes a new
    one when they move (``topk`` keeps one a bucket: ``AlgorithmImpl.kept_plan``)."""

    def __init__(self, flat: torch.Tensor, k: int, residual: torch.Tensor,
                 index_dtype: str = "int32"):
        _check_segment(SparseSegment(flat, k, residual))
        if flat.is_cuda != residual.is_cuda:
            raise ValueError(f"flat and residual must live together, got {flat.device} and "
                             f"{residual.device}")
        self.device, self.k, self.index_dtype = flat.is_cuda, k, index_dtype
        self.x, self.residual = device_arrays.array_of(flat), device_arrays.array_of(residual)

    def run(self, comm, *, scale: float = 1.0, stats: WireStats | None = None) -> None:
        if not self.device:
            fit_kernel_threads()
        _topk_arrays(self.x, self.residual, self.k, comm, scale, self.index_dtype, stats,
                     self.device)


def _topk_arrays(x, res, k: int, comm, scale: float, index_dtype: str,
                 stats: WireStats | None, device: bool) -> None:
    """Top-k all-gather on 1-D float32 arrays, NumPy (host) or Numba device arrays (device;
    ``NUMBA_ENABLE_CUDASIM=1`` runs this path on the CPU in the tests): the same bytes."""
    wire = transport.of(comm)
    # the payload kept from call to call too: a fresh device array per call would be a
    # cudaMalloc, and Numba's deferred cudaFree of the old ones waits for the whole device
    nbytes = nk.TopKFormat(x.size, k, index_dtype).nbytes
    mine = nk.compress_topk(x, k, index_dtype=index_dtype, residual=res,
                            out=device_arrays.kept("topk mine", nbytes, np.uint8, device))
    n = wire.size
    gathered = device_arrays.kept("topk gathered", (n, mine.nbytes), np.uint8, device)
    wire.allgather(mine.buffer, gathered)
    if scale != 1.0:  # scale the n x k values, not the whole decoded tensor
        nk.scale_topk_stack(gathered, mine.format, scale)
    nk.decompress_many(gathered, mine.format, out=x)
    if stats is not None:
        stats.add((n - 1) * mine.nbytes)


def binomial_children(rank: int, size: int) -> list[int]:
    """Ranks that ``rank`` sends to in a binomial broadcast from rank 0."""
    mask = 1
    while mask < size and not rank & mask:
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if rank + mask < size:
            children.append(rank + mask)
        mask >>= 1
    return children


def gtopk_allreduce_(flat: torch.Tensor, comm: MPI.Intracomm, k: int, residual: torch.Tensor, *,
                     scale: float = 1.0, index_dtype: str = "int32",
                     stats: WireStats | None = None) -> torch.Tensor:
    """gTopKAllReduce in place (see the module docstring)."""
    packed_gtopk_allreduce_([SparseSegment(flat, k, residual)], comm, scale=scale,
                            index_dtype=index_dtype, stats=stats)
    return flat


def packed_gtopk_allreduce_(segments: list[SparseSegment], comm: MPI.Intracomm, *,
                            scale: float = 1.0, index_dtype: str = "int32",
                            stats: WireStats | None = None) -> None:
    """gTopKAllReduce of several tensors, each with its own k, in one message per tree edge.

    Each segment is selected, merged and restored exactly as a separate ``gtopk_allreduce_``
    would do; the payloads travel concatenated, so a bucket of layers with different densities
    (L-GreCo) costs one tree and one broadcast. The segment list (sizes and k) must be the
    same on every rank.

    Each step runs for all the segments at once (``numba_kernels.topk_segments``): the tree's
    merges always, and the selection and the final decode too where the tensors share one
    storage and their residuals another (a bucket's gradients, and the residuals L-GreCo lays
    end to end); otherwise those two run a segment at a time.

    Float32 tensors on a CUDA device stay there: the kernels select, merge, restore and
    decode on the device, and ``comm`` (a communicator or a ``transport.Transport``) moves the
    payloads: NCCL send/receive or a CUDA-aware MPI on the device buffers, else reused pinned
    host buffers. Only a mix of host and device segments is staged whole.

    One call plans the exchange and runs it once (``GTopKExchange``, which a caller keeps to
    run it every step).
    """
    on_device = [t.is_cuda for seg in segments for t in (seg.flat, seg.residual)]
    if any(on_device) and not all(on_device):
        staged = [SparseSegment(seg.flat.cpu(), seg.k, seg.residual.cpu()) for seg in segments]
        packed_gtopk_allreduce_(staged, comm, scale=scale, index_dtype=index_dtype, stats=stats)
        for seg, host in zip(segments, staged):
            seg.flat.copy_(host.flat)
            seg.residual.copy_(host.residual)
        return
    GTopKExchange(segments, index_dtype).run(comm, scale=scale, stats=stats)


class GTopKExchange:
    """A packed gTopKAllReduce of a fixed list of segments: planned once, run every step.

    Planning checks the segments, finds their common memory (``_shared_bases``), views the
    arrays the kernels work on (a view of a CUDA tensor costs some 24 us of host time) and
    lays out every segment's payload in the message (``_SparsePlan``); a run then costs the
    host a few calls, none a segment. The message buffers are the thread's kept ones
    (``device_arrays.kept``), shared by every bucket in turn.

    A plan holds views of the segments' tensors and residuals: it stays right while they
    stay where they are. A caller that keeps one across steps makes a new one when they move
    (gTop-k and L-GreCo keep one a bucket: ``AlgorithmImpl.kept_plan``). Host and device segments
    together are refused: ``packed_gtopk_allreduce_`` stages such a mix whole."""

    def __init__(self, segments: list[SparseSegment], index_dtype: str = "int32"):
        for seg in segments:
            _check_segment(seg)
        on_device = [t.is_cuda for seg in segments for t in (seg.flat, seg.residual)]
        if any(on_device) and not all(on_device):
            raise ValueError(f"a gTop-k plan takes tensors all on the host or all on one "
                             f"device, got {sorted({str(seg.flat.device) for seg in segments})}"
                             f" and residuals on "
                             f"{sorted({str(seg.residual.device) for seg in segments})}")
        ks = [seg.k for seg in segments]
        bases = _shared_bases(segments)
        if bases is not None:   # two views in all
            self.plan = _SparsePlan(None, None, ks, index_dtype, bases)
        else:
            self.plan = _SparsePlan([device_arrays.array_of(seg.flat) for seg in segments],
                                    [device_arrays.array_of(seg.residual) for seg in segments],
                                    ks, index_dtype)

    def run(self, comm, *, scale: float = 1.0, stats: WireStats | None = None) -> None:
        """The module docstring's gTopKAllReduce of every segment over ``comm`` (a
        communicator or a ``transport.Transport``)."""
        if not self.plan.device:
            fit_kernel_threads()
        self.plan.run(comm, scale, stats)


@dataclass
class SparseBases:
    """Where an exchange's tensors lie in one storage and their residuals in another: the two
    base arrays (NumPy, or Numba device arrays), each tensor's and residual's first element in
    them, and the tensors' lengths."""

    x: object
    x_offsets: list
    residual: object
    residual_offsets: list
    lengths: list


def _shared_bases(segments: list[SparseSegment]) -> SparseBases | None:
    """The segments' common memory: their tensors in one storage, their residuals in another
    (a bucket's gradients, and the residuals L-GreCo lays end to end); None otherwise."""
    if len(segments) < 2:
        return None
    x = device_arrays.storage_base([seg.flat for seg in segments])
    residual = device_arrays.storage_base([seg.residual for seg in segments])
    if x is None or residual is None:
        return None
    return SparseBases(*x, *residual, [seg.flat.numel() for seg in segments])


def _check_segment(seg: SparseSegment) -> None:
    if seg.flat.dtype != torch.float32 or seg.flat.dim() != 1 or not seg.flat.is_contiguous():
        raise ValueError(f"sparse allreduces take contiguous 1-D float32 tensors, got "
                         f"{seg.flat.dtype} of shape {tuple(seg.flat.shape)}")
    if seg.residual.shape != seg.flat.shape or seg.residual.dtype != torch.float32:
        raise ValueError(f"residual must be float32 of shape {tuple(seg.flat.shape)}, got "
                         f"{seg.residual.dtype} {tuple(seg.residual.shape)}")
    if not 0 <= seg.k <= seg.flat.numel():
        raise ValueError(f"k must be in [0, {seg.flat.numel()}], got {seg.k}")


def _gtopk_arrays(flats, residuals, ks, comm, scale: float, index_dtype: str,
                  stats: WireStats | None, bases: SparseBases | None = None) -> None:
    """The gTop-k exchange on 1-D float32 arrays, planned and run once (``_SparsePlan``)."""
    _SparsePlan(flats, residuals, ks, index_dtype, bases).run(comm, scale, stats)


class _SparsePlan:
    """The gTop-k exchange on 1-D float32 arrays, all on the host (NumPy) or all on the device
    (numba device arrays; ``NUMBA_ENABLE_CUDASIM=1`` runs this path on the CPU in tests): each
    array its own base, or with ``bases`` (``flats`` and ``residuals`` then unused) all of them
    as segments of two base arrays, whose selection and decode run at once. Planned once:
    every segment's payload columns (``numba_kernels.TopKSegment``) and the groups of arrays
    the kernels run on."""

    def __init__(self, flats, residuals, ks, index_dtype: str,
                 bases: SparseBases | None = None):
        if bases is None:
            lengths = [flat.size for flat in flats]
            device = bool(flats) and not isinstance(flats[0], np.ndarray)
        else:
            lengths, device = bases.lengths, not isinstance(bases.x, np.ndarray)
        cols = np.cumsum([0] + [_payload_bytes(n, k, index_dtype)
                                for n, k in zip(lengths, ks)]).tolist()
        self.row, self.device, self.index_dtype = cols[-1], device, index_dtype
        if bases is None:   # each array is its own base
            self.segments = [nk.TopKSegment(0, n, k, col) for n, k, col in zip(lengths, ks, cols)]
            self.groups = [(flat, res, [seg]) for flat, res, seg in
                           zip(flats, residuals, self.segments)]
        else:
            self.segments = [nk.TopKSegment(xo, n, k, col, ro) for n, k, col, xo, ro in
                             zip(lengths, ks, cols, bases.x_offsets, bases.residual_offsets)]
            self.groups = [(bases.x, bases.residual, self.segments)]

    def run(self, comm, scale: float, stats: WireStats | None) -> None:
        wire = transport.of(comm)
        index_dtype, device, segments = self.index_dtype, self.device, self.segments
        message = _kept("message", self.row, device)
        for x, res, members in self.groups:
            nk.compress_topk_segments(x, members, message, index_dtype, residual=res)
        # ``message`` stays as sent: the tree and the swap merge into buffers of their own
        # (where the global set is ``message`` itself, one rank, each segment is restored
        # before it is scaled)
        sent = message
        rank, n = wire.rank, wire.size
        if n == 2:  # one exchange and two identical merges beat a hop up and a hop back down
            glob = _pair_exchange(message, segments, index_dtype, wire, stats, device)
        else:
            root = gtopk_tree_reduce(message, segments, wire, stats, device, index_dtype)
            glob = root if rank == 0 else _kept("global", self.row, device)
            binomial_broadcast(glob, wire, stats)
        for x, res, members in self.groups:   # scaled: k values rather than the whole tensor
            nk.decompress_topk_segments(glob, members, x, index_dtype, factor=scale,
                                        residual=res, sent=sent)


@functools.lru_cache(maxsize=4096)   # asked per layer and step; a format checks its fields
def _payload_bytes(n: int, k: int, index_dtype: str) -> int:
    return nk.TopKFormat(n, k, index_dtype).nbytes


def _kept(role: str, nbytes: int, device: bool):
    """gTop-k's payload buffer for ``role``, kept from exchange to exchange on this thread
    (``device_arrays.kept``): the message, a partner's payload, the merges (two, used in turn)
    and the global set a non-root rank receives."""
    return device_arrays.kept(f"gtopk {role}", nbytes, np.uint8, device)


def gtopk_tree_reduce(message, segments, comm, stats: WireStats | None = None,
                      device: bool = False, index_dtype: str = "int32"):
    """The gTop-k tree on a message of concatenated top-k payloads (``segments``:
    ``numba_kernels.TopKSegment``s, their payloads' columns); rank 0 returns the merged
    message, others None. The merged message is a buffer the next exchange on this thread
    overwrites.

    In round j (mask = 2^j) a rank with bit j set sends and leaves; the receiver merges the
    partner's pairs into its own, every segment at once, keeping each segment's top-k.
    """
    wire = transport.of(comm)
    rank, n = wire.rank, wire.size
    acc = message
    mask, merges = 1, 0
    while mask < n:
        if rank & mask:
            wire.send(acc, rank - mask, tag=_TAG)
            if stats is not None:
                stats.add(acc.size)
            return None
        partner = rank + mask
        if partner < n:
            received = _kept("received", acc.size, device)
            wire.recv(received, partner, tag=_TAG)
            merged = _kept(f"merged {merges % 2}", acc.size, device)  # not the one acc is
            nk.merge_topk_segments(acc, received, segments, merged, index_dtype)
            acc, merges = merged, merges + 1
        mask <<= 1
    return acc


def _pair_exchange(message, segments, index_dtype: str, wire, stats: WireStats | None,
                   device: bool = False):
    """P = 2: swap payloads and merge on both ranks, rank 0's payload first on both (so the
    two merges are the same computation and give the same bytes)."""
    other = _kept("received", message.size, device)
    peer = 1 - wire.rank
    wire.exchange(message, [other], [peer], tag=_TAG)
    if stats is not None:
        stats.add(message.size)
    first, second = (message, other) if wire.rank == 0 else (other, message)
    merged = _kept("merged 0", message.size, device)
    nk.merge_topk_segments(first, second, segments, merged, index_dtype)
    return merged


def binomial_broadcast(buf, comm, stats: WireStats | None = None) -> None:
    """Broadcast ``buf`` from rank 0 down the binomial tree, one Send per edge.

    Each byte crosses P - 1 edges, the fewest possible; MPICH's Bcast at these sizes
    scatters then all-gathers, which puts more bytes on a shared link (measured in
    ``benchmarks/results/sparse_timing.md``).
    """
    wire = transport.of(comm)
    rank = wire.rank
    if rank:
        wire.recv(buf, rank & (rank - 1), tag=_TAG + 1)  # parent: lowest set bit off
    children = binomial_children(rank, wire.size)
    for child in children:  # largest subtree first
        wire.send(buf, child, tag=_TAG + 1)
    if stats is not None:
        stats.add(len(children) * buf.size)
