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


def minmax_params_py(mn, mx, levels):
    """(mn, scale, inv) of a chunk whose float32 range is [mn, mx]; -0.0 becomes +0.0.

    scale = (mx - mn) / levels; inv = 1 / scale, 0 for a constant chunk (as
    ``minmax_inverse_py``, written out because one ``_py`` cannot call another).
    """
    mn = mn + _ZERO
    mx = mx + _ZERO
    scale = (mx - mn) / np.float32(levels)
    inv = _ONE / scale if scale > _ZERO else _ZERO
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
    """Signed stochastic level of v, given r = |v| * ratio and its uniform draw u.

    level = floor(r) + 1 with probability r - floor(r) (when u < r - floor(r)),
    else floor(r); at most ``levels``; negative for negative v.
    """
    lo = math.floor(r)
    level = lo + 1 if u < r - np.float32(lo) else lo
    level = level if level < levels else levels
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
