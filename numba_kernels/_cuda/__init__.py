"""CUDA kernels of numba_kernels.

These modules import ``numba.cuda`` at module level (the CUDA simulator finds
the ``cuda`` name in a kernel's globals to run it), so nothing outside this
package imports them until device data arrives.
"""
from .._numpy_compat import ensure_numba_cuda_can_load

ensure_numba_cuda_can_load()
