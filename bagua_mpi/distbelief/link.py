"""Message passing between the partitions of one replica, as torch autograd functions.

A ``Link`` is a replica group's private channel (a duplicate of the group communicator, so
activations can never match parameter-server or collective traffic). Every message is a
nonblocking point-to-point ``Isend``/``Irecv``; waits poll with the protocol's ``Backoff`` so a
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

from .partition import PartitionError, Transfer
from .protocol import POLL_MAX_S, Backoff

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

class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_own, link: Link, plan: list[Transfer], dim: int, own: tuple[int, int],
                need: tuple[int, int], boundary: int):
        me = link.rank
        shape = list(x_own.shape)
        if shape[dim] != own[1] - own[0]:
            raise PartitionError(f"partition {me}: boundary {boundary} expected {own[1] - own[0]}"
                                 f" owned units along dim {dim}, got a tensor of shape "
                                 f"{tuple(x_own.shape)}")
        xc = x_own.detach().cpu()
        recvs, reqs = [], []
        for t in plan:  # post every receive first, then the sends, then wait
            if t.dst == me:
                shape[dim] = t.hi - t.lo
                req, buf = link.irecv(shape, xc, t.src, _tag(boundary, _FWD))
                recvs.append((t, buf))
                reqs.append(req)
        for t in plan:
            if t.src == me:
                reqs.append(link.isend(xc.narrow(dim, t.lo - own[0], t.hi - t.lo), t.dst,
                                       _tag(boundary, _FWD)))
        shape[dim] = need[1] - need[0]
        out = torch.empty(shape, dtype=x_own.dtype)
        lo, hi = max(own[0], need[0]), min(own[1], need[1])
        if lo < hi:
            out.narrow(dim, lo - need[0], hi - lo).copy_(xc.narrow(dim, lo - own[0], hi - lo))
        link.wait(reqs)
        for t, buf in recvs:
            out.narrow(dim, t.lo - need[0], t.hi - t.lo).copy_(buf)
        ctx.args = (link, plan, dim, own, need, boundary, x_own.device)
        return out.to(x_own.device)

    @staticmethod
    def backward(ctx, grad_need):
        link, plan, dim, own, need, boundary, device = ctx.args
        me = link.rank
        g = grad_need.detach().cpu()
        shape = list(g.shape)
        incoming, reqs = [], []
        for t in plan:  # the gradient of units I sent comes back from those who used them
            if t.src == me:
                shape[dim] = t.hi - t.lo
                req, buf = link.irecv(shape, g, t.dst, _tag(boundary, _BWD))
                incoming.append((t, buf))
                reqs.append(req)
        for t in plan:
            if t.dst == me:
                reqs.append(link.isend(g.narrow(dim, t.lo - need[0], t.hi - t.lo), t.src,
                                       _tag(boundary, _BWD)))
        shape[dim] = own[1] - own[0]
        grad_own = torch.zeros(shape, dtype=g.dtype)
        lo, hi = max(own[0], need[0]), min(own[1], need[1])
        if lo < hi:
            grad_own.narrow(dim, lo - own[0], hi - lo).add_(g.narrow(dim, lo - need[0], hi - lo))
        link.wait(reqs)
        for t, buf in incoming:  # plan order: the same summation order on every run
            grad_own.narrow(dim, t.lo - own[0], t.hi - t.lo).add_(buf)
        return grad_own.to(device), None, None, None, None, None, None


def exchange(x_own: torch.Tensor, link: Link, plan: list[Transfer], dim: int,
             own: tuple[int, int], need: tuple[int, int], boundary: int) -> torch.Tensor:
    """This partition's needed block ``need`` (along ``dim``) from its owned block ``own``."""
    return _Exchange.apply(x_own, link, plan, dim, own, need, boundary)
