"""Arrays for the primitives' kernels: NumPy on the host, Numba device arrays on a GPU: scratch
arrays (new ones, or payload buffers kept from call to call), and views of tensors (one tensor,
or the storage a bucket's tensors share).

On a real GPU the memory comes from torch's caching allocator (viewed by Numba through the CUDA
array interface, which keeps the tensor alive): Numba's own ``device_array`` calls cudaMalloc
and, when the array dies, cudaFree, which waits for the whole device, once per scratch array
per bucket. Under Numba's CUDA simulator (no CUDA in torch) the simulator's arrays are used.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch

from ..buffers import host_view

_TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32,
                 np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def empty(shape, dtype, device: bool):
    """An uninitialised array of ``shape`` and NumPy ``dtype``, on the device or the host."""
    if not device:
        return np.empty(shape, dtype=dtype)
    from numba import cuda

    if torch.cuda.is_available():
        return cuda.as_cuda_array(torch.empty(shape, dtype=_TORCH_DTYPES[np.dtype(dtype)],
                                              device="cuda"))
    return cuda.device_array(shape, dtype=dtype)


class _Kept:
    """One kept buffer: its memory, and the views of it asked for so far, by shape."""

    __slots__ = ("memory", "views")

    def __init__(self, memory):
        self.memory, self.views = memory, {}


_kept = threading.local()
# shapes a kept buffer remembers views of before it starts again: a training loop asks for one
# per bucket and role, and C_LP_S's one-by-one merged partition one per segment length (a few
# hundred for a bucket of many distinct layers; a smaller bound would make views every step)
_VIEWS_KEPT = 4096


def kept(name: str, shape, dtype, device: bool):
    """An uninitialised array like ``empty``'s, over the same memory at each of this thread's
    calls with ``name``: one buffer per (thread, name, dtype, GPU or host), grown to the
    largest size asked for, and one view of it per shape (a training loop's exchanges ask for
    a few).

    For the payloads of an exchange, which the next exchange on the same thread may overwrite.
    A new array for every exchange costs each time: on the host, fresh pages (a large NumPy
    array is mapped anew, and the kernel zeroes every page the payload first touches: a 16 MiB
    payload took 1.7-2.5 ms to fill fresh against 0.66 ms kept, here); on a GPU, the Python of
    Numba's view of a new torch tensor. Reuse is safe because one thread's exchanges run one at
    a time, and on a GPU their kernels and the wire run in stream order: each exchange's
    kernels read and write after the last one's, and the wire (NCCL after torch's stream, MPI
    after a host wait) has finished with a buffer before a call returns. Names that are in
    use at the same time must differ."""
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
    try:
        buffers = _kept.buffers
    except AttributeError:
        buffers = _kept.buffers = {}
    # a thread may run exchanges on more than one GPU (a bucket runs with its own device)
    key = (name, dtype, _current_gpu() if device else "host")
    entry = buffers.get(key)
    view = None if entry is None else entry.views.get(shape)
    if view is None:   # a shape not asked for since the buffer was made (a few per run)
        size = math.prod(shape)
        if entry is None or entry.memory.size < size:
            entry = buffers[key] = _Kept(empty(max(size, 1), dtype, device))
        if len(entry.views) >= _VIEWS_KEPT:
            entry.views.clear()
        view = entry.views[shape] = entry.memory[:size].reshape(shape)
    return view


def _current_gpu():
    """The current CUDA device's index, or "simulator" under Numba's CUDA simulator (no CUDA
    in torch)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "simulator"


def release_kept() -> None:
    """Drop this thread's kept buffers (their memory returns when nothing else holds it)."""
    _kept.__dict__.pop("buffers", None)


def array_of(t: torch.Tensor):
    """The tensor's memory as an array where it lives: a NumPy view, or a Numba device array."""
    if t.is_cuda:
        from numba import cuda
        return cuda.as_cuda_array(t.detach())
    return host_view(t)


def storage_base(tensors: list[torch.Tensor]):
    """(the whole storage the float32 ``tensors`` share, as an array where they live; each
    one's first element in it), or None when they do not share one: what the segmented kernels
    take, a bucket's layers as segments of one base array."""
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        return None
    whole = tensors[0].detach().as_strided((storage.nbytes() // 4,), (1,), 0)
    return array_of(whole), [t.storage_offset() for t in tensors]
