"""``ilp_chunks`` (numba_kernels/_cuda/common.py), the decoders' chunk indices, run as plain
Python at a real GPU's block width.

Under the CUDA simulator blocks have 32 threads and no chunk is shorter than 32, so a thread's
group of elements (a block's width apart) never crosses more than one chunk boundary between
two elements there; on a GPU (256 threads) a chunk of 32-255 elements is crossed several times.
This test checks that case against integer division, without a GPU or the simulator, for the
ILP elements of the element decoders and the GROUPS groups of the word decoders (min-max and
1-bit, which pass chunks counted in groups).
"""
import types

import numpy as np
import pytest

from numba_kernels._cuda import common
from numba_kernels._cuda.geometry import GROUPS, ILP

GPU_THREADS = 256


def as_python(device_function, **names):
    """The device function's Python source as a plain function, with ``names`` replacing
    the module's globals (the device functions it calls, the block width)."""
    py = device_function.py_func
    return types.FunctionType(py.__code__, dict(py.__globals__, **names))


ilp_index = as_python(common.ilp_index, lesser=common.lesser.py_func, THREADS=GPU_THREADS)
ilp_chunks = as_python(common.ilp_chunks, ilp_index=ilp_index)


@pytest.mark.parametrize("count", sorted({ILP, GROUPS}))
@pytest.mark.parametrize("chunk", [8, 32, 40, 96, 255, 256, 257, 1024, 4096, 10**8])
def test_chunk_indices_are_the_divisions(chunk, count):
    idx = np.zeros(count, np.int64)
    cix = np.zeros(count, np.int64)
    for n in (1, 5, 300, 1100, 5000):
        for base in sorted(b for b in {0, 1, 31, 255, 256, 700, n // 2, n - 1} if b < n):
            ilp_chunks(base, n, chunk, idx, cix, count)
            want = [min(base + u * GPU_THREADS, n - 1) for u in range(count)]
            assert idx.tolist() == want, (chunk, n, base)
            assert cix.tolist() == [i // chunk for i in want], (chunk, n, base)
