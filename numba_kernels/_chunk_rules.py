"""Per-chunk parameters and per-element levels of the chunked formats, for both targets.

Each chunk of a min-max, QSGD or 1-bit payload starts with the same prologue
on the CPU twin and on the GPU: reduce the chunk (range, sum of squares or of
magnitudes), then turn that into the chunk's parameters.  Those rules, and
QSGD's per-element level, are written once here as ``*_py`` functions that
``minmax.py``/``qsgd.py``/``onebit.py`` compile with ``numba.njit`` (the
versions below) and ``_cuda/{minmax,qsgd,onebit}.py`` with
``cuda.jit(device=True)``.  They call no other compiled function: a callee
would have to be the CPU or the device version, and one source cannot name
both, so the callers pass in what needs a target's FMA or RNG.
"""
import math

import numpy as np
from numba import njit

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_TWO23 = np.float32(2.0 ** 23)
# The one NaN a min-max payload stores (bits 0x7FC00000): arithmetic's NaN is the target's own
# (x86 keeps an operand's payload or makes 0xFFC00000, a GPU makes 0x7FFFFFFF).
_NAN = np.float32(np.nan)


def minmax_params_py(mn, mx, levels):
    """(mn, scale, inv) of a chunk whose float32 range is [mn, mx]; -0.0 becomes +0.0.

    scale = (mx - mn) / levels; inv = 1 / scale, 0 for a constant chunk (as
    ``minmax_inverse_py``, written out because one ``_py`` cannot call another).
    A NaN mn or scale (a chunk holding a NaN, whose range is NaN, or only infinities of one
    sign, inf - inf) is stored as ``_NAN``, so that both targets write the same bytes; inv
    is then 0 and every code 0 (``quantize``), and the chunk decodes to NaN.
    """
    mn = mn + _ZERO
    mx = mx + _ZERO
    scale = (mx - mn) / np.float32(levels)
    inv = _ONE / scale if scale > _ZERO else _ZERO
    if mn != mn:
        mn = _NAN
    if scale != scale:
        scale = _NAN
    return mn, scale, inv


def minmax_inverse_py(scale):
    """1 / scale, or 0 for a constant chunk (scale 0): codes are then all 0."""
    return _ONE / scale if scale > _ZERO else _ZERO


def qsgd_norm_py(sumsq):
    """The chunk's norm from its wire-order sum of squares."""
    return np.float32(math.sqrt(sumsq))


def qsgd_steps_py(norm, levels):
    """(ratio, step): ratio = levels / norm (0 for a zero chunk); step = norm / levels."""
    ratio = np.float32(levels) / norm if norm > _ZERO else _ZERO
    return ratio, norm / np.float32(levels)


def qsgd_level_py(v, r, u, levels):
    """Signed stochastic level of v, given r = |v| * ratio and its uniform draw u, as float32.

    level = floor(r) + 1 with probability r - floor(r) (when u < r - floor(r)),
    else floor(r); at most ``levels`` (r exceeds it by rounding, or in a chunk whose squares
    underflow); negative for negative v.  A NaN r (in a chunk holding an inf or NaN, whose
    norm is then inf or NaN) gives 0.

    Float32 throughout: floor(r) is r rounded to an integer by adding and subtracting 2**23
    (exact for 0 <= r < 2**23; a larger r is capped either way), less one where that rounded
    up.  A floor through int64 kept the CPU loop from vectorising (the QSGD
    encoder took twice as long) and is a slow conversion on the GPU.
    """
    rounded = (r + _TWO23) - _TWO23
    lo = rounded - _ONE if rounded > r else rounded
    level = lo + _ONE if u < r - lo else lo
    cap = np.float32(levels)
    level = cap if level > cap else level
    level = level if level >= _ZERO else _ZERO
    return -level if v < _ZERO else level


def onebit_scale_py(total, length, square):
    """Chunk scale from its wire-order sum: sqrt(total / L) with square ('l2'), else total / L."""
    mean = total / np.float32(length)
    return np.float32(math.sqrt(mean)) if square else mean


minmax_params = njit(nogil=True, inline="always")(minmax_params_py)
qsgd_norm = njit(nogil=True, inline="always")(qsgd_norm_py)
qsgd_steps = njit(nogil=True, inline="always")(qsgd_steps_py)
qsgd_level = njit(nogil=True, inline="always")(qsgd_level_py)
onebit_scale = njit(nogil=True, inline="always")(onebit_scale_py)
