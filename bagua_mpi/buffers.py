"""Tensors and arrays as MPI sees them: dtypes, zero-copy views, allocation, scaling.

* NumPy arrays and contiguous CPU torch tensors go to MPI as they are (a NumPy view shares the
  tensor's memory: no copy).
* bfloat16 has no MPI datatype: data movement (broadcast, gathers, alltoall) sends its bits as
  2-byte words, exactly. Reductions of float16 and bfloat16 run in float32 (see ``reduce_dtype``).
* Device memory is ``transport.py``'s business (this module is below it and knows nothing of
  CUDA-aware MPI or staging).
"""
from __future__ import annotations

import math

import numpy as np
import torch

# Canonical names of the dtypes the collectives accept: Horovod's, int8 and int16 included for
# torch tensors (as Horovod); NumPy arrays keep seven of the original eight (no bfloat16).
_TORCH_DTYPES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float64: "float64", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.bool: "bool",
}
_NUMPY_DTYPES = {
    np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64", np.dtype(np.int32): "int32", np.dtype(np.int64): "int64",
    np.dtype(np.uint8): "uint8", np.dtype(np.bool_): "bool",
}
FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
HALF = frozenset({"float16", "bfloat16"})
INTEGER = frozenset({"int32", "int64", "uint8", "int8", "int16"})

# Elementwise host arithmetic over a bucket (an optimizer's update, a model average) runs over
# this many elements at a time, through a temporary of that size that stays in cache: a
# temporary of the bucket's length was mapped and faulted in afresh at every step, since the
# allocator hands arrays this large back to the system when they are freed
HOST_PIECE = 1 << 18


def host_pieces(n: int):
    """``(start, stop)`` of each piece of ``HOST_PIECE`` elements covering ``range(n)``, in
    order (the last may be shorter)."""
    for start in range(0, n, HOST_PIECE):
        yield start, min(n, start + HOST_PIECE)


def dtype_name(x) -> str:
    """The canonical dtype name of a tensor/array; ``TypeError`` for anything unsupported."""
    if isinstance(x, torch.Tensor):
        known = _TORCH_DTYPES
    elif isinstance(x, np.ndarray):
        known = _NUMPY_DTYPES
    else:
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    name = known.get(x.dtype)
    if name is None:
        raise TypeError(f"unsupported dtype {x.dtype} for a {type(x).__name__}; supported: "
                        f"{', '.join(known.values())}")
    return name


def reduce_dtype(name: str) -> str:
    """The dtype a reduction runs in. 16-bit floats are reduced in float32.

    Measured with the MPICH wheel on 4 ranks: MPICH's own float16 SUM runs at 0.12 GB/s and a
    Python user-defined bfloat16 op at 0.08 GB/s, while upcasting to float32 and reducing natively
    runs at ~1 GB/s of 16-bit input (8x faster despite twice the bytes) and rounds only once.
    """
    return "float32" if name in HALF else name


def is_cuda(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_cuda


def host_view(x) -> np.ndarray:
    """Zero-copy NumPy view of a contiguous CPU tensor or array (bfloat16 as uint16 bits)."""
    if isinstance(x, np.ndarray):
        return x
    t = x.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def as_tensor(x) -> torch.Tensor:
    """A torch tensor over ``x``'s own memory, no copy: a NumPy array through ``from_numpy``, a
    Numba device array through its CUDA array interface, a tensor detached."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return torch.as_tensor(x, device="cuda")


_NUMPY_ALLOC_BYTES = 1 << 20


def empty_like(x, shape=None, dtype: str | None = None):
    """A new contiguous buffer of x's kind and device (optionally another shape/dtype).

    Large CPU tensors are allocated by NumPy and wrapped (``torch.from_numpy``): NumPy asks the
    kernel for transparent huge pages, torch's allocator does not, and an allreduce into a fresh
    64 MiB torch.empty buffer took 157 ms against 84 ms into a NumPy-allocated one (first-touch
    page faults inside MPI), on 4 ranks here.
    """
    name = dtype_name(x)  # TypeError for anything that is not a supported tensor/array
    shape = tuple(x.shape) if shape is None else tuple(shape)
    if isinstance(x, np.ndarray):
        return np.empty(shape, dtype=np.dtype(dtype) if dtype else x.dtype)
    tdtype = getattr(torch, dtype) if dtype else x.dtype
    nbytes = math.prod(shape) * torch.empty((), dtype=tdtype).element_size()
    if x.is_cuda or nbytes < _NUMPY_ALLOC_BYTES:
        return torch.empty(shape, dtype=tdtype, device=x.device)
    name = dtype or name
    if name == "bfloat16":
        return torch.from_numpy(np.empty(shape, dtype=np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.empty(shape, dtype=np.dtype("bool" if name == "bool" else name)))


def contiguous(x):
    if isinstance(x, np.ndarray):
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)
    return x.detach().contiguous()


def to_dtype(x, name: str):
    """A copy of x in dtype ``name`` (same kind and device)."""
    if isinstance(x, np.ndarray):
        return x.astype(np.dtype(name))
    return x.detach().to(getattr(torch, name))


def copy_into(dst, src) -> None:
    """dst[...] = src, converting dtype (bfloat16/float16 round to nearest even)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src, casting="unsafe")
    else:
        dst.copy_(src if isinstance(src, torch.Tensor) else torch.from_numpy(src))


def flatten(tensors, dt: str):
    """``tensors`` (or NumPy arrays) end to end in one new flat buffer of dtype ``dt``. Tensors
    take one cat in their common dtype and at most one cast: on a GPU a few launches however
    many tensors, where a cast or copy each made a grouped operation's launches grow with its
    tensors. (The common dtype holds every value exactly, as ``dt`` does.)"""
    if isinstance(tensors[0], np.ndarray):
        return np.concatenate([t.reshape(-1) for t in tensors]).astype(dt, copy=False)
    return torch.cat([t.detach().reshape(-1) for t in tensors]).to(getattr(torch, dt))


def flatten_into(work: torch.Tensor, tensors) -> None:
    """``flatten`` into the existing ``work`` (tensors or arrays on its device)."""
    views = [as_tensor(t).reshape(-1) for t in tensors]
    if all(v.dtype == work.dtype for v in views):
        torch.cat(views, out=work)
    else:
        work.copy_(torch.cat(views))


def copy_split(fused, dsts) -> None:
    """Consecutive slices of the flat ``fused`` into ``dsts``, as ``copy_into`` each (dtype
    converted, bfloat16/float16 rounded to nearest even). Tensors take one cast of ``fused``
    per dtype among them that it is not, and one ``torch._foreach_copy_`` per dtype: on a GPU a
    few launches however many tensors, where a copy each made a grouped operation's launches
    grow with its tensors."""
    slices, offset = [], 0
    for d in dsts:
        n = math.prod(d.shape)
        slices.append((offset, n))
        offset += n
    if not (dsts and isinstance(fused, torch.Tensor)
            and all(isinstance(d, torch.Tensor) for d in dsts)):
        for d, (lo, n) in zip(dsts, slices):
            copy_into(d, fused[lo:lo + n].reshape(d.shape))
        return
    by_dtype: dict = {}
    for d, where in zip(dsts, slices):
        by_dtype.setdefault(d.dtype, []).append((d, where))
    for dtype, members in by_dtype.items():
        src = fused if fused.dtype == dtype else fused.to(dtype)
        torch._foreach_copy_([d for d, _ in members],
                             [src[lo:lo + n].reshape(d.shape) for d, (lo, n) in members])


class FusedTensors:
    """Tensors of one dtype and device seen as one buffer: the buffer, with a view of it
    shaped as each tensor, made once. ``gather`` copies the tensors in with one foreach copy
    and ``scatter`` copies the buffer back with another (a few launches on a GPU however many
    tensors), so a plan that keeps this across steps (PowerSGD's dense layers, summed as one
    message) spends no host work a tensor. One tensor is its own buffer."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = [t.detach() for t in tensors if t.numel()]
        kinds = {(t.dtype, t.device) for t in self.tensors}
        if len(kinds) > 1:
            raise ValueError(f"fused tensors must share one dtype and device, got "
                             f"{sorted(f'{dtype} on {device}' for dtype, device in kinds)}")
        self.buffer = self.parts = None
        if len(self.tensors) == 1:
            self.buffer = self.tensors[0]
        elif self.tensors:
            numels = [t.numel() for t in self.tensors]
            first = self.tensors[0]
            self.buffer = torch.empty(sum(numels), dtype=first.dtype, device=first.device)
            self.parts = [part.view(t.shape) for part, t in
                          zip(self.buffer.split(numels), self.tensors)]

    def gather(self) -> torch.Tensor:
        """The buffer, holding the tensors' values end to end."""
        if self.parts is not None:
            torch._foreach_copy_(self.parts, self.tensors)
        return self.buffer

    def scatter(self) -> None:
        """Each tensor <- its part of the buffer."""
        if self.parts is not None:
            torch._foreach_copy_(self.tensors, self.parts)


def scale_(x, factor: float) -> None:
    """x *= factor in place.

    CPU data is scaled through NumPy on one core: torch's OpenMP threads spin-wait, and with
    several ranks per node busy-polling in MPI they made a 16 MiB multiply take ~20 ms here.
    """
    if factor == 1.0:
        return
    if isinstance(x, torch.Tensor) and (x.is_cuda or x.dtype == torch.bfloat16
                                        or not x.is_contiguous()):
        if x.is_floating_point():
            x.mul_(factor)
        else:  # integers as Horovod scales them: in float64, truncated toward zero
            x.copy_(x.double().mul_(factor).trunc_())
        return
    arr = host_view(x)
    if arr.dtype.kind in "iu":
        np.copyto(arr, np.trunc(arr * np.float64(factor)), casting="unsafe")
        return
    np.multiply(arr, _factor_for(arr.dtype, factor), out=arr)


def _factor_for(dtype: np.dtype, factor: float):
    """``factor`` as NumPy should multiply a float array of ``dtype`` by it: in the array's
    dtype, except float16, whose own rounding of the factor (1/3 as 0.33325) put a third of
    the products one step off; float32 keeps it, and the product is rounded once to
    float16."""
    return np.float32(factor) if dtype == np.float16 else dtype.type(factor)


def scaled_copy(dst, src, factor: float) -> None:
    """dst[...] = src * factor in one pass (same dtype, contiguous CPU or same device)."""
    if isinstance(dst, torch.Tensor) and (dst.is_cuda or not dst.is_contiguous()
                                          or not src.is_contiguous()):
        if factor == 1.0:
            dst.copy_(src.detach())
        elif not dst.is_floating_point():
            dst.copy_(src.detach().double().mul_(factor).trunc_())
        else:
            torch.mul(src.detach(), factor, out=dst)
        return
    d, s_ = host_view(dst), host_view(src)
    if factor == 1.0:
        np.copyto(d, s_)
    elif d.dtype.kind in "iu":
        np.copyto(d, np.trunc(s_ * np.float64(factor)), casting="unsafe")
    else:
        np.multiply(s_, _factor_for(d.dtype, factor), out=d)


def fast_cpu_view(x) -> np.ndarray | None:
    """NumPy view of x when x needs no staging (contiguous, on the CPU, not bfloat16)."""
    if type(x) is np.ndarray:
        return x if x.flags.c_contiguous else None
    if x.is_cuda or not x.is_contiguous() or x.dtype == torch.bfloat16:
        return None
    return x.detach().numpy()
