"""Where an algorithm's data lives while it is exchanged: the one place that moves tensors.

The compressors' host twins and the NumPy-based primitives read contiguous CPU float32; MPI
reads host memory, or device memory when it is CUDA-aware; MPI cannot add bfloat16. These
context managers give each step the form it needs and write results back on a clean exit,
copying only when the tensor is not already in that form (a CPU float32 flat bucket, the
common case, is used in place). No code path calls ``.numpy()`` on a device tensor.
"""
from __future__ import annotations

import contextlib

import torch

from ..accounting import staging
from ..buffers import mpi_buffer

_HALF = (torch.float16, torch.bfloat16)


def _work_dtype(t: torch.Tensor, keep_float64: bool) -> torch.dtype:
    return torch.float64 if keep_float64 and t.dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def _flat(t: torch.Tensor, device, dtype: torch.dtype):
    """``t`` as a flat contiguous ``dtype`` tensor on ``device`` (itself when it already is
    one); a copy is written back into ``t`` on a clean exit."""
    if t.dtype == dtype and t.device == device and t.is_contiguous():
        yield t.detach().reshape(-1)
        return
    work = t.detach().to(device=device, dtype=dtype).contiguous().reshape(-1)
    yield work
    with torch.no_grad():
        t.copy_(work.view_as(t))


@contextlib.contextmanager
def float32(t: torch.Tensor, keep_float64: bool = False):
    """``t`` as a flat contiguous float32 tensor *where it lives* (float64 stays float64 with
    ``keep_float64``: model averaging keeps its precision). Device tensors stay on their
    device, for the primitives with device paths."""
    with _flat(t, t.device, _work_dtype(t, keep_float64)) as work:
        yield work


@contextlib.contextmanager
def float32_all(tensors: list[torch.Tensor]):
    """``float32`` for several tensors at once: yields the list of their float32 forms."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(float32(t)) for t in tensors]


@contextlib.contextmanager
def reducible(t: torch.Tensor):
    """An MPI buffer holding ``t``'s values in a dtype MPI can add (16-bit floats as float32);
    a pinned host copy of a device tensor when the MPI is not CUDA-aware."""
    work = t.detach()
    if work.dtype in _HALF:
        work = work.float()
    elif not work.is_contiguous():
        work = work.contiguous()
    buf = mpi_buffer(work)
    _count_dense(work, buf)
    yield buf.obj
    buf.writeback()
    if work.data_ptr() != t.data_ptr() or work.dtype != t.dtype:
        with torch.no_grad():
            t.copy_(work)


@contextlib.contextmanager
def movable(t: torch.Tensor):
    """An MPI buffer holding ``t``'s bits (for broadcasts and point-to-point moves)."""
    buf = mpi_buffer(t)
    _count_dense(t, buf)
    yield buf.obj
    buf.writeback()


def _count_dense(t: torch.Tensor, buf) -> None:
    """A device tensor that MPI gets as a host copy is a dense staging copy: count it."""
    if t.is_cuda and not isinstance(buf.obj, torch.Tensor):
        staging.d2h(t.numel() * t.element_size(), dense=True)
        staging.h2d(t.numel() * t.element_size())
