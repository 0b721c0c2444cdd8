"""Scratch arrays that the kernels reuse from call to call.

Top-k's selection state, histogram, per-tile counts and candidates, gTop-k's
union and the partials of long chunks used to be fresh ``device_array``s on
every call: a cudaMalloc each, and a cudaFree when the array died, which waits
for the whole device.  ``scratch`` keeps one array per (device, host thread,
stream, name, dtype), grown to the largest size asked for, and returns a view
of it.  The device is part of the key because one thread launches on several:
the communication thread runs each bucket with its own GPU current, and the
default stream's handle is the same on every device.

Why reuse is safe: every user of a scratch array launches its kernels on one
stream, so the next call's kernels run after this call's finish; keying by
host thread keeps two threads that launch on the same stream (their launches
interleave) from sharing one.  Arrays that must start zeroed are zeroed when
allocated only, and their users leave them zeroed (the selection's histogram
and ticket), so a steady state allocates and launches nothing here.
``numba_kernels.device_allocations()`` counts the allocations;
``release_scratch()`` drops every cached array.
"""
import threading

import numpy as np

from .. import _device
from .._device import empty

_cache = {}


def _stream_key(stream):
    """A stable key for a stream: the handle's value (a new wrapper object of the same
    ``cudaStream_t`` every call must find the same arrays)."""
    if isinstance(stream, int):
        return stream
    try:
        return int(stream)
    except TypeError:
        return id(stream)


def scratch(name, shape, dtype, stream, on_allocate=None):
    """A device array of ``shape`` and ``dtype`` for this thread's calls on ``stream``.

    Its contents are whatever the last user left.  ``on_allocate(array)`` runs when the
    array is (re)allocated: users that keep an invariant, such as a zeroed histogram, set
    it up there.  Device launches: none, except those of ``on_allocate``.
    """
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    size = int(np.prod(shape, dtype=np.int64))
    key = (_device.current_device_id(), threading.get_ident(), _stream_key(stream), name,
           np.dtype(dtype))
    arr = _cache.get(key)
    if arr is None or arr.size < max(size, 1):
        arr = empty(max(size, 1), dtype, True, stream)   # counted there
        if on_allocate is not None:
            on_allocate(arr)
        _cache[key] = arr
    view = arr if arr.size == size else arr[:size]
    return view if len(shape) == 1 else view.reshape(shape)


def release_scratch():
    """Drop every cached scratch array (their memory returns when Numba frees them)."""
    _cache.clear()

