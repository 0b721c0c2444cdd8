"""The library's CUDA work runs on each device's default stream, whatever stream the caller has.

torch keeps a current stream per thread, and the communication thread's is the default one:
the compression kernels (Numba launches them on stream 0), torch's copies and NCCL's
collectives of an operation all run there, in one order. A training loop under
``torch.cuda.stream(s)`` puts its kernels on ``s`` instead, and PyTorch creates its streams
non-blocking, so nothing orders ``s`` with the default stream by itself: an exchange could read
gradients that backward is still writing, and the optimizer could read averaged gradients the
exchange is still writing. The executor (``worker.py``) keeps the two in order where work changes
hands, with waits in stream order (no host synchronisation):

1. ``entry_event(device)``, when an operation is queued: an event on the caller's stream, which
   the default stream waits for (``wait_for_entry``) before the operation runs;
2. ``caller_waits_for_library(device, result)``, when its handle is waited for: the waiting
   thread's stream waits for the default stream before the result is used;
3. ``on_the_library_stream(device)``, for an operation run at once on the caller's thread: the
   default stream current for its duration, with both waits around it.

After 2, and at the end of 3 (the function it yields), the CUDA tensors of the result are marked
as used on the caller's stream (``Tensor.record_stream``). Those the library allocated came from
the default stream's pool, to which the caching allocator returns a freed block at once;
unmarked, a tensor the caller frees while its own stream still reads it could be handed to the
library's next allocation and overwritten under that read.

Each does nothing where the caller's stream is the default one (the common case), for a host
device, and where torch has not initialized CUDA. Nothing here imports torch or initializes CUDA.
"""
from __future__ import annotations

import contextlib
import sys


def _cuda_streams(device):
    """(the calling thread's current stream, the default stream) on ``device`` where they
    differ; None where they are the same, or there is no CUDA work to order."""
    torch = sys.modules.get("torch")
    if (device is None or getattr(device, "type", "cuda") != "cuda" or torch is None
            or not torch.cuda.is_initialized()):
        return None
    current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    return None if current == default else (current, default)


def entry_event(device):
    """An event recorded on the calling thread's stream, for the default stream to wait for;
    None where the caller is on the default stream."""
    streams = _cuda_streams(device)
    if streams is None:
        return None
    import torch

    event = torch.cuda.Event()
    event.record(streams[0])
    return event


def wait_for_entry(device, event) -> None:
    """The default stream of ``device`` waits for ``event`` (``entry_event``'s)."""
    if event is not None:
        import torch

        torch.cuda.default_stream(device).wait_event(event)


def caller_waits_for_library(device, result=None) -> None:
    """The calling thread's stream waits for everything queued on the default stream so far,
    and takes the CUDA tensors of ``result`` (``_used_on``)."""
    streams = _cuda_streams(device)
    if streams is not None:
        streams[0].wait_stream(streams[1])
        _used_on(result, streams[0])


def _taken_by_nobody(result) -> None:
    """``on_the_library_stream``'s function where there is no other stream to mark."""


def _used_on(result, stream) -> None:
    """Mark the CUDA tensors of ``result`` (a tensor, or a tuple, list or dict holding them)
    as used on ``stream``."""
    if isinstance(result, (tuple, list)):
        for item in result:
            _used_on(item, stream)
    elif isinstance(result, dict):
        for item in result.values():
            _used_on(item, stream)
    elif getattr(result, "is_cuda", False) and hasattr(result, "record_stream"):
        result.record_stream(stream)


@contextlib.contextmanager
def on_the_library_stream(device):
    """Run the enclosed work with the default stream current, ordered after the caller's stream
    and before the caller's later work. Yields the function that marks the work's result as
    used on the caller's stream."""
    streams = _cuda_streams(device)
    if streams is None:
        yield _taken_by_nobody
        return
    import torch

    current, default = streams
    default.wait_stream(current)
    try:
        with torch.cuda.stream(default):
            yield lambda result: _used_on(result, current)
    finally:
        current.wait_stream(default)
