"""Bit-level rounding of float32 to fp16 and bf16, for both the CPU twin and the CUDA kernel.

The ``*_py`` functions below are plain integer arithmetic on bit patterns, so
the same source compiles with ``numba.njit`` (here, for ``casts.py``) and with
``cuda.jit(device=True)`` (in ``_cuda/casts.py``, which needs numba.cuda), and
both targets agree bit for bit.  They call no other compiled function: a
callee would have to be the CPU or the device version, and one source cannot
name both.  The rounding rules are described in ``casts.py``.  Widening back to float32
is exact, and each target does it its own fastest way (``f32_from_half`` in ``casts.py`` and
in ``_cuda/casts.py``).
"""
import numpy as np
from numba import njit

U = np.uint32
_ABS, _INF32 = U(0x7FFFFFFF), U(0x7F800000)
_U1, _U13, _U16, _U23 = U(1), U(13), U(16), U(23)


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


def bf16_from_f32bits_py(u):
    """bfloat16 bits (in a uint32) of the float32 with bits u, round to nearest even."""
    if (u & _ABS) > _INF32:
        return (u >> _U16) | U(0x40)
    return (u + U(0x7FFF) + ((u >> _U16) & _U1)) >> _U16


half_from_f32bits = njit(nogil=True, inline="always")(half_from_f32bits_py)
bf16_from_f32bits = njit(nogil=True, inline="always")(bf16_from_f32bits_py)
