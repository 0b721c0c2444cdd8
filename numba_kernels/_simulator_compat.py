"""Keep Numba's CUDA simulator from losing ``cuda`` in the middle of a device function.

The simulator runs each simulated thread as a Python thread, and to run a device function it
swaps the ``cuda`` name in that function's module for its fake module, restoring it on return.
Two simulated threads inside functions of one module race: the one that swapped first restores
the real module on return while the other is still running, which then fails with
``AttributeError: module 'numba.cuda' has no attribute 'syncthreads'`` (seen once in three CI
runs: ``block_lane_sum`` and ``load_c`` share ``_cuda/common.py``). Counting the threads inside
each module's functions, and restoring only when the last one leaves, removes the race; with
one thread it does exactly what the simulator did.
"""
import contextlib
import threading

_lock = threading.Lock()
_inside = {}   # id of a module's globals -> [threads inside its functions, the names swapped]


@contextlib.contextmanager
def _swapped_cuda_module(fn, fake_cuda_module):
    from numba import cuda
    globs = fn.__globals__
    key = id(globs)
    with _lock:
        entry = _inside.get(key)
        if entry is None:
            names = [k for k, v in globs.items() if v is cuda]
            globs.update((k, fake_cuda_module) for k in names)
            entry = _inside[key] = [0, names, cuda]
        entry[0] += 1
    try:
        yield
    finally:
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                globs.update((k, entry[2]) for k in entry[1])
                del _inside[key]


def make_simulator_thread_safe() -> None:
    """Install the counting swap in the simulator (only where it runs)."""
    from numba import config
    if not config.ENABLE_CUDASIM:
        return
    from numba.cuda.simulator import kernel, kernelapi
    kernel.swapped_cuda_module = _swapped_cuda_module
    kernelapi.swapped_cuda_module = _swapped_cuda_module
