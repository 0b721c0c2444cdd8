"""Process-wide counts of the kernel launches and device allocations that numba_kernels
makes.

bagua_mpi's "host overhead per bucket" accounting reads these: most of the host
time a compressed collective spends is kernel launches, and an allocation is a
cudaMalloc whose cudaFree later waits for the whole device.  ``_cuda/launch.py``
bumps the launches, because every launch goes through it, and ``_device.empty``
the allocations (kernel scratch, and results of calls given no ``out=``).  No
numba_kernels function waits for the device (reads device memory on the host),
so there is no wait to count; the simulator tests check that no call copies
device memory to the host or synchronises.

Pure Python (no numba.cuda), so the package exports the readers without
loading the CUDA driver.
"""
import itertools
import threading


class _Count:
    """A count that the hot path bumps without taking a lock.

    ``add`` is ``itertools.count.__next__``: one C call, atomic under the GIL, so
    threads that launch at the same time never lose a bump, and it costs well
    under 0.1 microsecond (a locked ``+= 1`` costs two to five times as much, and
    a kernel launch several microseconds).  An ``itertools.count`` cannot be read
    without advancing it, so ``value`` takes one tick itself and remembers how
    many ticks reading has taken.
    """

    def __init__(self):
        self._lock = threading.Lock()       # serialises readers and resets, never ``add``
        self.reset()

    def reset(self):
        with self._lock:
            self._ticks = itertools.count()
            self._read_ticks = 0
            self.add = self._ticks.__next__

    def value(self):
        with self._lock:
            value = next(self._ticks) - self._read_ticks
            self._read_ticks += 1
            return value


_launches = _Count()
_allocations = _Count()


def count_launch():
    """Record one kernel launch."""
    _launches.add()


def count_allocation():
    """Record one device allocation (``_device.empty``)."""
    _allocations.add()


def launch_count() -> int:
    """CUDA kernel launches made by numba_kernels in this process since the last reset."""
    return _launches.value()


def device_allocations() -> int:
    """Device arrays allocated since the last reset (kernel scratch, and the result of a call
    given no ``out=``): each is a cudaMalloc, and later a cudaFree, which waits for the whole
    device. None in a caller's steady state that keeps its outputs."""
    return _allocations.value()


def release_scratch() -> None:
    """Drop the kernels' cached scratch arrays (every thread's and stream's; the largest are
    top-k's candidates, 12 bytes each, a few times k).  They are allocated again on the next
    device call.  Nothing to do when no device call has been made."""
    import sys

    scratch = sys.modules.get("numba_kernels._cuda.scratch")
    if scratch is not None:
        scratch.release_scratch()


def reset_launch_count() -> None:
    """Set the launch and scratch allocation counts back to zero."""
    _launches.reset()
    _allocations.reset()
