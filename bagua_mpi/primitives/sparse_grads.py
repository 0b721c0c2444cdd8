"""Sparse COO gradients (``nn.Embedding(sparse=True)``) kept sparse: every rank's rows, gathered.

The sum of sparse gradients over ranks is the concatenation of their (index, value) entries
(coalesced afterwards), so the exchange is an allgather. Ranks hold different numbers of
entries; the payloads travel as equal blocks padded to the largest count, so the same three
``Transport.allgather`` calls work on MPI, gloo and NCCL:

1. allgather every rank's entry count (one int64 each);
2. allgather the indices and the values, each padded to the largest count;
3. keep each rank's first ``count`` entries, scale the values, coalesce.

Bytes per rank: (n - 1) x (largest count x (index dims x 8 + row bytes) + 8), against a dense
allreduce's 2 (n - 1) / n x the whole tensor.
"""
from __future__ import annotations

import torch

from ..accounting import WireStats
from ..transport import Transport


def sparse_allgather(grad: torch.Tensor, wire: Transport, *, scale: float = 1.0,
                     stats: WireStats | None = None) -> torch.Tensor:
    """The coalesced sum over ``wire``'s ranks of the sparse COO ``grad`` (times ``scale``)."""
    g = grad.coalesce()
    n = wire.size
    indices = g.indices().t().contiguous()  # (count, sparse dims): rows concatenate
    values = g.values().contiguous()
    count = indices.shape[0]
    counts = torch.empty(n, dtype=torch.int64, device=values.device)
    wire.allgather(torch.tensor([count], dtype=torch.int64, device=values.device), counts,
                   dense=False)
    most = int(counts.max())
    padded_i = indices.new_zeros((most,) + tuple(indices.shape[1:]))
    padded_i[:count] = indices
    padded_v = values.new_zeros((most,) + tuple(values.shape[1:]))
    padded_v[:count] = values
    all_i = indices.new_empty((n * most,) + tuple(indices.shape[1:]))
    all_v = values.new_empty((n * most,) + tuple(values.shape[1:]))
    wire.allgather(padded_i.reshape(-1), all_i.reshape(-1), dense=False)
    wire.allgather(padded_v.reshape(-1), all_v.reshape(-1), dense=False)
    keep = torch.cat([torch.arange(r * most, r * most + int(c), device=values.device)
                      for r, c in enumerate(counts.tolist())])
    gathered_v = all_v[keep]
    if scale != 1.0:
        gathered_v = gathered_v * scale
    if stats is not None:
        stats.add((n - 1) * (padded_i.numel() * padded_i.element_size()
                             + padded_v.numel() * padded_v.element_size() + 8))
    # every rank's indices are in range: the ranks wrap models of the same shapes (checked
    # when wrapping); saying so also keeps torch from warning that it does not check
    return torch.sparse_coo_tensor(all_i[keep].t(), gathered_v, g.size(),
                                   check_invariants=False).coalesce()
