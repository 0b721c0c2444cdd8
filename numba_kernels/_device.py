"""Where data lives, and how the public functions reach it.

Inputs may be NumPy arrays, torch CPU tensors (used through ``.numpy()``
views, never copied) or anything exposing ``__cuda_array_interface__``
(torch CUDA tensors, CuPy arrays, Numba device arrays, used through
``cuda.as_cuda_array`` views).  ``numba.cuda`` is imported only when device
data is seen, so the package imports on machines without a GPU.
"""
import functools

import numpy as np

from . import _counters
from ._numpy_compat import ensure_numba_cuda_can_load
from .errors import (CudaUnavailableError, DeviceMismatchError, KernelTypeError,
                     LayoutError)

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def cuda():
    """The ``numba.cuda`` module, imported on first use."""
    ensure_numba_cuda_can_load()
    try:
        from numba import cuda as _cuda
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CudaUnavailableError(
            f"device data given but numba.cuda cannot be imported: {exc}") from exc
    return _cuda


def is_device(obj):
    """True for objects that live on a CUDA device."""
    # Numba device arrays (real or simulated) carry __cuda_ndarray__; a torch tensor says
    # is_cuda, where its interface would raise RuntimeError for one that requires grad
    if getattr(obj, "__cuda_ndarray__", False):
        return True
    is_cuda = getattr(obj, "is_cuda", None)
    if isinstance(is_cuda, bool):
        return is_cuda
    return hasattr(obj, "__cuda_array_interface__")


def as_array(obj, name):
    """Return ``(array, on_device)`` for ``obj`` without copying.

    Device objects become Numba device arrays; torch CPU tensors become NumPy
    views; NumPy arrays pass through.
    """
    if isinstance(obj, np.ndarray):
        return obj, False
    if getattr(obj, "__cuda_ndarray__", False):
        return obj, True
    if is_device(obj):   # a tensor that requires grad exports no interface: detached first
        return cuda().as_cuda_array(obj.detach() if getattr(obj, "requires_grad", False)
                                    else obj), True
    if hasattr(obj, "numpy") and getattr(getattr(obj, "device", None), "type", None) == "cpu":
        try:
            return obj.detach().numpy(), False
        except TypeError as exc:  # e.g. torch.bfloat16 has no NumPy dtype
            raise KernelTypeError(f"{name}: cannot view a torch tensor of dtype {obj.dtype} "
                                  f"through NumPy ({exc})") from exc
    raise KernelTypeError(f"{name}: expected a NumPy array, a torch tensor or a CUDA array, "
                          f"got {type(obj).__name__}")


def flat(obj, name, dtypes=FLOATS):
    """View ``obj`` as a contiguous 1-D array; return ``(array, on_device)``."""
    arr, dev = as_array(obj, name)
    dtype = np.dtype(arr.dtype)
    if dtypes is not None and dtype not in dtypes:
        raise KernelTypeError(f"{name}: dtype {dtype} not accepted; use one of "
                              f"{', '.join(str(d) for d in dtypes)}")
    if arr.size == 0:
        return arr.reshape(0), dev
    if not _c_contiguous(arr, dev):
        raise LayoutError(f"{name}: array of shape {tuple(arr.shape)} is not C-contiguous; "
                          "pass a contiguous tensor (e.g. .contiguous())")
    return arr.reshape(arr.size), dev


def _c_contiguous(arr, dev):
    if dev:
        return arr.is_c_contiguous()
    return arr.flags.c_contiguous


def same_place(where, **arrays):
    """Raise unless every non-None array in ``arrays`` is on the ``where`` side."""
    for name, (arr, dev) in arrays.items():
        if arr is not None and dev != where:
            side = "a CUDA device" if dev else "the host"
            other = "a CUDA device" if where else "the host"
            raise DeviceMismatchError(f"{name} lives on {side} but the input lives on {other}")


def stream_of(stream):
    """Normalise ``stream`` to a Numba stream (0 = the default stream).

    Accepts None, a Numba stream, an integer ``cudaStream_t`` handle, or any
    object with a ``cuda_stream`` handle attribute (``torch.cuda.Stream``).
    """
    if stream is None or stream == 0:
        return 0
    c = cuda()
    if isinstance(stream, int):
        return c.external_stream(stream)
    handle = getattr(stream, "cuda_stream", None)
    if handle is not None:
        return c.external_stream(handle)
    return stream


def current_device_id():
    """The id of the CUDA device current in this thread: what a cache of device memory is kept
    per. 0 where the process sees one device (the simulator too), without asking the driver:
    the question takes a lock and two driver calls, and the kernels' scratch asks it at every
    lookup."""
    if _one_device():
        return 0
    return cuda().current_context().device.id


@functools.cache
def _one_device() -> bool:
    return len(cuda().gpus) == 1


def empty(shape, dtype, dev, stream=0):
    """Uninitialised array on the host or the device; a device array is counted
    (``numba_kernels.device_allocations()``)."""
    if dev:
        _counters.count_allocation()
        return cuda().device_array(shape, dtype=dtype, stream=stream)
    return np.empty(shape, dtype=dtype)
