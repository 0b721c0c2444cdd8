"""Decentralized primitives (BAGUA paper §3.2): D_FP_S and D_LP_S.

Peers come from a topology:

* ``ring``: ranks i-1 and i+1 (one peer when n = 2, none when n = 1);
* ``random``: a fresh pairing each step from a permutation drawn from a seed all ranks share,
  so i picks j exactly when j picks i. With an odd number of ranks the last rank of the
  permutation has no partner that step and keeps its model unchanged.

D_FP_S: ``x_i <- mean of x_j over j in peers(i) + {i}`` (exact, float32 messages).

D_LP_S (ring, compressed): exchanging compressed *models* would not converge, so, as Tang et
al. (2018) and CHOCO-gossip do, each rank keeps public estimates ``h`` of its own model and of
each peer's, identical on both sides because both decode the same payloads:

1. q_i = Q(x_i - h_i); h_i += Q^-1(q_i)             (only the change since last time is sent)
2. send q_i to each peer, receive q_j; h_j += Q^-1(q_j)
3. x_i += gamma x w x sum_j (h_j - h_i),  w = 1 / (1 + |peers|)

With lossless Q and gamma = 1 this is exactly D_FP_S; with a lossy Q the estimates converge to the
models and so do the models to their average (the spread shrinks geometrically).
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..buffers import host_view
from ..accounting import WireStats
from .codecs import Codec

_TAG = 7301


def ring_peers(rank: int, size: int) -> list[int]:
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


def random_pairing(size: int, step: int, seed: int) -> list[int]:
    """partner[i] for every rank (-1: unpaired this step). Same result on every rank."""
    perm = np.random.default_rng([seed, step]).permutation(size)
    partner = [-1] * size
    for a, b in zip(perm[0::2], perm[1::2]):
        partner[a], partner[b] = int(b), int(a)
    return partner


def random_peers(rank: int, size: int, step: int, seed: int) -> list[int]:
    p = random_pairing(size, step, seed)[rank]
    return [] if p < 0 else [p]


def peers_for(topology: str, rank: int, size: int, step: int = 0, seed: int = 0) -> list[int]:
    if topology == "ring":
        return ring_peers(rank, size)
    if topology == "random":
        return random_peers(rank, size, step, seed)
    raise ValueError(f"unknown peer topology {topology!r}; valid: ring, random")


def _exchange(comm: MPI.Intracomm, send: np.ndarray, peers: list[int]) -> list[np.ndarray]:
    """Send ``send`` to every peer and receive one equal-sized buffer from each."""
    recvs = [np.empty_like(send) for _ in peers]
    reqs = [comm.Irecv(r, source=p, tag=_TAG) for r, p in zip(recvs, peers)]
    reqs += [comm.Isend(send, dest=p, tag=_TAG) for p in peers]
    MPI.Request.Waitall(reqs)
    return recvs


def decentralized_average_(flat: torch.Tensor, comm: MPI.Intracomm, peers: list[int],
                           stats: WireStats | None = None,
                           wire_dtype: torch.dtype | None = None) -> torch.Tensor:
    """D_FP_S in place: average ``flat`` with the same tensor on ``peers`` (CPU).

    With ``wire_dtype`` (float16/bfloat16) the models travel as 16-bit words; the average adds
    this rank's own model at full precision and the peers' decoded ones in float64.
    """
    if not peers or flat.numel() == 0:
        return flat
    x = host_view(flat)
    if wire_dtype is None:
        recvs = _exchange(comm, x.copy(), peers)
    else:
        wire = flat.detach().to(wire_dtype)
        recvs = [_decode16(r, wire_dtype) for r in _exchange(comm, host_view(wire).copy(), peers)]
    total = x.astype(np.float64)
    for r in recvs:
        total += r
    x[:] = total / (1 + len(peers))
    if stats is not None:
        stats.add(recvs[0].size * (x.itemsize if wire_dtype is None else 2) * len(peers))
    return flat


def _decode16(words: np.ndarray, wire_dtype: torch.dtype) -> np.ndarray:
    if wire_dtype == torch.bfloat16:
        return torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).float().numpy()
    return words.astype(np.float32)


class PeerEstimates:
    """D_LP_S state of one bucket: this rank's public copy and its copy of each peer's.

    ``own`` and ``peers`` may be given (float32 tensors or arrays the caller keeps, e.g. an
    algorithm's checkpointed state); missing ones start at zero.
    """

    def __init__(self, length: int, own=None, peers: dict | None = None):
        self.length = length
        self.own = _array(own) if own is not None else np.zeros(length, dtype=np.float32)
        self.peers: dict[int, np.ndarray] = {p: _array(v) for p, v in (peers or {}).items()}

    def of(self, peer: int) -> np.ndarray:
        if peer not in self.peers:
            self.peers[peer] = np.zeros(self.length, dtype=np.float32)
        return self.peers[peer]


def _array(x) -> np.ndarray:
    return host_view(x) if isinstance(x, torch.Tensor) else x


def low_precision_decentralized_(flat: torch.Tensor, comm: MPI.Intracomm, peers: list[int],
                                 codec: Codec, estimates: PeerEstimates, gamma: float = 1.0,
                                 stats: WireStats | None = None) -> torch.Tensor:
    """D_LP_S in place over ``peers`` (CPU float32), see the module docstring."""
    if not peers or flat.numel() == 0:
        return flat
    x = host_view(flat)
    n = x.size
    payload = np.empty(codec.format(n).nbytes, dtype=np.uint8)
    diff = x - estimates.own
    codec.compress(diff, payload)
    codec.decompress_many(payload[None, :], n, out=estimates.own, accumulate=True)
    recvs = _exchange(comm, payload, peers)
    mix = np.zeros(n, dtype=np.float32)
    for peer, buf in zip(peers, recvs):
        h = estimates.of(peer)
        codec.decompress_many(buf[None, :], n, out=h, accumulate=True)
        mix += h - estimates.own
    x += np.float32(gamma / (1 + len(peers))) * mix
    if stats is not None:
        stats.add(payload.nbytes * len(peers))
    return flat
