"""Numba's CUDA simulator mended: two races between the threads of one block, and two slow lookups.

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

The swap's cost. The swap was a generator context that ran its imports and scanned all of
the module's globals on every device function's call; here it is a plain class, and a module
is swapped once per launch. An array's attributes: inside a kernel the simulator
looks up every attribute of an array (``x.size``, ``x.shape``) in a ``dir()`` of the NumPy
array built anew each time; here the names come from a set made once per array type. On a
long-chunk row case (``check_rows``, 4130 elements) the two took 1.8 s and 2.2 s of its 7.4 s
of CPU.
"""
import sys
import threading

import numpy as np

_touched = {}   # id of a module's globals -> (the globals, the names that held ``cuda``)
_first_touch = threading.Lock()


class _SwappedCudaModule:
    """``swapped_cuda_module(fn, fake_cuda_module)``, the simulator's context around a kernel's
    launch (on the launching thread) and around each device function's call (on a simulated
    thread): the fake module in, and the real one back once the kernel ends."""

    __slots__ = ("launching",)

    def __init__(self, fn, fake_cuda_module):
        globs = fn.__globals__
        self.launching = not isinstance(threading.current_thread(), _BlockThread)
        # a module is swapped once per launch, not scanned on every device call
        if self.launching or id(globs) not in _touched:
            _put_fake_module(globs, fake_cuda_module)

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        if self.launching:
            # the kernel's swap: no simulated thread is left inside any module
            from numba import cuda
            while _touched:
                globs, names = _touched.popitem()[1]
                globs.update((k, cuda) for k in names)


def _put_fake_module(globs, fake_cuda_module):
    """Swap ``cuda`` for the fake module in one module's globals and record the names. Under a
    lock, and recorded only once swapped, so that a thread that finds the module recorded
    finds the fake module in it."""
    from numba import cuda
    with _first_touch:
        names = [k for k, v in globs.items() if v is cuda]
        globs.update(dict.fromkeys(names, fake_cuda_module))
        _touched.setdefault(id(globs), (globs, []))[1].extend(names)


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


_ARRAY_NAMES = {}   # type of the NumPy array under a device array -> its attribute names


def _array_attribute(self, name):
    """``FakeWithinKernelCUDAArray.__getattr__``: the NumPy array's attribute where it has one,
    else the field of that name (record arrays), wrapped for the kernel as the simulator does;
    AttributeError when neither is there."""
    item = self._item
    array = item._ary
    names = _ARRAY_NAMES.get(type(array))
    if names is None:
        names = _ARRAY_NAMES.setdefault(type(array), frozenset(dir(array)))
    try:
        value = getattr(array, name) if name in names else item[name]
    except Exception as e:
        raise AttributeError(name) from e
    return _FakeWithinKernelCUDAArray(value) if isinstance(value, _FakeCUDAArray) else value


_FakeCUDAArray = _FakeWithinKernelCUDAArray = _BlockThread = None


def mend_simulator() -> None:
    """Install the race-free swap and shared arrays and the attribute lookup in the simulator
    (only where it runs)."""
    global _original_shared_array, _FakeCUDAArray, _FakeWithinKernelCUDAArray, _BlockThread
    from numba import config
    if not config.ENABLE_CUDASIM or _original_shared_array is not None:
        return
    from numba.cuda.simulator import kernel, kernelapi
    from numba.cuda.simulator.cudadrv import devicearray
    _FakeCUDAArray = devicearray.FakeCUDAArray
    _FakeWithinKernelCUDAArray = devicearray.FakeWithinKernelCUDAArray
    _FakeWithinKernelCUDAArray.__getattr__ = _array_attribute
    _BlockThread = kernel.BlockThread
    kernel.swapped_cuda_module = _SwappedCudaModule
    kernelapi.swapped_cuda_module = _SwappedCudaModule
    _original_shared_array = kernelapi.FakeCUDAShared.array
    kernelapi.FakeCUDAShared.array = _shared_array
