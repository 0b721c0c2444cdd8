"""A race check for Numba's CUDA simulator (``NUMBA_KERNELS_RACECHECK=1``).

The simulator runs a block's threads as Python threads that switch rarely, and a kernel's
blocks one after another, so a missing barrier or two blocks writing one word almost never
show as a wrong result there, while on a GPU warps (and, since Volta, the lanes of one warp)
run in any order between barriers and blocks in any order at all. This check makes such bugs
fail every time.

Shared memory: each static ``cuda.shared.array`` is handed out wrapped, and every element
remembers its last write and the reads and atomics since, each stamped with the thread, its
warp and two clocks: the block barriers (``syncthreads``) the thread has passed and the warp
calls (``_simulator_warps``) it has made. Two accesses to one element by different threads, at
least one a write, are ordered only when a block barrier lies between them, or, within one warp,
a warp call. Atomics do not race with each other (they do with plain accesses). Dynamic shared
memory is not checked (the kernels use none). A block's shared memory is its own on a GPU, so
the records start afresh with each block.

Device memory: the plain writes of a launch are recorded by byte address (see
``_GlobalWrites``); two threads writing different values to one byte race unless one block's
barrier orders them.

Either raises ``MemoryRace``, naming the array, the element and both threads.
"""
import os
import sys
import threading

import numpy as np
from numba.core import types
from numba.np import numpy_support

from ._simulator_compat import shared_array_of_line
from .errors import MemoryRace

WARP_SIZE = 32


def _stamp(thread):
    return (thread.thread_id, thread.thread_id // WARP_SIZE,
            getattr(thread, "_nk_barriers", 0), getattr(thread, "_nk_warp_calls", 0))


def _ordered(before, after):
    """Whether access ``before`` happens before ``after`` (stamps, ``after`` the later)."""
    tid, warp, barriers, calls = before
    tid2, warp2, barriers2, calls2 = after
    return (tid == tid2 or barriers < barriers2
            or (warp == warp2 and barriers == barriers2 and calls < calls2))


class CheckedShared:
    """A 1-D shared array whose element accesses are checked (see the module)."""

    def __init__(self, data, where):
        self._data = data
        self._where = where
        self._lock = threading.Lock()
        self._block = None
        # per element: the last plain write's stamp, and the atomics and the reads since it,
        # each thread's last
        self._writes = {}
        self._atomics = {}
        self._reads = {}

    shape = property(lambda self: self._data.shape)
    size = property(lambda self: self._data.size)
    dtype = property(lambda self: self._data.dtype)

    def __len__(self):
        return len(self._data)

    def _index(self, i):
        if isinstance(i, (slice, tuple)):
            raise NotImplementedError(f"shared array of {self._where}: the race check takes "
                                      f"integer indices only, got {i!r}")
        i = int(i)
        return i + self._data.size if i < 0 else i

    def _race(self, i, first, other, then, now):
        verb = {"atomic": "updated atomically"}
        return MemoryRace(
            f"shared array of {self._where}, element {i}: {verb.get(first, first)} by thread "
            f"{other[0]} (warp {other[1]}), then {verb.get(then, then)} by thread {now[0]} (warp "
            f"{now[1]}) of block {self._block}, with no syncthreads between them (nor a warp "
            "call, in one warp)")

    def _access(self, i, kind):
        """Check and record access ``kind`` ("read", "written" or "atomic") of element i; the
        race found, if any."""
        thread = threading.current_thread()
        now = _stamp(thread)
        block = tuple(thread.blockIdx)
        if block != self._block:
            self._block = block
            self._writes.clear()
            self._atomics.clear()
            self._reads.clear()
        last = self._writes.get(i)
        if last is not None and not _ordered(last, now):
            return self._race(i, "written", last, kind, now)
        # reads do not race with reads, nor atomics with atomics
        earlier = [] if kind == "atomic" else [("atomic", self._atomics.get(i, {}))]
        if kind != "read":
            earlier.append(("read", self._reads.get(i, {})))
        for what, stamps in earlier:
            for other in stamps.values():
                if not _ordered(other, now):
                    return self._race(i, what, other, kind, now)
        if kind == "written":
            self._writes[i] = now
            self._atomics.pop(i, None)
            self._reads.pop(i, None)
        else:
            (self._reads if kind == "read" else self._atomics).setdefault(i, {})[now[0]] = now
        return None

    def __getitem__(self, i):
        i = self._index(i)
        with self._lock:
            race = self._access(i, "read")
        if race is not None:
            raise race
        return self._data[i]

    def __setitem__(self, i, value):
        i = self._index(i)
        with self._lock:
            race = self._access(i, "written")
        if race is not None:
            raise race
        self._data[i] = value

    def atomic(self, i, update):
        """data[i] = update(data[i]) as one atomic operation; returns the old value."""
        i = self._index(i)
        with self._lock:
            race = self._access(i, "atomic")
            if race is None:
                old = self._data[i]
                self._data[i] = update(old)
        if race is not None:
            raise race
        return old


def _checked_array(self, shape, dtype):
    """``cuda.shared.array`` with the check: one array per line of the kernel's source, as the
    simulator keys them (its own ``array`` finds the line by its caller, which this is)."""
    if shape == 0:
        return _original_array(self, shape, dtype)
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    frame = sys._getframe(1)
    key = ("racecheck", frame.f_code.co_filename, frame.f_lineno)

    def make():
        where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        return CheckedShared(np.empty(shape, dtype), where)
    return shared_array_of_line(self._allocations, key, make)


def _atomic(name, update):
    original = getattr(_atomic_class, name)

    def checked(self, array, index, val):
        if isinstance(array, CheckedShared):
            return array.atomic(index, lambda old: update(old, val))
        flag = _global_writes.atomic
        flag.depth = getattr(flag, "depth", 0) + 1
        try:
            return original(self, array, index, val)
        finally:
            flag.depth -= 1
    return checked


class _GlobalWrites:
    """The plain writes to device memory of the running launch, by byte address: two threads
    writing different values to one byte is a race unless they are in one block with a barrier
    (or, in one warp, a warp call) between them. Blocks run one after another in the
    simulator, so the last block's value wins there every time; on a GPU any block may write
    last. Equal values are left alone (either order leaves the same byte: the payload's zeroed
    padding and the zero bits of its last word, for one). So are atomics (the kernels order a
    last block's plain writes after the others' atomics by a ticket, which this does not
    model) and reads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.kernel = None
        self.writes = {}    # byte address -> (block, stamp, the byte written)
        self.arrays = {}    # id of an array written in this launch -> (the array, its address)
        self.atomic = threading.local()

    def start(self, kernel):
        with self.lock:
            self.kernel = kernel
            self.writes = {}
            self.arrays = {}

    def _address(self, ary):
        """The address of ``ary``'s first byte, asked once per array and launch (the array is
        held, so that its id is not reused within the launch)."""
        known = self.arrays.get(id(ary))
        if known is None:
            known = self.arrays[id(ary)] = (ary, ary.__array_interface__["data"][0])
        return known[1]

    def write(self, ary, idx, write):
        """``write()`` (element ``idx`` of ``ary`` = a value), checked and recorded when idx is
        an integer or a tuple of them (a slice's writes are not checked)."""
        key = idx if isinstance(idx, tuple) else (idx,)
        if (getattr(self.atomic, "depth", 0) or self.kernel is None or len(key) != ary.ndim
                or not all(isinstance(k, (int, np.integer)) for k in key)):
            return write()
        start = self._address(ary)
        for k, n, stride in zip(key, ary.shape, ary.strides):
            k = int(k)
            start += (k + n if k < 0 else k) * stride
        thread = threading.current_thread()
        block, now = tuple(thread.blockIdx), _stamp(thread)
        with self.lock:
            write()
            written = ary[key].tobytes()
            for address, byte in enumerate(written, start):
                last = self.writes.get(address)
                if (last is not None and last[2] != byte
                        and not (last[0] == block and _ordered(last[1], now))):
                    raise MemoryRace(
                        f"{self.kernel}: element {key} of a {ary.dtype}{list(ary.shape)} device "
                        f"array: thread {last[1][0]} of block {last[0]} and thread {now[0]} of "
                        f"block {block} wrote different values to its byte {address - start} "
                        "in one launch, with no barrier between them (on a GPU either may "
                        "write last)")
                self.writes[address] = (block, now, byte)


_global_writes = _GlobalWrites()


def _checked_global_setitem(self, idx, val):
    _global_writes.write(self._item._ary, idx, lambda: _original_global_setitem(self, idx, val))


def _recording_launch(self, *args):
    if not self._device:
        _global_writes.start(getattr(self.fn, "__qualname__", repr(self.fn)))
    return _original_launch(self, *args)


def _counting_syncthreads(self):
    _original_syncthreads(self)
    self._nk_barriers = getattr(self, "_nk_barriers", 0) + 1


def warp_call_made(thread):
    """Called by the simulated warp intrinsics once the warp's lanes have all arrived."""
    thread._nk_warp_calls = getattr(thread, "_nk_warp_calls", 0) + 1


_original_array = _original_syncthreads = _atomic_class = None
_original_global_setitem = _original_launch = None


def install():
    """Switch the check on where the simulator runs and ``NUMBA_KERNELS_RACECHECK=1``."""
    global _original_array, _original_syncthreads, _atomic_class
    global _original_global_setitem, _original_launch
    from numba import config
    if not config.ENABLE_CUDASIM or os.environ.get("NUMBA_KERNELS_RACECHECK") != "1":
        return
    if _original_array is not None:
        return
    from numba.cuda.simulator import kernel, kernelapi
    from numba.cuda.simulator.cudadrv.devicearray import FakeWithinKernelCUDAArray
    _original_array = kernelapi.FakeCUDAShared.array
    _original_syncthreads = kernel.BlockThread.syncthreads
    _atomic_class = kernelapi.FakeCUDAAtomic
    _original_global_setitem = FakeWithinKernelCUDAArray.__setitem__
    _original_launch = kernel.FakeCUDAKernel.__call__
    kernelapi.FakeCUDAShared.array = _checked_array
    kernel.BlockThread.syncthreads = _counting_syncthreads
    FakeWithinKernelCUDAArray.__setitem__ = _checked_global_setitem
    kernel.FakeCUDAKernel.__call__ = _recording_launch
    # the atomics the kernels use (any other reaches a checked array as a plain read and write)
    for name, update in [("add", lambda a, b: a + b), ("or_", lambda a, b: a | b),
                         ("exch", lambda a, b: b)]:
        setattr(_atomic_class, name, _atomic(name, update))
