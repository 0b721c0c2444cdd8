"""Sparse allreduces of top-k (index, value) payloads (SPEC §5, gTop-k paper).

Both start the same way on each rank, for a flat float32 gradient g and residual r:
``r <- r + g``; select the k largest |r| (ties: lower index); the payload holds those k
(index, value) pairs; r keeps every unselected entry (fused in ``numba_kernels.compress_topk``).

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

from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

import numba_kernels as nk

from ..buffers import host_view
from .codecs import WireStats, fit_kernel_threads

_TAG = 7401


def topk_count(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` elements at ``density`` (at least 1 of a non-empty tensor)."""
    return min(numel, max(1, int(round(density * numel)))) if numel else 0


@dataclass
class SparseSegment:
    """One tensor of a packed gTop-k exchange: contiguous CPU float32 ``flat``, its own k and
    its residual (float32, ``flat.numel()`` elements)."""

    flat: torch.Tensor
    k: int
    residual: torch.Tensor


def _compress(flat: torch.Tensor, k: int, residual: torch.Tensor, index_dtype: str, out=None):
    if flat.dtype != torch.float32 or flat.is_cuda or not flat.is_contiguous():
        raise ValueError("sparse allreduces take contiguous CPU float32 tensors, got "
                         f"{flat.dtype} on {flat.device}")
    if residual.shape != (flat.numel(),) or residual.dtype != torch.float32:
        raise ValueError(f"residual must be float32 of shape ({flat.numel()},), got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    fit_kernel_threads()
    return nk.compress_topk(host_view(flat), k, index_dtype=index_dtype,
                            residual=host_view(residual), out=out)


def topk_allgather_(flat: torch.Tensor, comm: MPI.Intracomm, k: int, residual: torch.Tensor, *,
                    scale: float = 1.0, index_dtype: str = "int32",
                    stats: WireStats | None = None) -> torch.Tensor:
    """Top-k S-SGD aggregation in place (see the module docstring)."""
    mine = _compress(flat, k, residual, index_dtype)
    n = comm.Get_size()
    gathered = np.empty((n, mine.nbytes), dtype=np.uint8)
    comm.Allgather(mine.buffer, gathered)
    if scale != 1.0:  # scale the n x k values, not the whole decoded tensor
        for row in gathered:
            _scale_values(mine.format, row, scale)
    nk.decompress_many(gathered, mine.format, out=host_view(flat))
    if stats is not None:
        stats.add((n - 1) * mine.nbytes)
    return flat


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


def gtopk_tree_reduce(message: np.ndarray, layout, comm: MPI.Intracomm,
                        stats: WireStats | None):
    """The gTop-k tree on a message of concatenated top-k payloads (``layout``: one
    (format, byte slice, k) per segment); rank 0 returns the merged message, others None."""
    rank, n = comm.Get_rank(), comm.Get_size()
    acc = message
    mask = 1
    while mask < n:
        if rank & mask:
            comm.Send(acc, dest=rank - mask, tag=_TAG)
            if stats is not None:
                stats.add(acc.nbytes)
            return None
        partner = rank + mask
        if partner < n:
            received = np.empty(acc.nbytes, dtype=np.uint8)
            comm.Recv(received, source=partner, tag=_TAG)
            merged = np.empty_like(acc)
            for fmt, cols, k in layout:
                nk.merge_topk(nk.Payload(fmt, acc[cols]), nk.Payload(fmt, received[cols]), k,
                              out=merged[cols])
            acc = merged
        mask <<= 1
    return acc


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
    """
    layout, row = [], 0
    for seg in segments:
        fmt = nk.TopKFormat(seg.flat.numel(), seg.k, index_dtype)
        layout.append((fmt, slice(row, row + fmt.nbytes), seg.k))
        row += fmt.nbytes
    message = np.empty(row, dtype=np.uint8)
    for seg, (_, cols, k) in zip(segments, layout):
        _compress(seg.flat, k, seg.residual, index_dtype, out=message[cols])
    sent = message.copy()
    rank, n = comm.Get_rank(), comm.Get_size()
    if n == 2:  # one exchange and two identical merges beat a hop up and a hop back down
        glob = _pair_exchange(message, layout, comm, stats)
    else:
        root = gtopk_tree_reduce(message, layout, comm, stats)
        glob = root if rank == 0 else np.empty(row, dtype=np.uint8)
        binomial_broadcast(glob, comm, stats)
    for seg, (fmt, cols, _) in zip(segments, layout):
        selected = nk.Payload(fmt, glob[cols])
        nk.restore_unselected(host_view(seg.residual), nk.Payload(fmt, sent[cols]), selected)
        if scale != 1.0:  # k values rather than the whole decoded tensor
            _scale_values(fmt, glob[cols], scale)
        nk.decompress(selected, out=host_view(seg.flat))


def _scale_values(fmt, payload: np.ndarray, scale: float) -> None:
    values = fmt.views(payload)["values"]
    values *= np.float32(scale)


def _pair_exchange(message: np.ndarray, layout, comm: MPI.Intracomm,
                   stats: WireStats | None) -> np.ndarray:
    """P = 2: swap payloads and merge on both ranks, rank 0's payload first on both (so the
    two merges are the same computation and give the same bytes)."""
    other = np.empty_like(message)
    comm.Sendrecv(message, dest=1 - comm.Get_rank(), sendtag=_TAG, recvbuf=other,
                  source=1 - comm.Get_rank(), recvtag=_TAG)
    if stats is not None:
        stats.add(message.nbytes)
    first, second = (message, other) if comm.Get_rank() == 0 else (other, message)
    merged = np.empty_like(message)
    for fmt, cols, k in layout:
        nk.merge_topk(nk.Payload(fmt, first[cols]), nk.Payload(fmt, second[cols]), k,
                      out=merged[cols])
    return merged


def binomial_broadcast(buf: np.ndarray, comm: MPI.Intracomm,
                       stats: WireStats | None = None) -> None:
    """Broadcast ``buf`` from rank 0 down the binomial tree, one Send per edge.

    Each byte crosses P - 1 edges, the fewest possible; MPICH's Bcast at these sizes
    scatters then all-gathers, which puts more bytes on a shared link (measured in
    ``benchmarks/results/sparse_timing.md``).
    """
    rank = comm.Get_rank()
    if rank:
        comm.Recv(buf, source=rank & (rank - 1), tag=_TAG + 1)  # parent: lowest set bit off
    children = binomial_children(rank, comm.Get_size())
    for child in children:  # largest subtree first
        comm.Send(buf, dest=child, tag=_TAG + 1)
    if stats is not None:
        stats.add(len(children) * buf.nbytes)
