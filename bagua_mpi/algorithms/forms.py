"""The form an algorithm's tensors take while a primitive works on them: flat, contiguous
float32 (float64 kept where asked), *where the tensor lives*.

The compressors and the primitives read contiguous float32 on the host or on the tensor's
GPU. These context managers give each step that form and write results back on a clean exit,
copying only when the tensor is not already in it (a float32 flat bucket, the common case, is
used in place). Moving data between ranks, and between device and host where a wire needs it,
is ``transport.py``'s job, not this module's.
"""
from __future__ import annotations

import contextlib

import torch

from ..layout import autograd_strides, flat_alias


def _work_dtype(t: torch.Tensor, keep_float64: bool) -> torch.dtype:
    return torch.float64 if keep_float64 and t.dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def _flat(t: torch.Tensor, device, dtype: torch.dtype):
    """``t`` as a flat contiguous ``dtype`` tensor on ``device``, its elements in ``t``'s memory
    order (``layout.py``: a bucket's order): a view of ``t`` when it already is one (a dense
    tensor such as a ``channels_last`` gradient included), else a copy, written back into ``t``
    on a clean exit."""
    strides = autograd_strides(t)
    if t.dtype == dtype and t.device == device and t.stride() == strides:
        yield flat_alias(t.detach())
        return
    work = torch.empty_strided(t.shape, strides, dtype=dtype, device=device)
    work.copy_(t.detach())
    yield flat_alias(work)
    with torch.no_grad():
        t.copy_(work)


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
def float32_flat(bucket):
    """A flattened bucket's gradient buffer as one flat float32 tensor where it lives: the
    buffer itself when it is float32 (the same object every step until it is replaced, so an
    exchange may keep what it plans of it: ``AlgorithmImpl.kept_plan``), else a float32 copy,
    written back on a clean exit."""
    if bucket.flat_grad.dtype == torch.float32:
        yield bucket.flat_grad
        return
    with float32(bucket.flat_grad) as work:
        yield work


@contextlib.contextmanager
def float32_layers(bucket):
    """A bucket's gradients as flat float32 tensors where they live, one a parameter in its
    memory order: slices of one float32 form of the bucket's flat buffer (the buffer itself
    when it is float32, as the bucket's own kept list, ``Bucket.layer_grads``; else one copy,
    written back on a clean exit, where a copy a tensor cost one launch each way a tensor), so
    an exchange can also take them as one array. Without a flat buffer (``flatten=False``),
    each gradient's own ``float32`` form."""
    if bucket.flat_grad is None:
        with float32_all(bucket.grad_views()) as grads:
            yield grads
        return
    if bucket.flat_grad.dtype == torch.float32:
        yield bucket.layer_grads()
        return
    with float32(bucket.flat_grad) as work:
        yield [work[start:start + numel]
               for start, numel in zip(bucket.offsets, bucket.real_numels)]
