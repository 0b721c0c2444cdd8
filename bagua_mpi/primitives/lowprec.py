"""C_LP_S: centralized low-precision allreduce by scatter-reduce (BAGUA paper §3.2).

    x'_i = Q^-1 Q( sum_j Q^-1 Q(x_j + e_j) + s_i )      (then averaged when ``average``)

Steps on n ranks for a flat float32 tensor of L elements (P = ceil(L/n), zero padded):

1. phase 1: compress each partition k of x_i + e_i (worker error e_i, fused in the kernel,
   updated to what the compression lost);
2. alltoall: partition k of every rank goes to rank k, the "server" of partition k;
3. rank k decodes and sums the n payloads (one pass, in rank order: deterministic), scales;
4. phase 2: compress the merged partition + server error s_k (updated likewise);
5. allgather the n merged payloads; every rank decodes all partitions into x.

``worker_error``/``server_error`` = None switch error feedback off (BAGUA's own
implementation has none; QSGD and ByteGrad run without it). Errors live with the bucket in the
algorithm's state (sizes ``padded_length`` and ``partition_length``) and are checkpointed.
The two-level form (float32 sum inside each node, C_LP_S among the node leaders, node
broadcast) is the algorithm framework's (``algorithms/base.py``), shared by every algorithm.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from ..buffers import host_view
from .centralized import partition_length
from ..accounting import WireStats
from .codecs import Codec, call_seed


def padded_length(length: int, n: int) -> int:
    return partition_length(length, n) * n


@dataclass
class Segment:
    """One tensor of a packed C_LP_S exchange, with its own codec and error-feedback state.

    ``flat`` is a contiguous CPU float32 vector; ``worker_error`` (``padded_length``) and
    ``server_error`` (``partition_length``) are None to switch error feedback off; ``seed``
    seeds stochastic codecs for this segment.
    """

    flat: torch.Tensor
    codec: Codec
    worker_error: torch.Tensor | None = None
    server_error: torch.Tensor | None = None
    seed: int = 0


def compressed_allreduce_(flat: torch.Tensor, comm: MPI.Intracomm, codec: Codec, *,
                          worker_error: torch.Tensor | None = None,
                          server_error: torch.Tensor | None = None, scale: float = 1.0,
                          seed: int = 0, stats: WireStats | None = None) -> torch.Tensor:
    """In place: ``flat`` <- scale x C_LP_S(flat) over ``comm`` (float32 math, host memory)."""
    if flat.dtype != torch.float32 or flat.is_cuda or not flat.is_contiguous():
        work = flat.detach().to(device="cpu", dtype=torch.float32).contiguous()
        compressed_allreduce_(work, comm, codec, worker_error=worker_error,
                              server_error=server_error, scale=scale, seed=seed, stats=stats)
        flat.copy_(work.view_as(flat))
        return flat
    packed_compressed_allreduce_([Segment(flat.view(-1), codec, worker_error, server_error,
                                          seed)], comm, scale=scale, stats=stats)
    return flat


def packed_compressed_allreduce_(segments: list[Segment], comm: MPI.Intracomm, *,
                                 scale: float = 1.0, stats: WireStats | None = None) -> None:
    """C_LP_S of several tensors, each with its own codec, in one alltoall and one allgather.

    Every segment is partitioned over the n ranks on its own (so it decodes exactly as a
    separate ``compressed_allreduce_`` would); the message to rank k is the concatenation of
    every segment's partition-k payload, so a bucket of layers with different compression
    levels (L-GreCo) costs two collectives rather than two per layer. The segment list (sizes
    and codecs) must be the same on every rank.
    """
    n, rank = comm.Get_size(), comm.Get_rank()
    plans = []
    row = 0
    for seg in segments:
        length = seg.flat.numel()
        if seg.flat.dtype != torch.float32 or seg.flat.is_cuda or not seg.flat.is_contiguous():
            raise ValueError(f"packed C_LP_S takes contiguous CPU float32 tensors, got "
                             f"{seg.flat.dtype} on {seg.flat.device}")
        if length == 0:
            continue
        part = partition_length(length, n)
        x = host_view(seg.flat)
        padded = x if part * n == length else np.concatenate(
            [x, np.zeros(part * n - length, dtype=np.float32)])
        nbytes = seg.codec.format(part).nbytes
        we = None if seg.worker_error is None else _check_error(seg.worker_error, part * n,
                                                               "worker")
        se = None if seg.server_error is None else _check_error(seg.server_error, part,
                                                               "server")
        plans.append((seg, x, padded, part, slice(row, row + nbytes), we, se))
        row += nbytes
    if not plans:
        return

    send = np.empty((n, row), dtype=np.uint8)
    for seg, _, padded, part, cols, we, _ in plans:  # phase 1
        for k in range(n):
            seg.codec.compress(padded[k * part:(k + 1) * part], send[k, cols],
                               residual=None if we is None else we[k * part:(k + 1) * part],
                               seed=call_seed(seg.seed, rank, k, 1))
    recv = np.empty_like(send)
    comm.Alltoall(send, recv)
    mine = np.empty(row, dtype=np.uint8)
    for seg, _, _, part, cols, _, se in plans:  # server: sum, scale, phase 2
        merged = seg.codec.decompress_many(_columns(recv, cols), part,
                                           out=np.empty(part, dtype=np.float32))
        if scale != 1.0:
            merged *= np.float32(scale)
        seg.codec.compress(merged, mine[cols], residual=se, seed=call_seed(seg.seed, rank, rank, 2))
    gathered = send  # phase-1 payloads are no longer needed
    comm.Allgather(mine, gathered)
    for seg, x, padded, part, cols, _, _ in plans:
        for k in range(n):
            seg.codec.decompress_many(_columns(gathered[k:k + 1], cols), part,
                                      out=padded[k * part:(k + 1) * part])
        if padded is not x:
            x[:] = padded[:x.size]
    if stats is not None:
        stats.add(2 * (n - 1) * row)


def _columns(stack: np.ndarray, cols: slice) -> np.ndarray:
    """Rows of ``stack`` restricted to ``cols``, contiguous (a copy unless it spans the rows)."""
    if cols.start == 0 and cols.stop == stack.shape[1]:
        return stack
    return np.ascontiguousarray(stack[:, cols])


def _check_error(err: torch.Tensor, length: int, which: str) -> np.ndarray:
    if err.numel() != length or err.dtype != torch.float32 or err.is_cuda:
        raise ValueError(f"{which} error must be a CPU float32 tensor of {length} elements, "
                         f"got {err.dtype} of {err.numel()} on {err.device}")
    return host_view(err)
