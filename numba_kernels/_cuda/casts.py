"""CUDA kernels for the fp16/bf16 casts.

The encoder rounds with the bit arithmetic of ``_half_bits``, as on the CPU.  The decoder
widens a binary16 with one float multiply instead (``f32_from_half``): both are exact, so the
bytes are the CPU twin's.
"""
import numpy as np
from numba import cuda

from .._half_bits import bf16_from_f32bits_py, half_from_f32bits_py
from .common import (add_or_replace, at, bits_f32, f32_bits, group_load, group_store_times,
                     lesser, load_c, specialized, zero_tail)
from .geometry import GROUP, GROUP_ILP, GROUP_SPAN, GROUPS, THREADS
from .launch import decode_stack, launch_over

half_from_f32bits = cuda.jit(device=True)(half_from_f32bits_py)
bf16_from_f32bits = cuda.jit(device=True)(bf16_from_f32bits_py)
_U16 = np.uint32(16)
_TWO_P112 = np.float32(2.0 ** 112)     # 2**(127 - 15): float32's exponent bias over binary16's
# The fp16 encoder's residual c - back subtracts f32_from_half's product, a pair the assembler
# may fuse into one FMA (tests/kernels/ptx_compile.py lists such pairs). The product is exact,
# so fused or not the residual rounds once, to the same float.
EXACT_PRODUCTS = {"_encode": "f32_from_half's product by 2**112 is exact"}


@cuda.jit(device=True)
def f32_from_half(h):
    """The float32 of the binary16 bits h (a uint32), exactly.

    The sign, exponent and mantissa move to their float32 places, and the float is scaled by
    2**112, which rebiases the exponent: exact, since every finite binary16 (subnormals
    included, which land on float32 subnormals before the scaling) is a normal float32 after
    it (Numba compiles without flush-to-zero, so the subnormal operand is kept).  Infinities
    and NaNs (exponent all ones) get float32's all-ones exponent instead, the NaN payload
    kept.  A few instructions an element, where taking the fields apart with a
    branch for subnormals took about twenty.
    """
    bits = ((h & np.uint32(0x8000)) << _U16) | ((h & np.uint32(0x7FFF)) << np.uint32(13))
    if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
        return bits_f32(bits | np.uint32(0x70000000))
    return bits_f32(bits) * _TWO_P112


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


def _stack_decoder(bf16):
    """The stack decoder of one 16-bit kind, named ``_decode_bf16`` or ``_decode_fp16``: with
    the kind a constant, a row's pass carries no instruction of the other kind's widening (it
    cost the fp16 pass about a sixth of its instructions as a runtime flag)."""

    @specialized("_decode_bf16" if bf16 else "_decode_fp16")
    def decode(quads, qcol, out, accumulate, factor):
        """Every row decoded and summed into out in row order, times ``factor``.

        A thread takes groups of GROUP = 4 consecutive elements, GROUPS groups a pass: a
        group's four codes come in one 64-bit load (the payload is 8-byte aligned, its padding
        zero), where an element at a time took a 16-bit load and its own address arithmetic.
        """
        n = out.size
        groups = (n + GROUP - 1) // GROUP
        acc = cuda.local.array(GROUP_ILP, out.dtype)
        base = cuda.blockIdx.x * GROUP_SPAN + cuda.threadIdx.x
        while base < groups:
            group_load(out, acc, base, n, accumulate)
            for p in range(quads.shape[0]):
                fold = accumulate or p > 0
                for u in range(GROUPS):
                    quad = quads[at(p), at(qcol + lesser(base + u * THREADS, groups - 1))]
                    for j in range(GROUP):
                        h = np.uint32((quad >> np.uint64(16 * j)) & np.uint64(0xFFFF))
                        if bf16:
                            value = bits_f32(h << _U16)
                        else:
                            value = f32_from_half(h)
                        k = u * GROUP + j
                        acc[k] = add_or_replace(acc[k], value, fold)
            group_store_times(out, acc, base, n, factor)
            base += cuda.gridDim.x * GROUP_SPAN

    return decode


_decode_fp16 = _stack_decoder(False)
_decode_bf16 = _stack_decoder(True)


def encode(x, e, bf16, half, buf, fmt, stream):
    """1 launch: cast (and update the residual) element-wise, zeroing the padding on the way."""
    launch_over(_encode, x.size, stream, x, x if e is None else e, e is not None, bf16, half,
                buf, fmt.used_nbytes, fmt.nbytes)


def decode(fmt, stack, col, out, accumulate, factor, stream):
    """1 launch: every row's payload (at byte column ``col``) decoded and summed in one pass
    over out, times ``factor``."""
    quads = stack.view(np.uint64)       # rows and columns are 8-byte aligned (wire.ALIGN)
    decode_stack(_decode_bf16 if fmt.kind == "bf16" else _decode_fp16, fmt, stack, col, (),
                 (quads, col // 8), out, accumulate, factor, stream, per_thread=GROUP_ILP)
