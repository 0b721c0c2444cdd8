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


@contextlib.contextmanager
def host_float32(t: torch.Tensor, keep_float64: bool = False):
    """``t`` as a flat contiguous CPU float32 tensor (itself when it already is one); with
    ``keep_float64``, a float64 tensor stays float64 (model averaging keeps its precision)."""
    dtype = torch.float64 if keep_float64 and t.dtype == torch.float64 else torch.float32
    if t.dtype == dtype and not t.is_cuda and t.is_contiguous():
        yield t.detach().reshape(-1)
        return
    work = t.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1)
    if t.is_cuda:
        staging.d2h(t.numel() * t.element_size(), dense=True)
    yield work
    with torch.no_grad():
        t.copy_(work.view_as(t))
    if t.is_cuda:
        staging.h2d(t.numel() * t.element_size())


@contextlib.contextmanager
def float32(t: torch.Tensor):
    """``t`` as a flat contiguous float32 tensor *where it lives* (itself when it already is
    one): device tensors stay on their device, for the primitives with device paths."""
    if t.dtype == torch.float32 and t.is_contiguous():
        yield t.detach().reshape(-1)
        return
    work = t.detach().to(dtype=torch.float32).contiguous().reshape(-1)
    yield work
    with torch.no_grad():
        t.copy_(work.view_as(t))


@contextlib.contextmanager
def exchange_form(t: torch.Tensor, keep_float64: bool = False):
    """The form a model-averaging primitive exchanges: ``host_float32`` for a host tensor,
    and for a CUDA tensor a flat contiguous float32 (float64 with ``keep_float64``) tensor on
    its device: the decentralized primitives have device paths, so models stay there."""
    if not t.is_cuda:
        with host_float32(t, keep_float64) as work:
            yield work
        return
    dtype = torch.float64 if keep_float64 and t.dtype == torch.float64 else torch.float32
    if t.dtype == dtype and t.is_contiguous():
        yield t.detach().reshape(-1)
        return
    work = t.detach().to(dtype=dtype).contiguous().reshape(-1)
    yield work
    with torch.no_grad():
        t.copy_(work.view_as(t))


@contextlib.contextmanager
def float32_all(tensors: list[torch.Tensor]):
    """``float32`` for several tensors at once: yields the list of their float32 forms."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(float32(t)) for t in tensors]


@contextlib.contextmanager
def host_float32_all(tensors: list[torch.Tensor]):
    """``host_float32`` for several tensors at once: yields the list of staged forms."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(host_float32(t)) for t in tensors]


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
