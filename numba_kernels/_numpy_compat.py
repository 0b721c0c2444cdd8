"""Keep numba-cuda compiling against NumPy releases newer than it knows.

numba-cuda (0.30.4 and earlier) registers a CUDA overload for ``np.row_stack``
when its typing registries load, which happens at the first kernel
compilation, not at import.  NumPy 2.5 removed that alias of ``np.vstack``, so
on such an install every kernel launch failed with ``AttributeError: module
'numpy' has no attribute 'row_stack'`` (seen on the GPU image with NumPy
2.5.2).  Restoring the alias, only where it is missing, is the smallest change
that lets the compiler load; ``row_stack`` was defined as ``vstack`` for as
long as NumPy had it, so code that uses the name gets what it always got.
"""
import numpy as np


def ensure_numba_cuda_can_load() -> None:
    """Give NumPy back the names numba-cuda's registries look up at load time."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
