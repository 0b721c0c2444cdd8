"""The one path from an algorithm or primitive to the wire (docs/design.md, "GPUs and the
transport").

A ``Transport`` moves flat buffers among the ranks of one MPI communicator, under one backend
(``backends.py``). Primitives and algorithms call its verbs with whatever holds their payload
(NumPy arrays, torch tensors on the host or a GPU, Numba device arrays) and it decides, per
call, from where the buffers live:

===============  =====================================================================
carrier          when
===============  =====================================================================
``mpi``          host buffers (and ``gloo`` is not chosen): mpi4py on host memory
``gloo``         host buffers with backend ``gloo``: torch.distributed's process group
``nccl``         device buffers with a NCCL backend (or ``auto`` where NCCL can run)
``mpi_device``   device buffers, CUDA-aware MPI: device pointers straight to mpi4py
``mpi_staged``   device buffers otherwise: through page-locked host buffers kept per key
===============  =====================================================================

Verbs (all collective over the communicator, except the point-to-point ones):
``allreduce_`` (in place; 16-bit floats are summed in float32 where MPI adds them),
``reduce_`` / ``broadcast_`` (root 0 by default), ``alltoall`` / ``allgather`` (equal blocks;
the receive buffer holds ``size`` blocks), ``alltoallv`` (a count of elements per rank each
way), ``reduce_scatter`` (the sum, or another op, of block k of every rank's send buffer lands
on rank k: ZeRO's gradient exchange), ``send`` / ``recv`` / ``exchange`` (a rank swaps one
buffer with each of its peers).

What it guarantees, so callers need not:

* **Device memory is ready when the wire reads it.** MPI reads outside every CUDA stream, so
  before an MPI carrier touches device memory the host waits for the device once: an explicit
  wait for a CUDA-aware MPI, the copy out for staging (``accounting.overhead.syncs`` counts
  both). NCCL runs in stream order after torch's current
  stream, so the process-group carriers never wait on the host; Numba's kernels and torch's
  run on the same (default) stream, so nothing else needs a wait either (a caller on another
  stream is put in order with it by the executor: ``streams.py``).
* **Staging is counted.** Each byte copied between device and host goes to
  ``accounting.staging``: ``dense`` for whole gradients or models, else a payload. The GPU
  check asserts zero for every algorithm on NCCL and on a CUDA-aware MPI.
* **Staging buffers are reused.** ``pinned_pool`` allocates a page-locked buffer once per key
  and grows it only when asked for more, so a training loop allocates in its first step only.

``mpi_buffer`` wraps one buffer for the user-facing collectives' own MPI calls, with datatypes
of their own: host memory as it is, device memory to a CUDA-aware MPI, else a fresh pinned copy
(not from the pool, and its host wait is not counted).
"""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from numba_kernels.wire import data_address

from . import backends, process_groups
from .accounting import overhead, staging
from .buffers import as_tensor, host_view
from .cuda import mpi_is_cuda_aware

_HALF = (torch.float16, torch.bfloat16)
_MPI_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}
_TAG = 7501
# calls per carrier in this process: how the tests see which wire an algorithm really used
carried: collections.Counter = collections.Counter()


def on_device(buf) -> bool:
    """Whether ``buf`` lives in device memory (a CUDA tensor or a Numba device array)."""
    if isinstance(buf, np.ndarray):
        return False
    if isinstance(buf, torch.Tensor):
        return buf.is_cuda
    return hasattr(buf, "copy_to_host")  # a Numba device array (the simulator's too)


def device_ready() -> None:
    """Wait on the host until the device has run every kernel queued so far (counted)."""
    overhead.sync()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    else:  # Numba's CUDA simulator runs kernels synchronously; nothing to wait for
        pass


def carrier_of(buf, backend: str) -> str:
    """The carrier of ``buf`` under resolved backend ``backend`` (``Transport.carrier``)."""
    if on_device(buf):
        return backends.device_carrier(backend)
    return backends.host_carrier(backend)


class Transport:
    """Payload movement over ``comm`` with backend ``backend`` (see the module docstring)."""

    def __init__(self, comm: MPI.Intracomm, backend: str | None = None):
        self.comm = comm
        self.backend = backends.resolve(backend)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def __repr__(self) -> str:
        return f"Transport(backend={self.backend!r}, rank={self.rank}, size={self.size})"

    # a communicator's questions, so primitives take a communicator or a transport alike
    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's spelling
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    # -- routing ----------------------------------------------------------------------------
    def carrier(self, buf) -> str:
        """``mpi``, ``gloo``, ``nccl``, ``mpi_device`` or ``mpi_staged`` for ``buf``."""
        return carrier_of(buf, self.backend)

    def _mover(self, buf):
        carrier = self.carrier(buf)
        carried[carrier] += 1
        if carrier == "mpi":
            return _HostMPI(self.comm)
        if carrier in process_groups.LIBRARIES:
            return _Group(process_groups.group(self.comm, carrier))
        return _DeviceMPI(self.comm) if carrier == "mpi_device" else _StagedMPI(self.comm)

    # -- verbs ------------------------------------------------------------------------------
    def allreduce_(self, buf, op: str = "sum", *, dense: bool = True) -> None:
        """In place: ``buf`` <- ``op`` over the ranks (sum, min, max, product)."""
        if self.size == 1 or _numel(buf) == 0:
            return
        mover = self._mover(buf)
        with _summable(buf, mover) as work:
            mover.allreduce_(work, op, dense)

    def reduce_(self, buf, root: int = 0, *, dense: bool = True) -> None:
        """Sum ``buf`` onto rank ``root`` in place there (others' ``buf`` is left as sent)."""
        if self.size == 1 or _numel(buf) == 0:
            return
        mover = self._mover(buf)
        with _summable(buf, mover) as work:
            mover.reduce_(work, root, dense)

    def broadcast_(self, buf, root: int = 0, *, dense: bool = True) -> None:
        if self.size == 1 or _numel(buf) == 0:
            return
        self._mover(buf).broadcast_(buf, root, dense)

    def alltoall(self, send, recv, *, dense: bool = False) -> None:
        """Block k of ``send`` to rank k; block j of ``recv`` from rank j (equal blocks)."""
        self._check_pair(send, recv, "alltoall", _numel(send))
        self._mover(send).alltoall(send, recv, dense)

    def alltoallv(self, send, send_counts, recv, recv_counts, *, dense: bool = False) -> None:
        """The next ``send_counts[k]`` elements of ``send`` to rank k, in rank order; the next
        ``recv_counts[j]`` of ``recv`` from rank j (what j sends this rank)."""
        send_counts, recv_counts = _counts(send_counts, self.size), _counts(recv_counts,
                                                                            self.size)
        self._check_pair(send, recv, "alltoallv", sum(recv_counts))
        if _numel(send) != sum(send_counts):
            raise ValueError(f"alltoallv: the send buffer must hold the {sum(send_counts)} "
                             f"elements of send_counts {send_counts}, got {_numel(send)}")
        self._mover(send).alltoallv(send, send_counts, recv, recv_counts, dense)

    def allgather(self, send, recv, *, dense: bool = False) -> None:
        """``recv`` <- every rank's ``send``, in rank order (``recv`` holds ``size`` of them).
        ``send`` may be this rank's block of ``recv`` (an in-place gather)."""
        self._check_pair(send, recv, "allgather", _numel(send) * self.size)
        self._mover(send).allgather(send, recv, dense)

    def reduce_scatter(self, send, recv, op: str = "sum", *, dense: bool = True) -> None:
        """``recv`` <- ``op`` (sum, min, max, product) over ranks of block ``rank`` of their
        ``send`` (``send`` holds ``size`` equal blocks of ``recv``'s length; 16-bit floats
        reduced as ``allreduce_`` reduces them)."""
        self._check_pair(send, recv, "reduce_scatter", _numel(send) // self.size)
        if _numel(send) != _numel(recv) * self.size:
            raise ValueError(f"reduce_scatter over {self.size} ranks: the send buffer must hold "
                             f"{self.size} blocks of {_numel(recv)} elements, got {_numel(send)}")
        if self.size == 1:
            as_tensor(recv).copy_(as_tensor(send).view_as(as_tensor(recv)))
            return
        mover = self._mover(send)
        with _summable(send, mover) as work_send, _summable(recv, mover) as work_recv:
            mover.reduce_scatter(work_send, work_recv, op, dense)

    def send(self, buf, dest: int, *, tag: int = _TAG) -> None:
        self._mover(buf).send(buf, dest, tag)

    def recv(self, buf, source: int, *, tag: int = _TAG) -> None:
        self._mover(buf).recv(buf, source, tag)

    def exchange(self, send, recvs: list, peers: list[int], *, tag: int = _TAG,
                 dense: bool = False) -> None:
        """Send ``send`` to every rank in ``peers`` and receive ``recvs[i]`` from
        ``peers[i]`` (the peers send the same number of bytes). Ranks must agree on who
        swaps with whom: i lists j exactly when j lists i. Every rank of the communicator
        calls it, a rank without peers this time too: the first exchange on a process group
        makes the group, and that takes every rank."""
        if len(recvs) != len(peers):
            raise ValueError(f"exchange needs one receive buffer per peer, got {len(recvs)} "
                             f"buffers for peers {peers}")
        mover = self._mover(send)
        if peers:
            mover.exchange(send, recvs, peers, tag, dense)

    def _check_pair(self, send, recv, verb: str, expected: int) -> None:
        if on_device(send) != on_device(recv):
            raise ValueError(f"{verb}: send and receive buffers must live together, got "
                             f"{_where(send)} and {_where(recv)}")
        if _numel(recv) != expected:
            raise ValueError(f"{verb} over {self.size} ranks: the receive buffer must hold "
                             f"{expected} elements, got {_numel(recv)}")


def of(comm_or_transport, backend: str | None = None) -> Transport:
    """``comm_or_transport`` itself when it is a ``Transport``, else a transport over the
    communicator (backend ``backend``, default the process-wide choice)."""
    if isinstance(comm_or_transport, Transport):
        return comm_or_transport
    return Transport(comm_or_transport, backend)


def op_named(mpi_op) -> str | None:
    """The verbs' name (sum, min, max, product) of MPI reduction ``mpi_op``; None for another
    (a logical or bitwise op, which only MPI has)."""
    return next((name for name, op in _MPI_OPS.items() if op == mpi_op), None)


def uses_nccl(tensor, backend: str | None = None) -> bool:
    """Whether a dense collective of ``tensor`` runs on NCCL: a CUDA tensor, and a NCCL
    backend (or ``auto`` where NCCL can run). An explicit NCCL choice that cannot run raises
    ``BackendUnavailableError``."""
    if not getattr(tensor, "is_cuda", False):
        return False
    return backends.device_carrier(backends.resolve(backend)) == "nccl"


def nccl_allreduce_(tensor, topo, backend: str | None = None, op: str = "sum") -> None:
    """In place: reduce a contiguous CUDA ``tensor`` over every rank of ``topo`` with ``op``
    (sum, min, max, product) on NCCL: flat, or with ``nccl_hierarchical`` NCCL inside each
    node and MPI among the node leaders in between."""
    if op not in process_groups.REDUCE_OPS:
        raise backends.BackendError(f"op {op!r} has no NCCL reduction; valid: "
                                    f"{', '.join(process_groups.REDUCE_OPS)}")
    name = backends.resolve(backend)
    if name != "nccl_hierarchical":
        process_groups.group(topo.comm, "nccl").allreduce_(tensor, op)
        return
    local = process_groups.group(topo.intra, "nccl")
    local.allreduce_(tensor, op)
    if topo.leaders is not None and topo.leaders.Get_size() > 1:
        Transport(topo.leaders, "mpi").allreduce_(tensor, op)
    local.broadcast_(tensor, 0)


# -- carriers -----------------------------------------------------------------------------------
class _HostMPI:
    """mpi4py on host memory (NumPy arrays, CPU tensors as NumPy views)."""

    def __init__(self, comm):
        self.comm = comm

    def _buf(self, x):
        return host_view(x) if isinstance(x, torch.Tensor) else x

    def allreduce_(self, buf, op, dense):
        self.comm.Allreduce(MPI.IN_PLACE, self._buf(buf), op=_MPI_OPS[op])

    def reduce_(self, buf, root, dense):
        b = self._buf(buf)
        if self.comm.Get_rank() == root:
            self.comm.Reduce(MPI.IN_PLACE, b, op=MPI.SUM, root=root)
        else:
            self.comm.Reduce(b, None, op=MPI.SUM, root=root)

    def broadcast_(self, buf, root, dense):
        self.comm.Bcast(self._buf(buf), root=root)

    def alltoall(self, send, recv, dense):
        self.comm.Alltoall(self._buf(send), self._buf(recv))

    def alltoallv(self, send, send_counts, recv, recv_counts, dense):
        self.comm.Alltoallv([self._buf(send), send_counts], [self._buf(recv), recv_counts])

    def allgather(self, send, recv, dense):
        s, r = self._buf(send), self._buf(recv)
        self.comm.Allgather(MPI.IN_PLACE if _aliases(s, r) else s, r)

    def reduce_scatter(self, send, recv, op, dense):
        self.comm.Reduce_scatter_block(self._buf(send), self._buf(recv), op=_MPI_OPS[op])

    def send(self, buf, dest, tag):
        self.comm.Send(self._buf(buf), dest=dest, tag=tag)

    def recv(self, buf, source, tag):
        self.comm.Recv(self._buf(buf), source=source, tag=tag)

    def exchange(self, send, recvs, peers, tag, dense):
        s = self._buf(send)
        if len(peers) == 1:  # one call: MPI pairs the two transfers itself
            self.comm.Sendrecv(s, dest=peers[0], sendtag=tag, recvbuf=self._buf(recvs[0]),
                               source=peers[0], recvtag=tag)
            return
        reqs = [self.comm.Irecv(self._buf(r), source=p, tag=tag) for r, p in zip(recvs, peers)]
        reqs += [self.comm.Isend(s, dest=p, tag=tag) for p in peers]
        MPI.Request.Waitall(reqs)


def _on_the_device_of(args) -> contextlib.AbstractContextManager:
    """The device of the first CUDA tensor among a verb's arguments (lists too) made current
    for the call, where the caller's is another (torch exports a tensor to MPI only from its
    own device); nothing where there is no CUDA tensor."""
    for arg in args:
        for x in (arg if isinstance(arg, list) else (arg,)):
            if isinstance(x, torch.Tensor) and x.is_cuda:
                return torch.cuda.device(x.device)
    return contextlib.nullcontext()


class _DeviceMPI(_HostMPI):
    """A CUDA-aware MPI on device memory: the host waits for the device once per call, every
    verb alike (a receive too: MPI writes outside every stream, and a kernel queued before it
    may still read the buffer, as gTop-k's merge reads the message the next round receives
    into)."""

    def _buf(self, x):
        if isinstance(x, torch.Tensor):
            # torch exports no __cuda_array_interface__ for bfloat16: its bits as int16
            return x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        return x

    def _wrap(name):  # noqa: N805 - builds the methods below
        def verb(self, *args):
            with _on_the_device_of(args):
                device_ready()  # MPI reads and writes outside torch's and Numba's streams
                return getattr(_HostMPI, name)(self, *args)
        verb.__name__ = name
        return verb

    allreduce_ = _wrap("allreduce_")
    reduce_ = _wrap("reduce_")
    broadcast_ = _wrap("broadcast_")
    alltoall = _wrap("alltoall")
    alltoallv = _wrap("alltoallv")
    allgather = _wrap("allgather")
    reduce_scatter = _wrap("reduce_scatter")
    send = _wrap("send")
    recv = _wrap("recv")
    exchange = _wrap("exchange")
    del _wrap


class _StagedMPI:
    """Device buffers through page-locked host copies (``pinned_pool``), MPI on the host."""

    def __init__(self, comm):
        self.comm = comm
        self.host = _HostMPI(comm)
        self.tid = threading.get_ident()

    def _out(self, buf, role: str, dense: bool):
        """A host copy of device ``buf`` in the pool buffer ``role`` (counted, and counted as
        a host wait: the copy returns once the device has produced ``buf``)."""
        host = pinned_pool.like(buf, (role, self.tid))
        _copy(host, buf)
        staging.d2h(_nbytes(buf), dense=dense)
        overhead.sync()
        return host

    def _in(self, buf, host) -> None:
        """Device ``buf`` <- its host copy (counted, and counted as a host wait: the copy
        returns once it has landed, so the pool buffer is free again)."""
        _copy(buf, host)
        staging.h2d(_nbytes(buf))
        overhead.sync()

    def _recv_buffer(self, buf, role: str):
        return pinned_pool.like(buf, (role, self.tid))

    def allreduce_(self, buf, op, dense):
        host = self._out(buf, "send", dense)
        self.host.allreduce_(host, op, dense)
        self._in(buf, host)

    def reduce_(self, buf, root, dense):
        host = self._out(buf, "send", dense)
        self.host.reduce_(host, root, dense)
        if self.comm.Get_rank() == root:
            self._in(buf, host)

    def broadcast_(self, buf, root, dense):
        host = self._out(buf, "send", dense) if self.comm.Get_rank() == root else \
            self._recv_buffer(buf, "send")
        self.host.broadcast_(host, root, dense)
        if self.comm.Get_rank() != root:
            self._in(buf, host)

    def alltoall(self, send, recv, dense):
        host_recv = self._recv_buffer(recv, "recv")
        self.host.alltoall(self._out(send, "send", dense), host_recv, dense)
        self._in(recv, host_recv)

    def alltoallv(self, send, send_counts, recv, recv_counts, dense):
        host_recv = self._recv_buffer(recv, "recv")
        self.host.alltoallv(self._out(send, "send", dense), send_counts, host_recv,
                            recv_counts, dense)
        self._in(recv, host_recv)

    def allgather(self, send, recv, dense):
        host_recv = self._recv_buffer(recv, "recv")
        self.host.allgather(self._out(send, "send", dense), host_recv, dense)
        self._in(recv, host_recv)

    def reduce_scatter(self, send, recv, op, dense):
        host_recv = self._recv_buffer(recv, "recv")
        self.host.reduce_scatter(self._out(send, "send", dense), host_recv, op, dense)
        self._in(recv, host_recv)

    def send(self, buf, dest, tag):
        self.host.send(self._out(buf, "send", False), dest, tag)

    def recv(self, buf, source, tag):
        host = self._recv_buffer(buf, "recv")
        self.host.recv(host, source, tag)
        self._in(buf, host)

    def exchange(self, send, recvs, peers, tag, dense):
        hosts = [pinned_pool.like(r, ("recv", i, self.tid)) for i, r in enumerate(recvs)]
        self.host.exchange(self._out(send, "send", dense), hosts, peers, tag, dense)
        for r, h in zip(recvs, hosts):
            self._in(r, h)


class _Group:
    """A torch.distributed process group (NCCL on device tensors, gloo on host ones). The
    verbs that only move data move bytes (``_bytes``); the reductions keep the dtype."""

    def __init__(self, group: process_groups.ProcessGroup):
        self.group = group

    def allreduce_(self, buf, op, dense):
        self.group.allreduce_(as_tensor(buf), op)

    def reduce_(self, buf, root, dense):
        self.group.reduce_(as_tensor(buf), root)

    def broadcast_(self, buf, root, dense):
        self.group.broadcast_(_bytes(buf), root)

    def alltoall(self, send, recv, dense):
        self.group.alltoall(_bytes(send), _bytes(recv))

    def alltoallv(self, send, send_counts, recv, recv_counts, dense):
        size = _itemsize(send)  # the libraries split the bytes along dimension 0
        self.group.alltoall(_bytes(send), _bytes(recv), [c * size for c in send_counts],
                            [c * size for c in recv_counts])

    def allgather(self, send, recv, dense):
        s, r = _bytes(send), _bytes(recv)
        if _aliases(s, r):  # the libraries read and write separate buffers
            s = s.clone()
        self.group.allgather(s, r)

    def reduce_scatter(self, send, recv, op, dense):
        self.group.reduce_scatter(_flat(send), _flat(recv), op)

    def send(self, buf, dest, tag):
        self.group.send(_bytes(buf), dest, tag)

    def recv(self, buf, source, tag):
        self.group.recv(_bytes(buf), source, tag)

    def exchange(self, send, recvs, peers, tag, dense):
        self.group.exchange(_bytes(send), [_bytes(r) for r in recvs], peers, tag)


def _flat(buf) -> torch.Tensor:
    """``buf`` as a 1-D tensor over its own memory, for a process group. It must be
    contiguous: a flattened copy would take a receive's data away from it."""
    t = as_tensor(buf)
    if not t.is_contiguous():
        raise ValueError(f"the process-group verbs take contiguous buffers, got one of shape "
                         f"{tuple(t.shape)} and strides {t.stride()}")
    return t.reshape(-1)


def _bytes(buf) -> torch.Tensor:
    """``_flat(buf)`` as bytes, for a verb that only moves data. gloo and NCCL move every
    dtype's bytes alike but refuse some dtypes outright (gloo int16, uint16 and uint32; NCCL
    has no 16-bit integers), and the host paths carry 16-bit words as uint16 arrays."""
    return _flat(buf).view(torch.uint8)


# -- buffers ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _summable(buf, mover):
    """``buf`` in a dtype ``mover`` can add: MPI adds 16-bit floats slowly or not at all, so
    they are summed as float32 (rounded once, on the copy back); the process groups add them
    natively."""
    if isinstance(buf, torch.Tensor) and buf.dtype in _HALF and not isinstance(mover, _Group):
        work = buf.float()
        yield work
        buf.copy_(work)
    else:
        yield buf


def _numel(buf) -> int:
    return buf.numel() if isinstance(buf, torch.Tensor) else int(buf.size)


def _itemsize(buf) -> int:
    return buf.element_size() if isinstance(buf, torch.Tensor) else buf.dtype.itemsize


def _counts(counts, size: int) -> list[int]:
    """``counts`` as ``size`` non-negative Python ints (one per rank), or ValueError."""
    out = [int(c) for c in counts]
    if len(out) != size or min(out, default=0) < 0:
        raise ValueError(f"alltoallv over {size} ranks needs {size} non-negative counts, got "
                         f"{list(counts)}")
    return out


def _nbytes(buf) -> int:
    return buf.numel() * buf.element_size() if isinstance(buf, torch.Tensor) else buf.nbytes


def _where(buf) -> str:
    return "device" if on_device(buf) else "host"


def _aliases(send, recv) -> bool:
    """Whether ``send`` lies inside ``recv``'s memory (an in-place gather)."""
    inner, outer = _extent(send), _extent(recv)
    return None not in (inner, outer) and outer[0] <= inner[0] and inner[1] <= outer[1]


def _extent(buf) -> tuple[int, int] | None:
    """(first byte, one past the last) of a contiguous buffer's memory, if it says."""
    start = data_address(buf)
    return None if start is None else (start, start + _nbytes(buf))


def _copy(dst, src) -> None:
    """dst <- src between a device buffer and its pinned host twin (same dtype and size)."""
    if isinstance(src, torch.Tensor) or isinstance(dst, torch.Tensor):
        as_tensor(dst).copy_(as_tensor(src).view_as(as_tensor(dst)))
    elif isinstance(dst, np.ndarray):
        src.copy_to_host(dst)  # a Numba device array
    else:
        dst.copy_to_device(src)


class PinnedPool:
    """Host staging buffers, reused across steps.

    ``get(key, nbytes)`` returns a uint8 NumPy view of ``nbytes`` of the buffer kept under
    ``key``; ``like(buf, key)`` one shaped and typed as ``buf`` (a NumPy array, or a CPU
    tensor for a torch ``buf``). A buffer is allocated once and only replaced when a larger one
    is asked for (``allocations`` counts them, for the tests). Page-locked where CUDA is
    present (fast, asynchronous-capable copies); plain host memory otherwise (Numba's CUDA
    simulator).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._bufs: dict = {}
        self.allocations = 0

    def get(self, key, nbytes: int) -> np.ndarray:
        with self._lock:
            buf = self._bufs.get(key)
            if buf is None or buf.numel() < nbytes:
                size = max(int(nbytes), 1)
                buf = torch.empty(size, dtype=torch.uint8,
                                  pin_memory=torch.cuda.is_available())
                self._bufs[key] = buf
                self.allocations += 1
        return buf.numpy()[:nbytes]

    def like(self, buf, key):
        raw = self.get(key, _nbytes(buf))
        if isinstance(buf, torch.Tensor):
            return torch.from_numpy(raw).view(buf.dtype).view(buf.shape)
        return raw.view(buf.dtype).reshape(buf.shape)

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()


pinned_pool = PinnedPool()


# -- the user-facing collectives' buffers -----------------------------------------------------
class MPIBuffer:
    """A contiguous buffer MPI may read and write, tied to a user tensor or array.

    ``obj`` is what goes to mpi4py (a NumPy array, or a CUDA tensor when MPI is CUDA-aware).
    For a CUDA tensor without CUDA-aware MPI, ``obj`` is a pinned host copy and ``writeback()``
    copies MPI's result back to the device. For a non-contiguous input, ``obj`` is a contiguous
    copy and ``writeback()`` copies it into the original.
    """

    __slots__ = ("source", "obj", "_back")

    def __init__(self, source, obj, back: Callable[[], None] | None):
        self.source = source
        self.obj = obj
        self._back = back

    def writeback(self) -> None:
        if self._back is not None:
            self._back()


def mpi_buffer(x, *, load: bool = True) -> MPIBuffer:
    """Wrap x for MPI. ``load=False`` skips copying x's contents in (pure receive buffers)."""
    if isinstance(x, np.ndarray):
        if x.flags.c_contiguous:
            return MPIBuffer(x, x, None)
        tmp = np.ascontiguousarray(x) if load else np.empty(x.shape, x.dtype)
        return MPIBuffer(x, tmp, lambda: np.copyto(x, tmp))
    if x.is_cuda:
        return _cuda_buffer(x, load)
    t = x.detach()
    if t.is_contiguous():
        return MPIBuffer(x, host_view(t), None)
    tmp = _contiguous_twin(t, load)
    return MPIBuffer(x, host_view(tmp), lambda: t.copy_(tmp))


def _contiguous_twin(t: torch.Tensor, load: bool) -> torch.Tensor:
    """A row-major tensor like the strided ``t``, on its device, holding its values when
    ``load``. (``empty_like`` would keep a transposed or channels-last tensor's strides: MPI
    would then fill it in the wrong order, or refuse it.)"""
    return t.contiguous() if load else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _cuda_buffer(x: torch.Tensor, load: bool) -> MPIBuffer:
    t = x.detach()
    if mpi_is_cuda_aware():
        dev = t if t.is_contiguous() else _contiguous_twin(t, load)
        obj = dev.view(torch.int16) if dev.dtype == torch.bfloat16 else dev
        device_ready()  # MPI reads outside torch's stream
        back = None if dev is t else (lambda: t.copy_(dev))
        return MPIBuffer(x, obj, back)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    if load:
        host.copy_(t)  # blocking D2H copy: MPI may read as soon as this returns
        staging.d2h(host.numel() * host.element_size(), dense=True)

    def back():
        t.copy_(host)
        staging.h2d(host.numel() * host.element_size())
    return MPIBuffer(x, host_view(host), back)
