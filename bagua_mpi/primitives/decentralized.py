"""Decentralized primitives (BAGUA paper §3.2): D_FP_S and D_LP_S.

Peers come from a topology:

* ``ring``: ranks i-1 and i+1 (one peer when n = 2, none when n = 1);
* ``random``: a fresh pairing each step from a permutation drawn from a seed all ranks share,
  so i picks j exactly when j picks i. With an odd number of ranks the last rank of the
  permutation has no partner that step and keeps its model unchanged.

D_FP_S: ``x_i <- mean of x_j over j in peers(i) + {i}`` (messages in the model's dtype, summed
in float64; or 16-bit words with ``wire_dtype``).

D_LP_S (ring, compressed): exchanging compressed *models* would not converge, so, as Tang et
al. (2018) and CHOCO-gossip do, each rank keeps public estimates ``h`` of its own model and of
each peer's, identical on both sides because both decode the same payloads:

1. q_i = Q(x_i - h_i); h_i += Q^-1(q_i)             (only the change since last time is sent)
2. send q_i to each peer, receive q_j; h_j += Q^-1(q_j)
3. x_i += gamma x w x sum_j (h_j - h_i),  w = 1 / (1 + |peers|)

With lossless Q and gamma = 1 this is exactly D_FP_S; with a lossy Q the estimates converge to the
models and so do the models to their average (the spread shrinks geometrically).

Models on a CUDA device stay there (``_device_average_`` / ``_device_lowprec_``): the averaging
and the estimates' arithmetic run as torch operations on the device, compression and decoding
as the Numba CUDA kernels, and the transport moves the messages (``comm`` may be a
communicator or a ``transport.Transport``): NCCL send/receive or a CUDA-aware MPI on the device
buffers, else reused pinned host buffers. The device forms compute the same float32/float64
operations in the same order as the host forms.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from .. import transport
from ..accounting import WireStats
from ..buffers import HOST_PIECE, host_pieces, host_view
from . import device_arrays
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


def _exchange(comm, send, peers: list[int], dense: bool = False) -> list:
    """Send ``send`` (a NumPy array or a tensor) to every peer and receive one buffer of the
    same kind and size from each, through the transport (device tensors stay on the device on
    NCCL or a CUDA-aware MPI; staged ones are counted ``dense`` or as a payload). A NumPy
    array's are kept buffers (``device_arrays.kept``), which the next exchange on this thread
    overwrites; a tensor's come from torch's allocator (on a GPU, its cache)."""
    if isinstance(send, np.ndarray):
        recvs = [device_arrays.kept(f"from peer {i}", send.shape, send.dtype, False)
                 for i in range(len(peers))]
    else:
        recvs = [torch.empty_like(send) for _ in peers]
    transport.of(comm).exchange(send, recvs, peers, tag=_TAG, dense=dense)
    return recvs


def _without_peers(comm, flat: torch.Tensor) -> torch.Tensor:
    """A rank left without a partner this step (random pairing at an odd world size) still
    takes part in the exchange, with no peers: where it is the first on a process group, the
    group is made then, with every rank."""
    transport.of(comm).exchange(flat, [], [])
    return flat


def decentralized_average_(flat: torch.Tensor, comm: MPI.Intracomm, peers: list[int],
                           stats: WireStats | None = None,
                           wire_dtype: torch.dtype | None = None) -> torch.Tensor:
    """D_FP_S in place: average ``flat`` with the same tensor on ``peers`` (host or CUDA).

    With ``wire_dtype`` (float16/bfloat16) the models travel as 16-bit words; the average adds
    this rank's own model at full precision and the peers' words, widened a piece at a time,
    in float64. A contiguous host model is sent itself, without a copy: the exchange ends before
    the average overwrites it (a CUDA one is sent as a copy).
    """
    if flat.numel() == 0:
        return flat
    if not peers:
        return _without_peers(comm, flat)
    if flat.is_cuda:
        return _device_average_(flat, comm, peers, stats, wire_dtype)
    if flat.dtype not in (torch.float16, torch.float32, torch.float64):
        # averaged through NumPy, which has no bfloat16
        raise ValueError(f"D_FP_S on the host averages a float16, float32 or float64 tensor, "
                         f"got {flat.dtype}")
    x = host_view(flat)
    if wire_dtype is None:
        # a strided model cannot be sent as it is
        recvs = _exchange(comm, x if x.flags.c_contiguous else x.copy(), peers)
    else:
        # NumPy has no bfloat16: its words travel as int16
        words = device_arrays.kept("d_fp_s words", x.size,
                                   np.float16 if wire_dtype == torch.float16 else np.int16, False)
        torch.from_numpy(words).view(wire_dtype).copy_(flat.detach().view(-1))
        recvs = _exchange(comm, words, peers)
    _average_(x, recvs, wire_dtype)
    if stats is not None:
        stats.add(recvs[0].size * (x.itemsize if wire_dtype is None else 2) * len(peers))
    return flat


def _device_average_(flat: torch.Tensor, comm: MPI.Intracomm, peers: list[int],
                     stats: WireStats | None, wire_dtype: torch.dtype | None) -> torch.Tensor:
    """D_FP_S of a device (or, in the tests, any torch) tensor: the host form's operations in
    torch where the tensor lives."""
    x = flat.detach()
    if wire_dtype is None:
        recvs = _exchange(comm, x.contiguous().clone(), peers, dense=True)
    else:
        recvs = [r.float() for r in _exchange(comm, x.to(wire_dtype).contiguous(), peers)]
    total = x.to(torch.float64)
    for r in recvs:
        total += r
    with torch.no_grad():
        flat.copy_(total / (1 + len(peers)))
    if stats is not None:
        stats.add(x.numel() * (x.element_size() if wire_dtype is None else 2) * len(peers))
    return flat


class PeerEstimates:
    """D_LP_S state of one bucket: this rank's public copy and its copy of each peer's.

    ``own`` and ``peers`` may be given (float32 tensors or arrays the caller keeps, e.g. an
    algorithm's checkpointed state); missing ones start at zero.
    """

    def __init__(self, length: int, own=None, peers: dict | None = None):
        self.length = length
        # CUDA tensors stay tensors (the device path); host ones are used as NumPy views
        self.device = own.device if isinstance(own, torch.Tensor) and own.is_cuda else None
        self.own = (own if self.device is not None else _array(own)) if own is not None \
            else np.zeros(length, dtype=np.float32)
        self.peers: dict = {p: (v if self.device is not None else _array(v))
                            for p, v in (peers or {}).items()}

    def of(self, peer: int):
        if peer not in self.peers:
            self.peers[peer] = (np.zeros(self.length, dtype=np.float32) if self.device is None
                                else torch.zeros(self.length, device=self.device))
        return self.peers[peer]

    def tensors(self):
        """(own, {peer: estimate}) as torch tensors sharing the memory."""
        def t(a):
            return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)
        return t(self.own), {p: t(v) for p, v in self.peers.items()}


def _array(x) -> np.ndarray:
    return host_view(x) if isinstance(x, torch.Tensor) else x


def low_precision_decentralized_(flat: torch.Tensor, comm: MPI.Intracomm, peers: list[int],
                                 codec: Codec, estimates: PeerEstimates, gamma: float = 1.0,
                                 stats: WireStats | None = None) -> torch.Tensor:
    """D_LP_S in place over ``peers`` (float32, host or CUDA), see the module docstring."""
    if flat.numel() == 0:
        return flat
    if not peers:
        return _without_peers(comm, flat)
    if flat.is_cuda:
        return _device_lowprec_(flat, comm, peers, codec, estimates, gamma, stats)
    x = host_view(flat)
    n = x.size
    payload = device_arrays.kept("d_lp_s payload", codec.format(n).nbytes, np.uint8, False)
    # x - own, then the mix's sums (``_mix_``'s work)
    diff = device_arrays.kept("d_lp_s difference", n, np.float32, False)
    np.subtract(x, estimates.own, out=diff)
    codec.compress(diff, payload)
    codec.decompress_many(payload[None, :], n, out=estimates.own, accumulate=True)
    recvs = _exchange(comm, payload, peers)
    seen = []
    for peer, buf in zip(peers, recvs):
        h = estimates.of(peer)
        codec.decompress_many(buf[None, :], n, out=h, accumulate=True)
        seen.append(h)
    _mix_(x, estimates.own, seen, np.float32(gamma / (1 + len(peers))), diff)
    if stats is not None:
        stats.add(payload.nbytes * len(peers))
    return flat


def _average_(x: np.ndarray, recvs: list, wire_dtype: torch.dtype | None = None) -> None:
    """x = (float64(x) + the peers' models, in order) / (1 + peers), rounded to x's dtype, in
    place, a piece of ``HOST_PIECE`` elements at a time (the whole-array form allocated
    two float64 arrays of the bucket's length). The peers' models are in x's dtype, or words
    of ``wire_dtype`` (float16, or bfloat16 as int16), widened exactly a piece at a time."""
    total = np.empty(min(HOST_PIECE, x.size), dtype=np.float64)
    for start, stop in host_pieces(x.size):
        piece = total[:stop - start]
        piece[:] = x[start:stop]
        for r in recvs:
            piece += _widened(r[start:stop], wire_dtype)
        piece /= 1 + len(recvs)
        x[start:stop] = piece


def _widened(words: np.ndarray, wire_dtype: torch.dtype | None) -> np.ndarray:
    """Received words NumPy can add to float64: bfloat16's (int16 here) through torch, the
    others as they are."""
    if wire_dtype == torch.bfloat16:
        return torch.from_numpy(words).view(torch.bfloat16).float().numpy()
    return words


def _mix_(x: np.ndarray, own: np.ndarray, seen: list, weight: np.float32,
          work: np.ndarray) -> None:
    """x += weight x sum over the peers' estimates h of (h - own), in place (step 3), with the
    float32 operations of that expression in its order, a piece of ``HOST_PIECE`` elements
    at a time: ``work`` (x's length, free to overwrite) holds each piece's sum. The whole-array
    expression allocated three arrays of the bucket's length (with the difference it
    compressed, a quarter of a 23M-parameter MLP's step at 2 ranks in a profile)."""
    part = np.empty(min(HOST_PIECE, x.size), dtype=np.float32)
    for start, stop in host_pieces(x.size):
        total, term = work[start:stop], part[:stop - start]
        total.fill(0)
        for h in seen:
            np.subtract(h[start:stop], own[start:stop], out=term)
            total += term
        total *= weight
        x[start:stop] += total


def _device_lowprec_(flat: torch.Tensor, comm: MPI.Intracomm, peers: list[int], codec: Codec,
                     estimates: PeerEstimates, gamma: float,
                     stats: WireStats | None) -> torch.Tensor:
    """D_LP_S of a contiguous float32 device tensor (in the tests, any torch tensor): the host
    form's float32 operations in torch where it lives, the codec's kernels there too, and
    only the payloads exchanged."""
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        raise ValueError(f"D_LP_S takes a contiguous float32 tensor, got {flat.dtype}")
    x = flat.detach().view(-1)
    n = x.numel()
    own, _ = estimates.tensors()
    if own.device != x.device:
        raise ValueError(f"estimates on {own.device}, model on {x.device}: keep them together")
    payload = torch.empty(codec.format(n).nbytes, dtype=torch.uint8, device=x.device)
    diff = x - own
    codec.compress(_kernel_view(diff), _kernel_view(payload))
    codec.decompress_many(_kernel_view(payload).reshape(1, -1), n, out=_kernel_view(own),
                          accumulate=True)
    recvs = _exchange(comm, payload, peers)
    mix = torch.zeros(n, dtype=torch.float32, device=x.device)
    for peer, buf in zip(peers, recvs):
        estimates.of(peer)
        h = estimates.tensors()[1][peer]
        codec.decompress_many(_kernel_view(buf).reshape(1, -1), n, out=_kernel_view(h),
                              accumulate=True)
        mix += h - own
    x += mix * np.float32(gamma / (1 + len(peers)))
    if stats is not None:
        stats.add(payload.numel() * len(peers))
    return flat


def _kernel_view(t: torch.Tensor):
    """What the kernels take: the device array of a CUDA tensor (its kernels run in stream
    order with torch's), a NumPy view of a CPU one."""
    if t.is_cuda:
        from numba import cuda
        return cuda.as_cuda_array(t)
    return host_view(t)
