"""Bit-level fp16 and bf16 conversions for both the CPU twin and the CUDA kernel.

The ``*_py`` functions below are plain integer arithmetic on bit patterns, so
the same source compiles with ``numba.njit`` (here, for ``casts.py``) and with
``cuda.jit(device=True)`` (in ``_cuda/casts.py``, which needs numba.cuda), and
both targets agree bit for bit.  They call no other compiled function: a
callee would have to be the CPU or the device version, and one source cannot
name both.  The rounding rules are described in ``casts.py``.
"""
import numpy as np
from numba import njit

U = np.uint32
_ABS, _INF32 = U(0x7FFFFFFF), U(0x7F800000)
_U1, _U10, _U13, _U16, _U23 = U(1), U(10), U(13), U(16), U(23)
_TWO_M24 = np.float32(2.0 ** -24)


def half_from_f32bits_py(u):
    """IEEE binary16 bits (in a uint32) of the float32 with bits u, round to nearest even.

    Every case is computed and the right one selected, so that the CPU loop
    vectorises; intermediate values of the cases not taken may wrap around.
    """
    sign = (u >> _U16) & U(0x8000)
    a = u & _ABS
    normal = (a + U(0x0FFF) + ((a >> _U13) & _U1) - U(0x38000000)) >> _U13
    e = a >> _U23
    shift = U(126) - (e if e > U(102) else U(102))       # 14..24 in the subnormal range
    shift = shift if shift > U(14) else U(14)
    m = (a & U(0x7FFFFF)) | U(0x800000)
    q = m >> shift
    rem = m & ((_U1 << shift) - _U1)
    half = _U1 << (shift - _U1)
    up = _U1 if (rem > half or (rem == half and (q & _U1) == _U1)) else U(0)
    h = q + up if a > U(0x33000000) else U(0)
    h = normal if a >= U(0x38800000) else h
    h = U(0x7C00) if a >= U(0x477FF000) else h
    h = (U(0x7E00) | ((a >> _U13) & U(0x3FF))) if a > _INF32 else h
    return h | sign


def half_fields_py(h):
    """(float32 bits, subnormal?, subnormal value) of the binary16 bits h.

    Normal numbers, infinities and NaNs get their float32 bit pattern (rebias
    the exponent, widen the mantissa); a subnormal m * 2**-24 is computed as a
    float, exactly.  The caller picks one with its own bit cast.
    """
    sign = (h & U(0x8000)) << _U16
    e = (h >> _U10) & U(0x1F)
    m = h & U(0x3FF)
    exp = U(0xFF) if e == U(0x1F) else e + U(112)
    bits = sign | (exp << _U23) | (m << _U13)
    sub = np.float32(m) * _TWO_M24
    return bits, e == U(0), -sub if sign != U(0) else sub


def bf16_from_f32bits_py(u):
    """bfloat16 bits (in a uint32) of the float32 with bits u, round to nearest even."""
    if (u & _ABS) > _INF32:
        return (u >> _U16) | U(0x40)
    return (u + U(0x7FFF) + ((u >> _U16) & _U1)) >> _U16


half_from_f32bits = njit(nogil=True, inline="always")(half_from_f32bits_py)
half_fields = njit(nogil=True, inline="always")(half_fields_py)
bf16_from_f32bits = njit(nogil=True, inline="always")(bf16_from_f32bits_py)
