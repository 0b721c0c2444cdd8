"""C_LP_S: centralized low-precision allreduce by scatter-reduce (BAGUA paper §3.2).

    x'_i = Q^-1 Q( sum_j Q^-1 Q(x_j + e_j) + s_i )      (then averaged when ``average``)

Steps on n ranks for a flat float32 tensor of L elements (P = ceil(L/n); the kernels read
past L as zeros, so an uneven length is padded without a copy):

1. phase 1: compress each partition k of x_i + e_i (worker error e_i, fused in the kernel,
   updated to what the compression lost);
2. alltoall: partition k of every rank goes to rank k, the "server" of partition k;
3. rank k decodes and sums the n payloads (one pass, in rank order: deterministic), scales;
4. phase 2: compress the merged partition + server error s_k (updated likewise);
5. allgather the n merged payloads; every rank decodes all partitions into x.

On a device each segment costs 4 kernel launches whatever n: steps 1 and 5 encode / decode
the n partitions at once (the codecs' row forms), step 3 decodes, sums and scales the n
payloads in one pass, step 4 is one encode; an encode of chunks longer than 4096 takes 3.
Min-max segments (each at its own width, L-GreCo's) whose tensors lie in one memory (a
bucket's gradients; their error memories end to end, as L-GreCo keeps them) take 4 launches
for all of them: each step runs every segment in one grid (``numba_kernels.minmax_segments``;
on the host, in one parallel loop of the CPU twins).

``worker_error``/``server_error`` = None switch error feedback off (BAGUA's own
implementation has none; QSGD and ByteGrad run without it). Errors live with the bucket in the
algorithm's state (sizes ``padded_length`` and ``partition_length``) and are checkpointed.
The two-level form (float32 sum inside each node, C_LP_S among the node leaders, node
broadcast) is the algorithm framework's (``algorithms/base.py``), shared by every algorithm.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

import numba_kernels as nk

from .. import transport
from .centralized import partition_length
from ..accounting import WireStats
from . import device_arrays
from .codecs import Codec, MinMaxCodec, call_seed, fit_kernel_threads


def padded_length(length: int, n: int) -> int:
    return partition_length(length, n) * n


@dataclass
class Segment:
    """One tensor of a packed C_LP_S exchange, with its own codec and error-feedback state.

    ``flat`` is a contiguous float32 vector (CPU, or CUDA with its errors there too);
    ``worker_error`` (``padded_length``) and ``server_error`` (``partition_length``) are None
    to switch error feedback off; ``seed`` seeds stochastic codecs for this segment.
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
    """In place: ``flat`` <- scale x C_LP_S(flat) over ``comm`` (float32 math).

    A CUDA ``flat`` stays on its device (errors must be on it too): the kernels run there and
    only payloads move (see ``packed_compressed_allreduce_``). Other dtypes are worked on as
    float32 where the tensor lives."""
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        work = flat.detach().to(dtype=torch.float32).contiguous()
        if not work.is_cuda:
            work = work.cpu()
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

    Contiguous float32 tensors, all on the host or all on one CUDA device (errors with them).
    On the device the Numba CUDA kernels compress (error feedback fused), decode, sum and scale
    there, and ``comm`` (a communicator or a ``transport.Transport``) moves only the payloads:
    on NCCL or a CUDA-aware MPI they stay on the device, otherwise they cross through pinned
    host buffers reused across steps. No dense tensor leaves the device.

    One call plans the exchange and runs it once (``CompressedExchange``, which a caller keeps
    to run it every step).
    """
    CompressedExchange(segments, transport.of(comm).size).run(comm, scale=scale, stats=stats)


class CompressedExchange:
    """A packed C_LP_S of a fixed list of segments over n ranks: planned once, run every step.

    Planning checks the segments (float32, contiguous, one place, error memories of the right
    sizes), finds their common memory (``_shared_bases``) and lays out every segment's payload
    in the message: each step then runs for all of them at once (``_Together``) or a segment
    at a time (``_OneByOne``), with the arrays it works on viewed once (a view of a CUDA
    tensor costs some 24 us of host time). A run costs the host a few calls, none a segment.
    The payload buffers are the thread's ``device_arrays.kept`` ones, shared by every bucket
    in turn (one buffer a role, grown to the largest bucket's payload).

    A plan holds views of the segments' tensors and error memories: it stays right while they
    stay where they are. A caller that keeps one across steps makes a new one when they move
    (QSGD, ByteGrad and L-GreCo keep one a bucket: ``AlgorithmImpl.kept_plan``)."""

    def __init__(self, segments: list[Segment], n: int):
        self.n, self.segment_count = n, len(segments)
        self.device = device = any(seg.flat.is_cuda for seg in segments)
        for seg in segments:
            if seg.flat.dtype != torch.float32 or not seg.flat.is_contiguous():
                raise ValueError(f"packed C_LP_S takes contiguous float32 tensors, got "
                                 f"{seg.flat.dtype} on {seg.flat.device}")
            if seg.flat.is_cuda != device:
                raise ValueError("packed C_LP_S takes tensors all on the host or all on a CUDA "
                                 f"device, got {[str(s.flat.device) for s in segments]}")
        bases = _shared_bases(segments)
        # with common memory the base arrays serve, and no tensor is viewed on its own
        views = bases is None
        xs, wes, ses = [], [], []
        for seg in segments:
            part = partition_length(seg.flat.numel(), n)
            wes.append(None if seg.worker_error is None else _check_error(
                seg.worker_error, part * n, "worker", seg.flat.device, views))
            ses.append(None if seg.server_error is None else _check_error(
                seg.server_error, part, "server", seg.flat.device, views))
            xs.append(device_arrays.array_of(seg.flat) if views else None)
        self.steps, self.row = _steps_of(xs, wes, ses, [seg.codec for seg in segments],
                                         [seg.seed for seg in segments], n, device, bases)

    def run(self, comm, *, scale: float = 1.0, stats: WireStats | None = None,
            seeds: list[int] | None = None) -> None:
        """The steps of the module docstring for every segment, over ``comm`` (a communicator
        or a ``transport.Transport`` of the plan's n ranks; no call when every segment is
        empty). ``seeds``: each segment's seed for this run, in the segments' order (QSGD
        draws a new random stream each step); None keeps the planned ones."""
        wire = transport.of(comm)
        if wire.size != self.n:
            raise ValueError(f"this C_LP_S was planned for {self.n} ranks, and the "
                             f"communicator has {wire.size}")
        if seeds is not None:
            if len(seeds) != self.segment_count:
                raise ValueError(f"this C_LP_S has {self.segment_count} segments, and "
                                 f"{len(seeds)} seeds were given")
            self.steps.reseed(seeds)
        _run_steps(self.steps, self.row, wire, scale, stats, self.device)


@dataclass
class SharedBases:
    """Where the segments of one exchange lie in common memory, for the segmented kernels:
    base arrays (NumPy arrays, or Numba device arrays), each segment's first element in them
    and its length. ``worker`` and ``server`` are None without error feedback."""

    x: object
    x_offsets: list
    lengths: list
    worker: object = None
    worker_offsets: list | None = None
    server: object = None
    server_offsets: list | None = None


def _shared_bases(segments: list[Segment]) -> SharedBases | None:
    """The segments' common memory, when the segmented kernels can take them: two or more
    min-max segments of one chunk, their tensors of each kind in one storage (the bucket's
    gradients; the error memories L-GreCo lays end to end), error feedback on all or none.
    None otherwise: each segment then runs on its own."""
    if len(segments) < 2 or not all(isinstance(seg.codec, MinMaxCodec) for seg in segments):
        return None
    if len({seg.codec.chunk for seg in segments}) != 1:
        return None
    x = device_arrays.storage_base([seg.flat for seg in segments])
    if x is None:
        return None
    lengths = [seg.flat.numel() for seg in segments]
    with_errors = [seg.worker_error is not None for seg in segments]
    if not any(with_errors):
        return SharedBases(*x, lengths)
    if not all(with_errors) or any(seg.server_error is None for seg in segments):
        return None
    worker = device_arrays.storage_base([seg.worker_error for seg in segments])
    server = device_arrays.storage_base([seg.server_error for seg in segments])
    if worker is None or server is None:
        return None
    return SharedBases(*x, lengths, *worker, *server)


def _clps_arrays(xs, wes, ses, codecs, seeds, comm, scale: float,
                 stats: WireStats | None, device: bool, bases: SharedBases | None = None) -> None:
    """C_LP_S on 1-D float32 arrays, all NumPy (host) or all Numba device arrays (device; under
    ``NUMBA_ENABLE_CUDASIM=1`` this path runs on the CPU in the tests), planned and run once
    (``_steps_of``, ``_run_steps``)."""
    wire = transport.of(comm)
    steps, row = _steps_of(xs, wes, ses, codecs, seeds, wire.size, device, bases)
    _run_steps(steps, row, wire, scale, stats, device)


def _steps_of(xs, wes, ses, codecs, seeds, n: int, device: bool,
              bases: SharedBases | None = None):
    """(the steps of a C_LP_S over n ranks, the bytes of one rank's message to one server):
    segment by segment on the arrays (``_OneByOne``), or with ``bases`` (the arrays' common
    memory, ``_shared_bases``; the arrays then unused) every segment at once (``_Together``:
    one launch on the device, one parallel loop on the host)."""
    if bases is not None:
        layout = _together_layout(codecs[0].chunk, tuple(codec.bits for codec in codecs),
                                  tuple(bases.lengths), tuple(bases.x_offsets),
                                  _maybe_tuple(bases.worker_offsets),
                                  _maybe_tuple(bases.server_offsets), n)
        return _Together(layout, bases, device), layout.row
    plans, row = _plans(xs, wes, ses, codecs, seeds, n)
    return _OneByOne(plans, device), row


def _run_steps(steps, row: int, wire, scale: float, stats: WireStats | None,
               device: bool) -> None:
    """The exchange of the module docstring with ``steps``' kernels. Both kinds of steps give
    the same bytes: the kernels are the CPU twins' equals and every sum runs in the same order.
    The kernels run in stream order with torch's; ``transport`` waits for them only where an
    MPI must read device memory."""
    if not row:   # every segment empty
        return
    n = wire.size
    send, recv = _scatter_payloads(row, wire, device, steps)
    mine = device_arrays.kept("c_lp_s mine", row, np.uint8, device)
    steps.serve(recv, mine, scale, wire.rank)  # server: sum, scale, phase 2
    gathered = send  # phase-1 payloads are no longer needed
    wire.allgather(mine, gathered)
    steps.decompress_rows(gathered)  # every partition into its place (the padding cut off)
    if stats is not None:
        stats.add(2 * (n - 1) * row)


class _OneByOne:
    """The steps of a C_LP_S segment by segment, each with its own codec: one launch a segment
    and step on a device (an encode of chunks longer than 4096 takes 3)."""

    def __init__(self, plans: list[_Plan], device: bool):
        self.plans, self.device = plans, device

    def reseed(self, seeds: list[int]) -> None:
        """Each segment's seed for the next run (``seeds`` in the segments' order)."""
        for plan in self.plans:
            plan.seed = seeds[plan.index]

    def compress_rows(self, send, rank: int) -> None:
        """Phase 1: partition k of every segment (worker error fused, seed ``call_seed(seed,
        rank, k, 1)``) into row k of send."""
        for plan in self.plans:
            plan.codec.compress_rows(plan.x, send, plan.cols, residual=plan.worker_error,
                                     seed=plan.seed, rank=rank, phase=1)

    def serve(self, recv, mine, scale: float, rank: int) -> None:
        """Steps 3 and 4: each segment's n payloads decoded, summed and scaled, then its merged
        partition (+ its server error) encoded into this rank's row."""
        for plan in self.plans:
            merged = _server_sum(plan, recv, scale, device_arrays.kept(
                "c_lp_s merged", plan.part, np.float32, self.device))
            plan.codec.compress(merged, mine[plan.cols], residual=plan.server_error,
                                seed=call_seed(plan.seed, rank, rank, 2))

    def decompress_rows(self, gathered) -> None:
        """Step 5: row k of every segment's payload into partition k of its place."""
        for plan in self.plans:
            plan.codec.decompress_rows(gathered, plan.cols, plan.part, out=plan.x)


class _Together:
    """The steps of a C_LP_S whose segments are all min-max (each at its own width, one chunk)
    in common memory (``bases``): each step for all of them at once (one launch on a device,
    one parallel loop of the CPU twins on the host), each segment's bytes those of its own
    kernels. The server's merged partitions lie end to end in one scratch array."""

    def __init__(self, layout: _TogetherLayout, bases: SharedBases, device: bool):
        self.layout, self.bases, self.device = layout, bases, device

    def reseed(self, seeds: list[int]) -> None:
        """Nothing: min-max rounds deterministically and reads no seed."""

    def compress_rows(self, send, rank: int) -> None:
        """Phase 1: partition k of every segment (+ its worker error) into row k of send."""
        fit_kernel_threads()
        nk.compress_minmax_rows_segments(self.bases.x, self.layout.tensors, send,
                                         chunk=self.layout.chunk, residual=self.bases.worker)

    def serve(self, recv, mine, scale: float, rank: int) -> None:
        """Steps 3 and 4: each segment's n payloads decoded, summed and scaled, then its merged
        partition (+ its server error) encoded into this rank's row."""
        layout = self.layout
        merged = device_arrays.kept("c_lp_s merged", layout.merged, np.float32, self.device)
        nk.decompress_minmax_segments(recv, layout.sums, merged, chunk=layout.chunk,
                                      factor=scale)
        nk.compress_minmax_rows_segments(merged, layout.partitions, mine.reshape(1, mine.size),
                                         chunk=layout.chunk, residual=self.bases.server)

    def decompress_rows(self, gathered) -> None:
        """Step 5: row k of every segment's payloads into partition k of its place."""
        nk.decompress_minmax_rows_segments(gathered, self.layout.tensors, self.bases.x,
                                           chunk=self.layout.chunk)


@dataclass(frozen=True)
class _TogetherLayout:
    """Where each min-max segment of a ``_Together`` exchange lies: in the base arrays
    (``tensors``: gradients and worker errors), in the server's scratch of merged partitions
    (``sums``; ``partitions`` with the server errors), and in each rank's message (every
    segment's byte column); the scratch's and the message's lengths."""

    chunk: int
    tensors: tuple
    sums: tuple
    partitions: tuple
    merged: int   # elements of the server's scratch
    row: int      # bytes of one rank's message to one server


@functools.lru_cache(maxsize=64)   # a bucket's exchange recurs every step until its levels change
def _together_layout(chunk: int, bits: tuple, lengths: tuple, x_offsets: tuple,
                     worker_offsets: tuple | None, server_offsets: tuple | None,
                     n: int) -> _TogetherLayout:
    """The ``_TogetherLayout`` of min-max segments of ``bits`` and ``lengths`` over n ranks,
    their places in the base arrays given (offsets None without error feedback); empty
    segments take no place. Made once per layout, not once per step: building it is a few
    microseconds of Python a layer."""
    tensors, sums, partitions = [], [], []
    merged = row = 0
    for index, (width, length) in enumerate(zip(bits, lengths)):
        if length == 0:
            continue
        part = partition_length(length, n)
        tensors.append(nk.MinMaxSegment(x_offsets[index], length, width, row,
                                        worker_offsets[index] if worker_offsets else 0))
        sums.append(nk.MinMaxSegment(merged, part, width, row))
        partitions.append(nk.MinMaxSegment(merged, part, width, row,
                                           server_offsets[index] if server_offsets else 0))
        merged += part
        row += MinMaxCodec(width, chunk).format(part).nbytes
    return _TogetherLayout(chunk, tuple(tensors), tuple(sums), tuple(partitions), merged, row)


def _maybe_tuple(values):
    return None if values is None else tuple(values)


def compressed_reduce_scatter_(flat: torch.Tensor, comm, codec: Codec, out: torch.Tensor, *,
                               worker_error: torch.Tensor | None = None, scale: float = 1.0,
                               seed: int = 0, stats: WireStats | None = None) -> torch.Tensor:
    """``out`` <- scale x (sum over ranks of Q^-1 Q(partition ``rank`` of flat + e)): the first
    half of C_LP_S, which leaves each rank the reduced partition it serves and nothing else
    (ZeRO stage 2's gradient exchange; steps 1-3 of the module docstring).

    ``flat`` (float32, contiguous, CPU or CUDA) is split into n partitions of
    ``partition_length`` (zero padded); ``out`` holds one partition; ``worker_error``
    (``padded_length``) is the error feedback of what this rank sends, updated in the kernel.
    Each rank sends (n-1)/n of a compressed copy: a quarter of a float32 reduce-scatter at 8
    bits."""
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        raise ValueError(f"compressed reduce-scatter takes a contiguous float32 tensor, got "
                         f"{flat.dtype}")
    wire = transport.of(comm)
    n = wire.size
    part = partition_length(flat.numel(), n)
    if out.numel() != part or out.dtype != torch.float32 or out.device != flat.device:
        raise ValueError(f"compressed reduce-scatter: out must be a float32 tensor of {part} "
                         f"elements on {flat.device}, got {out.dtype} of {out.numel()} on "
                         f"{out.device}")
    device = flat.is_cuda
    we = None if worker_error is None else _check_error(worker_error, part * n, "worker",
                                                        flat.device)
    plans, row = _plans([device_arrays.array_of(flat.view(-1))], [we], [None], [codec], [seed],
                        n)
    if not plans:
        out.zero_()
        return out
    _, recv = _scatter_payloads(row, wire, device, _OneByOne(plans, device))
    _server_sum(plans[0], recv, scale, device_arrays.array_of(out))
    if stats is not None:
        stats.add((n - 1) * row)
    return out


@dataclass
class _Plan:
    """One segment's place in a packed exchange."""

    codec: Codec
    seed: int
    x: object  # the segment (1-D float32 array; its last partitions may end short)
    part: int  # partition length
    cols: slice  # its bytes in each rank's message
    worker_error: object
    server_error: object
    index: int = 0  # the segment's place in the exchange's list


def _plans(xs, wes, ses, codecs, seeds, n: int) -> tuple[list[_Plan], int]:
    """The non-empty segments' plans, and the bytes of one rank's message to one server."""
    plans, row = [], 0
    for index, (x, we, se, codec, seed) in enumerate(zip(xs, wes, ses, codecs, seeds)):
        if x.size == 0:
            continue
        part = partition_length(x.size, n)
        nbytes = codec.format(part).nbytes
        plans.append(_Plan(codec, seed, x, part, slice(row, row + nbytes), we, se, index))
        row += nbytes
    return plans, row


def _scatter_payloads(row: int, wire, device: bool, steps):
    """Phase 1 and the alltoall: ``steps`` (``_OneByOne`` or ``_Together``) compress partition
    k of every segment into row k of the message matrix, for server k; return (send, recv),
    recv's row j holding rank j's payload for this rank."""
    n = wire.size
    send = device_arrays.kept("c_lp_s send", (n, row), np.uint8, device)
    steps.compress_rows(send, wire.rank)
    recv = device_arrays.kept("c_lp_s recv", (n, row), np.uint8, device)
    wire.alltoall(send, recv)
    return send, recv


def _server_sum(plan: _Plan, recv, scale: float, out):
    """Decode and sum the n payloads of ``plan``'s partition (in rank order: deterministic)
    into ``out``, scaled as the decoder stores the sum. The payloads are read where they sit,
    at ``plan.cols`` of recv's rows (no copy of the columns)."""
    return plan.codec.decompress_many(recv, plan.part, out=out, cols=plan.cols, factor=scale)


def _check_error(err: torch.Tensor, length: int, which: str, device, view: bool = True):
    """The error memory checked, and viewed as an array where it lives (None without
    ``view``: the exchange takes the common memory of all of them)."""
    if (err.numel() != length or err.dtype != torch.float32 or err.device != device
            or not err.is_contiguous()):
        raise ValueError(f"{which} error must be a contiguous float32 tensor of {length} "
                         f"elements on {device} (where the data is), got {err.dtype} of "
                         f"{err.numel()} on {err.device}")
    return device_arrays.array_of(err.view(-1)) if view else None
