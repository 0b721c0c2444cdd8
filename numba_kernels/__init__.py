"""numba_kernels: compression kernels for bagua_mpi, in Numba CUDA with CPU twins.

Every compressor has a CUDA kernel (``numba.cuda.jit``) and a CPU twin
(``numba.njit``, ``nogil``) that write the same bytes, so CPU and GPU ranks can
exchange payloads.  The public functions pick the implementation from where
the input lives: NumPy arrays and torch CPU tensors run on the host; objects
with ``__cuda_array_interface__`` (torch CUDA tensors, Numba device arrays)
run on the device, on ``stream`` if given.  ``numba.cuda`` is imported only
when device data arrives, so the package imports on machines without a GPU.

A payload is one flat uint8 buffer whose size follows from ``(n, params)``
(see ``wire``).  Compressors take ``residual=`` for fused error feedback and
``out=`` for a preallocated payload buffer.  The dense chunked formats have a
row form for scatter-reduces: ``compress_*_rows`` encodes the n partitions
of a tensor (zero-padded to n equal ones by reading past its end as zeros, not
by a copy) into the n rows of a payload matrix and ``decompress_rows`` decodes
each row into its partition, one launch each instead of n, byte for byte the
per-partition calls.

Every CUDA kernel launch is counted: ``launch_count()`` and
``scratch_allocations()`` (kernel scratch arrays are cached per thread and
stream, so only the first calls allocate; ``release_scratch()`` frees them)
give the host overhead of a bucket's compression (no call makes the host wait
for the device); ``reset_launch_count()`` zeroes both.
Each compressor documents its launches ("Device launches: ...").

>>> import numpy as np, numba_kernels as nk
>>> g = np.linspace(-1, 1, 4096, dtype=np.float32); e = np.zeros_like(g)
>>> p = nk.compress_minmax(g, bits=8, chunk=1024, residual=e)
>>> p.nbytes == nk.MinMaxFormat(4096, 8, 1024).nbytes
True
>>> bool(np.allclose(nk.decompress(p) + e, g, atol=1e-6))
True
"""
from ._counters import launch_count, release_scratch, reset_launch_count, scratch_allocations
from ._scalar import row_seed
from .casts import compress_cast, sum_halves
from .dispatch import decompress, decompress_many, decompress_rows
from .errors import (CudaUnavailableError, DeviceMismatchError, KernelError,
                     KernelParameterError, KernelTypeError, LayoutError, PayloadError)
from .merge import merge_topk, restore_unselected, scale_topk_stack, scale_topk_values
from .minmax import compress_minmax, compress_minmax_rows, minmax_errors
from .onebit import compress_onebit, compress_onebit_rows
from .qsgd import compress_qsgd, compress_qsgd_rows
from .topk import compress_randk, compress_topk
from .wire import (ALIGN, CastFormat, MinMaxFormat, OneBitFormat, Payload, QSGDFormat,
                   TopKFormat)

__all__ = [
    "compress_cast", "sum_halves", "compress_minmax", "compress_qsgd", "compress_onebit",
    "compress_topk", "compress_randk", "minmax_errors", "decompress", "decompress_many",
    "compress_minmax_rows", "compress_qsgd_rows", "compress_onebit_rows", "decompress_rows",
    "row_seed",
    "merge_topk", "restore_unselected", "scale_topk_values", "scale_topk_stack",
    "launch_count", "scratch_allocations", "release_scratch", "reset_launch_count",
    "Payload", "CastFormat", "MinMaxFormat", "QSGDFormat", "OneBitFormat", "TopKFormat", "ALIGN",
    "KernelError", "KernelParameterError", "KernelTypeError", "LayoutError", "PayloadError",
    "DeviceMismatchError", "CudaUnavailableError",
]
