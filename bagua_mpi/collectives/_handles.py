"""The public side of asynchronous operations: ``poll`` and ``synchronize`` a ``Handle``, and
``submit`` a custom MPI sequence to the same serial executor as the collectives."""
from __future__ import annotations

from .. import runtime
from ..worker import Handle
from ._core import has_named_handles, release_name


def poll(handle: Handle) -> bool:
    """True once the asynchronous operation behind ``handle`` has finished."""
    if not isinstance(handle, Handle):
        raise TypeError(f"poll() expects a bagua_mpi Handle, got {type(handle).__name__}")
    return handle.done()


def synchronize(handle: Handle, timeout: float | None = None):
    """Wait for ``handle``; return its result or raise its error (a ``BaguaMPIError``)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize() expects a bagua_mpi Handle, got {type(handle).__name__}")
    if has_named_handles():
        try:
            return handle.wait(timeout)
        finally:
            if handle.done():  # its name may be used again
                release_name(handle)
    return handle.wait(timeout)


def submit(fn, describe=("custom",), owned: tuple = ()) -> Handle:
    """Run ``fn()`` on the communication thread, in order with the collectives.

    For algorithms that issue their own MPI sequences (compressed or sparse payloads, peer
    exchanges): they run in the same serial order as every other library operation.
    """
    rt = runtime.get()
    if not callable(fn):
        raise TypeError(f"submit() expects a callable, got {fn!r}")
    return rt.worker.submit(fn, describe, owned)
