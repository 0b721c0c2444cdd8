"""Message passing between the partitions of one replica, as torch autograd functions.

A ``Link`` is a replica group's private channel (a duplicate of the group communicator, so
activations can never match parameter-server or collective traffic). Every message is a
nonblocking point-to-point ``Isend``/``Irecv``; waits poll with ``polling.Backoff`` so a
partition waiting for its neighbour leaves the core to the neighbour's compute.

Two kinds of boundary, each an autograd function whose backward is the transpose of its forward:

* ``pipe_send`` / ``pipe_recv`` (partition by layers). Forward: partition m sends its block's
  output (a shape message, then the data: the receiver does not know the batch size) to m + 1.
  Backward: m + 1 sends the gradient of that activation back to m. ``pipe_send`` returns a
  0-dim *token*; ``token.backward()`` on partition m waits for that gradient and continues the
  backward pass through m's layers.
* ``exchange`` (partition within layers). Partition m owns units ``owns[m]`` (along ``dim``) of
  a layer's input and needs ``needs[m]``; following ``partition.exchange_plan``, forward sends
  each neighbour the owned units it needs (the halo) and assembles the needed block; backward
  sends the gradient of every received unit back to its owner, which adds it to the gradient
  of its own units. A gather onto one partition is the case "the root needs everything, the
  others nothing".

Both sides of every transfer post their ``Irecv``/``Isend`` first and wait afterwards, so all
partitions can enter the same boundary in any order without deadlock.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from mpi4py import MPI

from ..errors import PartitionError
from ..polling import POLL_MAX_S, Backoff
from .partition import Transfer

_DTYPES = {torch.float32: (0, MPI.FLOAT), torch.float64: (1, MPI.DOUBLE)}
_BY_CODE = {0: torch.float32, 1: torch.float64}
_MAX_DIMS = 8
TAG_BASE = 0x100  # tags on the link: TAG_BASE + 4 * boundary + kind
_SHAPE, _FWD, _BWD = 0, 1, 2


def _tag(boundary: int, kind: int) -> int:
    return TAG_BASE + 4 * boundary + kind


class Link:
    """Nonblocking point-to-point messages inside one replica group, with traffic counters.

    ``bytes_sent``/``messages_sent`` count payload bytes (activations and gradients) this
    partition put on the wire; ``wait_s`` is the time it spent waiting for messages -- step time
    minus ``wait_s`` is its compute.
    """

    def __init__(self, group: MPI.Intracomm, poll_max_s: float = POLL_MAX_S):
        self.comm = group.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.poll_max_s = poll_max_s
        self.bytes_sent = 0
        self.messages_sent = 0
        self.wait_s = 0.0
        self._keep: list = []  # send buffers alive until their request completes

    def reset_counters(self) -> None:
        self.bytes_sent = self.messages_sent = 0
        self.wait_s = 0.0

    def isend(self, tensor: torch.Tensor, dest: int, tag: int) -> MPI.Request:
        arr = tensor.detach().cpu().contiguous().numpy()
        req = self.comm.Isend([arr, _mpi_type(tensor.dtype)], dest=dest, tag=tag)
        self._keep.append(arr)
        self.bytes_sent += arr.nbytes
        self.messages_sent += 1
        return req

    def irecv(self, shape, like: torch.Tensor, source: int, tag: int):
        """``(request, tensor)``: the tensor (CPU) is filled once the request completes."""
        out = torch.empty(tuple(shape), dtype=like.dtype)
        req = self.comm.Irecv([out.numpy(), _mpi_type(like.dtype)], source=source, tag=tag)
        return req, out

    def wait(self, requests: list) -> None:
        """Poll until every request completes (MPI progress happens inside ``Testall``)."""
        if requests:
            t0 = time.perf_counter()
            backoff = Backoff(self.poll_max_s)
            while not MPI.Request.Testall(requests):
                backoff.idle()
            self.wait_s += time.perf_counter() - t0
        self._keep.clear()

    def close(self) -> None:
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()


def _mpi_type(dtype: torch.dtype):
    if dtype not in _DTYPES:
        raise TypeError(f"activations must be float32 or float64 to cross a partition "
                        f"boundary, got {dtype}")
    return _DTYPES[dtype][1]


# -- partition by layers: the pipeline ------------------------------------------------------------

class _PipeSend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, link: Link, dest: int, boundary: int):
        if y.dim() > _MAX_DIMS:
            raise PartitionError(f"an activation of {y.dim()} dimensions crosses boundary "
                                 f"{boundary}; at most {_MAX_DIMS} are supported")
        _mpi_type(y.dtype)  # a named error for an unsupported dtype, before any message
        header = np.zeros(2 + _MAX_DIMS, dtype=np.int64)
        header[0], header[1] = _DTYPES[y.dtype][0], y.dim()
        header[2:2 + y.dim()] = y.shape
        hreq = link.comm.Isend([header, MPI.INT64_T], dest=dest, tag=_tag(boundary, _SHAPE))
        link._keep.append(header)
        link.wait([hreq, link.isend(y, dest, _tag(boundary, _FWD))])
        ctx.link, ctx.dest, ctx.boundary = link, dest, boundary
        ctx.shape, ctx.device = y.shape, y.device
        ctx.like = y.new_empty(0, device="cpu")
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad):
        link = ctx.link
        req, grad = link.irecv(ctx.shape, ctx.like, ctx.dest, _tag(ctx.boundary, _BWD))
        link.wait([req])
        return grad.to(ctx.device), None, None, None


class _PipeRecv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, link: Link, source: int, boundary: int, like):
        header = np.empty(2 + _MAX_DIMS, dtype=np.int64)
        hreq = link.comm.Irecv([header, MPI.INT64_T], source=source, tag=_tag(boundary, _SHAPE))
        link.wait([hreq])
        code, ndim = int(header[0]), int(header[1])
        shape = tuple(int(v) for v in header[2:2 + ndim])
        req, x = link.irecv(shape, torch.empty(0, dtype=_BY_CODE[code]), source,
                            _tag(boundary, _FWD))
        link.wait([req])
        ctx.link, ctx.source, ctx.boundary = link, source, boundary
        return x.to(like.device)

    @staticmethod
    def backward(ctx, grad):
        link = ctx.link
        link.wait([link.isend(grad, ctx.source, _tag(ctx.boundary, _BWD))])
        return None, None, None, None, None


def pipe_send(y: torch.Tensor, link: Link, dest: int, boundary: int) -> torch.Tensor:
    """Send activation ``y`` to partition ``dest``; returns the token to call backward on."""
    return _PipeSend.apply(y, link, dest, boundary)


def pipe_recv(link: Link, source: int, boundary: int, anchor: torch.Tensor) -> torch.Tensor:
    """Receive the activation partition ``source`` sends across ``boundary``.

    ``anchor`` is a tensor that requires grad (any; its gradient is dropped): it puts the
    receive into the autograd graph so that backward sends the activation's gradient back.
    """
    return _PipeRecv.apply(anchor, link, source, boundary, anchor)


# -- partition within layers: halo exchange and gather ---------------------------------------------

def _move_units(link: Link, plan: list[Transfer], dim: int, data: torch.Tensor,
                have: tuple[int, int], want: tuple[int, int], boundary: int,
                backward: bool) -> torch.Tensor:
    """One direction of a boundary: from ``data`` (units ``have`` along ``dim``) to the block of
    units ``want``, moving every transfer of ``plan``.

    Forward, a transfer carries input units from its ``src`` to its ``dst``, which places them in
    its needed block. Backward is the transpose: the gradient of those units goes from ``dst``
    back to ``src``, which adds it to the gradient of its own block (several partitions may have
    used a unit). Either way, the units a partition both has and wants are taken locally.
    """
    me = link.rank
    tag = _tag(boundary, _BWD if backward else _FWD)
    routes = [(t.dst, t.src, t) if backward else (t.src, t.dst, t) for t in plan]
    shape = list(data.shape)
    incoming, reqs = [], []
    for sender, receiver, t in routes:  # post every receive first, then the sends, then wait
        if receiver == me:
            shape[dim] = t.hi - t.lo
            req, buf = link.irecv(shape, data, sender, tag)
            incoming.append((t, buf))
            reqs.append(req)
    for sender, receiver, t in routes:
        if sender == me:
            reqs.append(link.isend(data.narrow(dim, t.lo - have[0], t.hi - t.lo), receiver, tag))
    shape[dim] = want[1] - want[0]
    # forward, every wanted unit comes from exactly one owner: written once, no zeroing needed;
    # backward, a unit's gradient is the sum over the partitions that used it
    new, place = (torch.zeros, torch.Tensor.add_) if backward else (torch.empty, torch.Tensor.copy_)
    out = new(shape, dtype=data.dtype)
    lo, hi = max(have[0], want[0]), min(have[1], want[1])
    if lo < hi:
        place(out.narrow(dim, lo - want[0], hi - lo), data.narrow(dim, lo - have[0], hi - lo))
    link.wait(reqs)
    for t, buf in incoming:  # plan order: the same summation order on every run
        place(out.narrow(dim, t.lo - want[0], t.hi - t.lo), buf)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_own, link: Link, plan: list[Transfer], dim: int, own: tuple[int, int],
                need: tuple[int, int], boundary: int):
        if x_own.shape[dim] != own[1] - own[0]:
            raise PartitionError(f"partition {link.rank}: boundary {boundary} expected "
                                 f"{own[1] - own[0]} owned units along dim {dim}, got a tensor of "
                                 f"shape {tuple(x_own.shape)}")
        out = _move_units(link, plan, dim, x_own.detach().cpu(), own, need, boundary,
                          backward=False)
        ctx.args = (link, plan, dim, own, need, boundary, x_own.device)
        return out.to(x_own.device)

    @staticmethod
    def backward(ctx, grad_need):
        link, plan, dim, own, need, boundary, device = ctx.args
        grad_own = _move_units(link, plan, dim, grad_need.detach().cpu(), need, own, boundary,
                               backward=True)
        return grad_own.to(device), None, None, None, None, None, None


def exchange(x_own: torch.Tensor, link: Link, plan: list[Transfer], dim: int,
             own: tuple[int, int], need: tuple[int, int], boundary: int) -> torch.Tensor:
    """This partition's needed block ``need`` (along ``dim``) from its owned block ``own``."""
    return _Exchange.apply(x_own, link, plan, dim, own, need, boundary)
