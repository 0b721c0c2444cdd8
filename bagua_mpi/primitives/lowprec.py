"""C_LP_S: centralized low-precision allreduce by scatter-reduce (BAGUA paper §3.2, SPEC §2).

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
Hierarchical: float32 reduce inside each node, C_LP_S among the node leaders, node broadcast.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..buffers import host_view
from .centralized import partition_length
from .codecs import Codec, WireStats, call_seed


def padded_length(length: int, n: int) -> int:
    return partition_length(length, n) * n


def compressed_allreduce_(flat: torch.Tensor, comm: MPI.Intracomm, codec: Codec, *,
                          worker_error: torch.Tensor | None = None,
                          server_error: torch.Tensor | None = None, scale: float = 1.0,
                          seed: int = 0, stats: WireStats | None = None) -> torch.Tensor:
    """In place: ``flat`` <- scale x C_LP_S(flat) over ``comm``. CPU float32 tensors."""
    if flat.dtype != torch.float32 or flat.is_cuda:
        work = flat.detach().to(device="cpu", dtype=torch.float32).contiguous()
        compressed_allreduce_(work, comm, codec, worker_error=worker_error,
                              server_error=server_error, scale=scale, seed=seed, stats=stats)
        flat.copy_(work)
        return flat
    n, rank = comm.Get_size(), comm.Get_rank()
    length = flat.numel()
    if length == 0:
        return flat
    part = partition_length(length, n)
    x = host_view(flat)
    if part * n != length:
        padded = np.zeros(part * n, dtype=np.float32)
        padded[:length] = x
    else:
        padded = x
    fmt = codec.format(part)
    we = None if worker_error is None else _check_error(worker_error, part * n, "worker")
    se = None if server_error is None else _check_error(server_error, part, "server")

    send = np.empty((n, fmt.nbytes), dtype=np.uint8)
    for k in range(n):  # phase 1
        codec.compress(padded[k * part:(k + 1) * part], send[k],
                       residual=None if we is None else we[k * part:(k + 1) * part],
                       seed=call_seed(seed, rank, k, 1))
    recv = np.empty_like(send)
    comm.Alltoall(send, recv)
    merged = codec.decompress_many(recv, part, out=np.empty(part, dtype=np.float32))
    if scale != 1.0:
        merged *= np.float32(scale)
    mine = np.empty(fmt.nbytes, dtype=np.uint8)
    codec.compress(merged, mine, residual=se, seed=call_seed(seed, rank, rank, 2))  # phase 2
    gathered = np.empty_like(send)
    comm.Allgather(mine, gathered)
    for k in range(n):
        codec.decompress_many(gathered[k:k + 1], part, out=padded[k * part:(k + 1) * part])
    if padded is not x:
        x[:] = padded[:length]
    if stats is not None:
        stats.add(2 * (n - 1) * fmt.nbytes)
    return flat


def _check_error(err: torch.Tensor, length: int, which: str) -> np.ndarray:
    if err.numel() != length or err.dtype != torch.float32 or err.is_cuda:
        raise ValueError(f"{which} error must be a CPU float32 tensor of {length} elements, "
                         f"got {err.dtype} of {err.numel()} on {err.device}")
    return host_view(err)


def hierarchical_compressed_allreduce_(flat: torch.Tensor, topo, codec: Codec, *,
                                       worker_error=None, server_error=None, scale: float = 1.0,
                                       seed: int = 0, stats: WireStats | None = None):
    """Full precision inside nodes, C_LP_S among node leaders, broadcast inside nodes."""
    buf = host_view(flat)
    topo.node_reduce_(buf)
    if topo.leaders is not None:
        compressed_allreduce_(flat, topo.leaders, codec, worker_error=worker_error,
                              server_error=server_error, scale=scale, seed=seed, stats=stats)
    topo.node_broadcast_(buf)
    if stats is not None and topo.local_size > 1:  # node reduce in, node broadcast out
        stats.add(buf.nbytes * (topo.local_size - 1 if topo.local_rank == 0 else 1))
    return flat
