"""Memory layouts of parameters: a bucket holds each parameter as the parameter lies in memory.

Autograd gives a parameter's gradient the parameter's own strides whenever the parameter is
dense (no gaps, no overlaps: row-major, ``channels_last``, a transpose), and row-major strides
otherwise; PyTorch calls this the gradient layout contract. A bucket's flat buffer follows the
same rule: parameter k's elements sit at ``offsets[k]...`` in the order they have in memory, and
its ``.grad`` (and its ``.data``, when the algorithm flattens the parameters) is a view of that
range with those strides. So

* autograd accumulates into the bucket without the "gradient layout contract" warning, and a
  fresh gradient is copied in with a straight copy rather than a transposing one;
* the gradient has its parameter's strides, which torch's foreach and fused optimizer kernels
  need for their fast path (on CUDA a single mismatched pair sends the whole step to the
  one-launch-per-tensor path);
* flattening a ``channels_last`` model for model averaging keeps it ``channels_last``.

Everything laid over a bucket's flat vector (error-feedback memories, momenta, PowerSGD's
matrices) is therefore in the parameters' memory order. Checkpoints of the algorithm's state
record the layouts that differ from row-major (``algorithms/state.py``) and refuse, by name, to
resume that state into another layout; every rank must wrap the same layouts (checked at wrap
time).

A complex parameter (``complex64``: the spectral weights of a Fourier neural operator, say) is
held as its real view (``torch.view_as_real``: a trailing dimension of 2, real and imaginary
parts side by side), as DDP does: it sits in a bucket of its real dtype (``float32`` for
``complex64``) with two elements per complex element, its ``.grad`` a complex view of that
range, and every algorithm sees the real view (``real_geometry``), so it compresses and
averages the two parts as any other floats.
"""
from __future__ import annotations

import torch


def autograd_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides autograd gives a gradient of ``t``: ``t``'s own when it is dense, else
    row-major (``empty_like``'s rule; no memory is allocated)."""
    return torch.empty_like(t, device="meta").stride()


def row_major_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def is_row_major(shape, strides) -> bool:
    """Whether ``strides`` lay ``shape`` out row-major (strides of size-1 dims do not matter)."""
    return all(size == 1 or a == b for size, a, b
               in zip(tuple(shape), tuple(strides), row_major_strides(shape)))


def strides_not_row_major(names, params) -> dict[str, tuple[int, ...]]:
    """{name: autograd strides} of the parameters not laid out row-major: what a checkpoint of
    the algorithm's state records (the others need no entry)."""
    out = {}
    for name, p in zip(names, params):
        strides = autograd_strides(p)
        if not is_row_major(p.shape, strides):
            out[name] = strides
    return out


def describe(t: torch.Tensor) -> str:
    """The layout of a parameter in words: what the wrap-time check shows when ranks differ."""
    strides = autograd_strides(t)
    if is_row_major(t.shape, strides):
        return "contiguous"
    for name, fmt in (("channels_last", torch.channels_last),
                      ("channels_last_3d", torch.channels_last_3d)):
        try:
            if torch.empty(t.shape, device="meta", memory_format=fmt).stride() == strides:
                return name
        except RuntimeError:  # that format does not apply to this number of dims
            pass
    return f"strides {strides}"


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill the memory they span exactly once, in some order of its
    dimensions (no gaps, no overlaps: row-major, ``channels_last``, a transpose): the tensors
    ``flat_alias`` may view. Autograd's gradients of dense parameters are; a gradient set by
    hand (``p.grad = g.expand(...)``, a slice with gaps) need not be."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(((size, stride) for size, stride in zip(t.shape, t.stride())
                                if size != 1), key=lambda dim: dim[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def flat_alias(t: torch.Tensor) -> torch.Tensor:
    """A dense ``t`` (its strides are ``autograd_strides(t)``) as a 1-D view of its elements in
    memory order."""
    return t.as_strided((t.numel(),), (1,))


def memory_order(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """``t``'s elements as a 1-D tensor in the memory order of ``like`` (default ``t``): a view
    when ``t`` already lies that way, else a copy."""
    like = t if like is None else like
    strides = autograd_strides(like)
    if t.stride() == strides or t.numel() <= 1:
        return flat_alias(t)
    out = torch.empty_strided(like.shape, strides, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return flat_alias(out)


def real_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a complex ``t`` seen as real (a trailing dimension of 2), sharing its
    memory."""
    return torch.view_as_real(t) if t.is_complex() else t


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a bucket holds ``dtype`` in: itself, or a complex dtype's real part."""
    return dtype.to_real() if dtype.is_complex else dtype


def real_geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(shape, autograd strides, element count) of ``real_view`` of ``t``'s gradient: what a
    bucket lays out for ``t``, counted in real elements."""
    strides = autograd_strides(t)
    if not t.is_complex():
        return tuple(t.shape), strides, t.numel()
    return tuple(t.shape) + (2,), tuple(2 * s for s in strides) + (1,), 2 * t.numel()
