"""CUDA kernels for the fp16/bf16 casts (the bit arithmetic of ``_half_bits``, as on the CPU)."""
import numpy as np
from numba import cuda

from .._half_bits import bf16_from_f32bits_py, half_fields_py, half_from_f32bits_py
from .common import (add_or_replace, at, bits_f32, f32_bits, ilp_index, ilp_load, ilp_store_times,
                     load_c, zero_tail)
from .geometry import ILP, ILP_SPAN
from .launch import decode_stack, launch_over

half_from_f32bits = cuda.jit(device=True)(half_from_f32bits_py)
half_fields = cuda.jit(device=True)(half_fields_py)
bf16_from_f32bits = cuda.jit(device=True)(bf16_from_f32bits_py)
_U16 = np.uint32(16)


@cuda.jit(device=True)
def f32_from_half(h):
    bits, is_sub, sub = half_fields(h)
    if is_sub:
        return sub
    return bits_f32(bits)


@cuda.jit
def _encode(x, e, has_res, bf16, half, buf8, used, nbytes):
    zero_tail(buf8, used, nbytes)
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < x.size:
        c = load_c(x, e, has_res, i)
        u = f32_bits(np.float32(c))
        if bf16:
            h = bf16_from_f32bits(u)
            back = bits_f32(h << _U16)
        else:
            h = half_from_f32bits(u)
            back = f32_from_half(h)
        half[at(i)] = np.uint16(h)
        if has_res:
            e[at(i)] = c - back
        i += stride


@cuda.jit(device=True)
def _decoded(halves, col, bf16, p, i):
    """Element i of row p as a float32."""
    h = np.uint32(halves[at(p), at(col + i)])
    if bf16:
        return bits_f32(h << _U16)
    return f32_from_half(h)


@cuda.jit
def _decode(halves, col, bf16, out, accumulate, factor):
    """Every row decoded and summed into out in row order, times ``factor``, ILP elements
    per thread."""
    n = out.size
    acc = cuda.local.array(ILP, out.dtype)
    base = cuda.blockIdx.x * ILP_SPAN + cuda.threadIdx.x
    while base < n:
        ilp_load(out, acc, base, n, accumulate)
        for p in range(halves.shape[0]):
            fold = accumulate or p > 0
            for u in range(ILP):
                value = _decoded(halves, col, bf16, p, ilp_index(base, u, n))
                acc[u] = add_or_replace(acc[u], value, fold)
        ilp_store_times(out, acc, base, n, factor)
        base += cuda.gridDim.x * ILP_SPAN


def encode(x, e, bf16, half, buf, fmt, stream):
    """1 launch: cast (and update the residual) element-wise, zeroing the padding on the way."""
    launch_over(_encode, x.size, stream, x, x if e is None else e, e is not None, bf16, half,
                buf, fmt.used_nbytes, fmt.nbytes)


def decode(fmt, stack, col, out, accumulate, factor, stream):
    """1 launch: every row's payload (at byte column ``col``) decoded and summed in one pass
    over out, times ``factor``."""
    decode_stack(_decode, fmt, stack, col, ("half",), (fmt.kind == "bf16",), out, accumulate,
                 factor, stream)
