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
per-partition calls.  Min-max has a segmented form of both and of the stack decoder
(``compress_minmax_rows_segments``, ``decompress_minmax_segments``,
``decompress_minmax_rows_segments``): many tensors, each at its own width, side by side in
base arrays, in one launch for all of them, byte for byte the per-tensor calls. So has top-k,
with gTop-k's merge and decode (``compress_topk_segments``, ``merge_topk_segments``,
``decompress_topk_segments``): many tensors, each with its own k, their payloads side by side
in one message.

Every CUDA kernel launch is counted: ``launch_count()`` and
``device_allocations()`` (every device array the package allocates: kernel
scratch arrays, cached per thread and stream, so only the first calls
allocate, and ``release_scratch()`` frees them; and the result of a call
given no ``out=``) give the host overhead of a bucket's compression (no call makes the host wait
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
import importlib

# Where each public name lives. The submodules import numba (about 0.3 s per process), so
# they load on a name's first use, not with the package: bagua_mpi imports this package in
# every rank, and most ranks of a job that compresses nothing never touch a kernel.
_HOMES = {
    "launch_count": "._counters", "release_scratch": "._counters",
    "reset_launch_count": "._counters", "device_allocations": "._counters",
    "row_seed": "._scalar",
    "compress_cast": ".casts", "sum_halves": ".casts",
    "decompress": ".dispatch", "decompress_many": ".dispatch", "decompress_rows": ".dispatch",
    "CudaUnavailableError": ".errors", "DeviceMismatchError": ".errors", "KernelError": ".errors",
    "KernelParameterError": ".errors", "KernelTypeError": ".errors", "LayoutError": ".errors",
    "PayloadError": ".errors",
    "merge_topk": ".merge", "restore_unselected": ".merge", "scale_topk_stack": ".merge",
    "scale_topk_values": ".merge",
    "compress_minmax": ".minmax", "compress_minmax_rows": ".minmax", "minmax_errors": ".minmax",
    "MinMaxSegment": ".minmax_segments",
    "compress_minmax_rows_segments": ".minmax_segments",
    "decompress_minmax_rows_segments": ".minmax_segments",
    "decompress_minmax_segments": ".minmax_segments",
    "compress_onebit": ".onebit", "compress_onebit_rows": ".onebit",
    "compress_qsgd": ".qsgd", "compress_qsgd_rows": ".qsgd",
    "compress_randk": ".topk", "compress_topk": ".topk",
    "TopKSegment": ".topk_segments", "compress_topk_segments": ".topk_segments",
    "decompress_topk_segments": ".topk_segments", "merge_topk_segments": ".topk_segments",
    "ALIGN": ".wire", "CastFormat": ".wire", "MinMaxFormat": ".wire", "OneBitFormat": ".wire",
    "Payload": ".wire", "QSGDFormat": ".wire", "TopKFormat": ".wire",
}


def __getattr__(name):
    """Import the submodule that defines ``name`` on first use (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))


__all__ = sorted(_HOMES)
