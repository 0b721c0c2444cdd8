"""Keep Numba's CUDA simulator from losing ``cuda`` in the middle of a device function.

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
"""
import contextlib
import threading

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


def make_simulator_thread_safe() -> None:
    """Install the race-free swap in the simulator (only where it runs)."""
    from numba import config
    if not config.ENABLE_CUDASIM:
        return
    from numba.cuda.simulator import kernel, kernelapi
    kernel.swapped_cuda_module = _swapped_cuda_module
    kernelapi.swapped_cuda_module = _swapped_cuda_module
