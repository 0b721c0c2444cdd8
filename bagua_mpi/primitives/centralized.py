"""Centralized primitives: allreduce of a flat tensor with a narrower wire dtype.

``cast_allreduce_`` is C_LP_S with Q = a cast to float16/bfloat16 and no error feedback:

1. pad the flat float tensor to n equal partitions and cast it to the wire dtype;
2. alltoall: partition k of every rank goes to rank k (the "server" of partition k);
3. rank k sums the n received partitions in float32 (and scales, e.g. 1/n for averaging);
4. rank k casts its merged partition to the wire dtype; allgather the merged partitions;
5. every rank casts the result back into the original tensor.

Wire bytes per rank: 2 x (n-1)/n x L x 2 bytes, the same as a ring allreduce of 16-bit data,
while all additions run in float32 (MPICH's own float16 reduction is ~8x slower here).
The two-level form is the algorithm framework's (``algorithms/base.py``).

On the host every step writes into buffers kept from call to call (one set per thread and
size): casts are torch's (hardware conversion), and step 3 decodes and sums the received
partitions in one pass (``numba_kernels.sum_halves``). Casting into fresh tensors, as the first
version did, spent 151 ms of compute on 21M floats at 2 ranks, mostly first-touch page faults;
see ``benchmarks/results/step_time.md`` for step times.
"""
from __future__ import annotations

import threading

import numpy as np
import torch
import numba_kernels as nk

from .. import transport
from .codecs import fit_kernel_threads


def partition_length(length: int, parts: int) -> int:
    """Size of each of ``parts`` equal partitions covering ``length`` elements (padded)."""
    return -(-length // parts) if length else 0


def cast_allreduce_(flat: torch.Tensor, comm, wire_dtype: torch.dtype,
                    scale: float = 1.0) -> torch.Tensor:
    """In place: ``flat <- scale * sum over ranks of flat``, sending ``wire_dtype`` words over
    ``comm`` (a communicator or a ``transport.Transport``). A CUDA tensor is cast and summed on
    its device; only the 16-bit words travel (staged, where they must be, as dense data)."""
    wire = transport.of(comm)
    n = wire.size
    length = flat.numel()
    if length == 0:
        return flat
    if n == 1:
        flat.copy_(flat.to(wire_dtype))  # same rounding as with more ranks
        if scale != 1.0:
            flat.mul_(scale)
        return flat
    if not flat.is_cuda and flat.is_contiguous() and flat.dtype in _HOST_FLOATS:
        _host_cast_allreduce_(flat, wire, wire_dtype, scale)
        return flat
    part = partition_length(length, n)
    send = torch.zeros(n * part, dtype=wire_dtype, device=flat.device)
    send[:length].copy_(flat)
    recv = torch.empty_like(send)
    wire.alltoall(send, recv, dense=True)
    merged = recv.view(n, part).to(torch.float32).sum(0)
    if scale != 1.0:
        merged.mul_(scale)
    merged_wire = merged.to(wire_dtype)
    gathered = torch.empty_like(send)
    wire.allgather(merged_wire, gathered, dense=True)
    flat.copy_(gathered[:length])
    return flat


_HOST_FLOATS = (torch.float32, torch.float64)
_KIND = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_buffers = threading.local()  # per thread: (n, part) -> (send, recv, merged, gathered)
_KEEP = 8  # buffer sets kept per thread (one per bucket size in use)


def _host_buffers(n: int, part: int):
    """Reused buffers for one exchange shape: fresh large arrays cost page faults each step."""
    sets = getattr(_buffers, "sets", None)
    if sets is None:
        sets = _buffers.sets = {}
    key = (n, part)
    found = sets.pop(key, None)
    if found is None:
        found = (np.zeros(n * part, np.uint16), np.empty(n * part, np.uint16),
                 np.empty(part, np.float32), np.empty(n * part, np.uint16))
    sets[key] = found  # most recently used last
    while len(sets) > _KEEP:
        sets.pop(next(iter(sets)))
    return found


def _host_cast_allreduce_(flat: torch.Tensor, wire, wire_dtype: torch.dtype,
                          scale: float) -> None:
    """``cast_allreduce_`` of a contiguous float32/float64 CPU tensor (steps 1-5 above)."""
    n, rank, length = wire.size, wire.rank, flat.numel()
    part = partition_length(length, n)
    merged, gathered = _host_scatter_sum(flat, wire, wire_dtype, scale, part)
    result = torch.from_numpy(gathered).view(wire_dtype)
    result[rank * part:(rank + 1) * part].copy_(torch.from_numpy(merged))
    wire.allgather(gathered[rank * part:(rank + 1) * part], gathered)  # in place
    flat.copy_(result[:length])


def _host_scatter_sum(flat: torch.Tensor, wire, wire_dtype: torch.dtype, scale: float,
                      part: int):
    """The scatter-reduce half on the host: 16-bit words of ``flat`` (n blocks of ``part``)
    to their owners, float32 sums in rank order, scaled; returns (merged, the set's gather
    buffer)."""
    n = wire.size
    send, recv, merged, gathered = _host_buffers(n, part)
    words = torch.from_numpy(send).view(wire_dtype)
    # past length: zeros, or an earlier call's words (same part, other length); either way only
    # padding, which the elementwise sums keep apart from the result
    words[:flat.numel()].copy_(flat.detach().reshape(-1))
    wire.alltoall(send, recv)
    fit_kernel_threads()
    nk.sum_halves(recv.reshape(n, part), merged, _KIND[wire_dtype])
    if scale != 1.0:
        np.multiply(merged, np.float32(scale), out=merged)
    return merged, gathered


def cast_reduce_scatter_(padded: torch.Tensor, out: torch.Tensor, comm,
                         wire_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``out <- scale * (block rank of the sum over ranks of padded)``, sending ``wire_dtype``
    words: the first half of ``cast_allreduce_`` (an alltoall of 16-bit blocks, then float32
    sums in rank order where the data lives), so MPI moves 16-bit words too. ``padded`` holds
    n blocks of ``out``'s length (ZeRO stage 2's 16-bit reduce-scatter)."""
    wire = transport.of(comm)
    n, part = wire.size, out.numel()
    if n == 1:
        out.copy_(padded.to(wire_dtype).to(out.dtype) * scale)  # same rounding as with more
        return out
    if not padded.is_cuda and padded.is_contiguous() and padded.dtype in _HOST_FLOATS:
        merged, _ = _host_scatter_sum(padded, wire, wire_dtype, scale, part)
        out.copy_(torch.from_numpy(merged))
        return out
    send = padded.to(wire_dtype)
    recv = torch.empty_like(send)
    wire.alltoall(send, recv, dense=True)
    merged = recv.view(n, part).to(torch.float32).sum(0)
    if scale != 1.0:
        merged.mul_(scale)
    out.copy_(merged)
    return out

def wire_bytes_cast_allreduce(length: int, n: int, wire_itemsize: int) -> int:
    """Bytes this rank sends in ``cast_allreduce_`` (alltoall + allgather, excluding self)."""
    part = partition_length(length, n)
    return 2 * (n - 1) * part * wire_itemsize


__all__ = ["cast_allreduce_", "cast_reduce_scatter_", "partition_length",
           "wire_bytes_cast_allreduce"]
