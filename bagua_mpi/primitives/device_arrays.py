"""Arrays for the primitives' kernels: NumPy on the host, Numba device arrays on a GPU: scratch
arrays, and views of tensors (one tensor, or the storage a bucket's tensors share).

On a real GPU the memory comes from torch's caching allocator (viewed by Numba through the CUDA
array interface, which keeps the tensor alive): Numba's own ``device_array`` calls cudaMalloc
and, when the array dies, cudaFree, which waits for the whole device, once per scratch array
per bucket. Under Numba's CUDA simulator (no CUDA in torch) the simulator's arrays are used.
"""
from __future__ import annotations

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
