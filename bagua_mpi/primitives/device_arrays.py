"""Scratch arrays for the primitives' kernels: NumPy on the host, Numba device arrays on a GPU.

On a real GPU the memory comes from torch's caching allocator (viewed by Numba through the CUDA
array interface, which keeps the tensor alive): Numba's own ``device_array`` calls cudaMalloc
and, when the array dies, cudaFree, which waits for the whole device, once per scratch array
per bucket. Under Numba's CUDA simulator (no CUDA in torch) the simulator's arrays are used.
"""
from __future__ import annotations

import numpy as np
import torch

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
