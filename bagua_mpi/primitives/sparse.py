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
  top-k and broadcasts it (a binomial broadcast, log2 P rounds). Per rank: O(k log P).
  Afterwards each rank puts back into r the pairs it sent whose index did not make the
  global set (``restore_unselected``), as the paper does.

The result (``flat``) is the scatter of the global pairs, times ``scale`` (1/P to average).
"""
from __future__ import annotations

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


def _compress(flat: torch.Tensor, k: int, residual: torch.Tensor, index_dtype: str):
    if flat.dtype != torch.float32 or flat.is_cuda or not flat.is_contiguous():
        raise ValueError("sparse allreduces take contiguous CPU float32 tensors, got "
                         f"{flat.dtype} on {flat.device}")
    if residual.shape != (flat.numel(),) or residual.dtype != torch.float32:
        raise ValueError(f"residual must be float32 of shape ({flat.numel()},), got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    fit_kernel_threads()
    return nk.compress_topk(host_view(flat), k, index_dtype=index_dtype,
                            residual=host_view(residual))


def topk_allgather_(flat: torch.Tensor, comm: MPI.Intracomm, k: int, residual: torch.Tensor, *,
                    scale: float = 1.0, index_dtype: str = "int32",
                    stats: WireStats | None = None) -> torch.Tensor:
    """Top-k S-SGD aggregation in place (see the module docstring)."""
    mine = _compress(flat, k, residual, index_dtype)
    n = comm.Get_size()
    gathered = np.empty((n, mine.nbytes), dtype=np.uint8)
    comm.Allgather(mine.buffer, gathered)
    out = host_view(flat)
    nk.decompress_many(gathered, mine.format, out=out)
    if scale != 1.0:
        out *= np.float32(scale)
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


def gtopk_tree_reduce(mine, comm: MPI.Intracomm, k: int, stats: WireStats | None = None):
    """Reduce top-k payloads up a binomial tree; rank 0 returns the global top-k payload."""
    rank, n = comm.Get_rank(), comm.Get_size()
    acc = mine
    mask = 1
    while mask < n:
        if rank & mask:
            comm.Send(acc.buffer, dest=rank - mask, tag=_TAG)
            if stats is not None:
                stats.add(acc.nbytes)
            return None
        partner = rank + mask
        if partner < n:
            received = np.empty(acc.nbytes, dtype=np.uint8)
            comm.Recv(received, source=partner, tag=_TAG)
            acc = nk.merge_topk(acc, nk.Payload(acc.format, received), k)
        mask <<= 1
    return acc


def gtopk_allreduce_(flat: torch.Tensor, comm: MPI.Intracomm, k: int, residual: torch.Tensor, *,
                     scale: float = 1.0, index_dtype: str = "int32",
                     stats: WireStats | None = None) -> torch.Tensor:
    """gTopKAllReduce in place (see the module docstring)."""
    mine = _compress(flat, k, residual, index_dtype)
    sent = nk.Payload(mine.format, mine.buffer.copy())
    rank, n = comm.Get_rank(), comm.Get_size()
    root = gtopk_tree_reduce(mine, comm, k, stats)
    glob = root.buffer if rank == 0 else np.empty(mine.nbytes, dtype=np.uint8)
    comm.Bcast(glob, root=0)
    if stats is not None:
        stats.add(len(binomial_children(rank, n)) * mine.nbytes)
    selected = nk.Payload(mine.format, glob)
    nk.restore_unselected(host_view(residual), sent, selected)
    out = host_view(flat)
    nk.decompress(selected, out=out)
    if scale != 1.0:
        out *= np.float32(scale)
    return flat
