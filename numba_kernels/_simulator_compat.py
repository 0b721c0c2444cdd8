"""Two races of Numba's CUDA simulator between the threads of one block, mended.

Losing ``cuda`` in the middle of a device function.

The simulator runs each simulated thread as a Python thread, and to run a device function it
swaps the ``cuda`` name in that function's module for its fake module, restoring it on return.
Two simulated threads inside functions of one module race: the one that swapped first restores
the real module on return while the other is still running, which then fails with
``AttributeError: module 'numba.cuda' has no attribute 'syncthreads'`` (seen once in three CI
runs: ``block_lane_sum`` and ``load_c`` share ``_cuda/common.py``). Here a device function's
call puts the fake module in and leaves it there; the kernel's own swap, made by the launching
thread around all of the kernel's blocks, puts the real module back into every module touched
when the kernel ends. A lock around a per-call count fixed the race too, but made the simulator
suite six times slower: hundreds of simulated threads queued on it. Like the simulator itself,
whose kernel context is one global, this assumes one kernel runs at a time.

Splitting a shared array. The simulator hands each line's ``cuda.shared.array`` to a block's
threads from a dict: the first thread to look finds nothing and stores a new array. Two threads
that both look before either stores each get an array of their own, and the block's shared
memory is split: writes made through one are never seen through the other. This showed as a
wrong top-k merge once in a full run of the suite, and happens in 1-2% of launches of a
64-thread kernel with a short switch interval. Here the store is ``dict.setdefault``, one step
under the interpreter lock, so every thread gets the array stored first. The line is found from
the caller's frame, not from a formatted stack of the whole call chain as the simulator does,
which is also faster.
"""
import contextlib
import sys
import threading

import numpy as np

_touched = {}   # id of a module's globals -> (the globals, the names that held ``cuda``)


@contextlib.contextmanager
def _swapped_cuda_module(fn, fake_cuda_module):
    from numba import cuda
    from numba.cuda.simulator.kernel import BlockThread
    globs = fn.__globals__
    names = [k for k, v in globs.items() if v is cuda]
    if names:
        _touched.setdefault(id(globs), (globs, names))
        globs.update((k, fake_cuda_module) for k in names)
    try:
        yield
    finally:
        if not isinstance(threading.current_thread(), BlockThread):
            # the kernel's swap: no simulated thread is left inside any module
            while _touched:
                globs, names = _touched.popitem()[1]
                globs.update((k, cuda) for k in names)


def shared_array_of_line(allocations, key, make):
    """The array stored under ``key`` (a kernel's source line) in one launch's shared
    allocations, made by ``make()`` and stored by the first thread to ask; every thread of the
    block gets that one, even when several made one at once."""
    array = allocations.get(key)
    if array is None:
        array = allocations.setdefault(key, make())
    return array


def _shared_array(self, shape, dtype):
    """``cuda.shared.array``: the simulator's, with one array per source line for certain."""
    from numba.core import types
    from numba.np import numpy_support
    if shape == 0:
        return _original_shared_array(self, shape, dtype)
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    caller = sys._getframe(1)
    return shared_array_of_line(self._allocations,
                                (caller.f_code.co_filename, caller.f_lineno),
                                lambda: np.empty(shape, dtype))


_original_shared_array = None


def make_simulator_thread_safe() -> None:
    """Install the race-free swap and shared arrays in the simulator (only where it runs)."""
    global _original_shared_array
    from numba import config
    if not config.ENABLE_CUDASIM or _original_shared_array is not None:
        return
    from numba.cuda.simulator import kernel, kernelapi
    kernel.swapped_cuda_module = _swapped_cuda_module
    kernelapi.swapped_cuda_module = _swapped_cuda_module
    _original_shared_array = kernelapi.FakeCUDAShared.array
    kernelapi.FakeCUDAShared.array = _shared_array
