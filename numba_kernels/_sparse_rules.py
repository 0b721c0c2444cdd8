"""How the top-k format's entries are chosen and written, shared by the CPU twin and the GPU.

``topk.py`` (host) and ``_cuda/topk.py`` (device) both import this module, so
the rules that make their payloads byte-identical are written once:

* ``stratum_position_py``: the index that stratum j of ``strata`` equal strata
  of [0, n) contributes for 32 random bits h (random-k's kept index, the
  approximate method's sample position);
* ``keep_entry_py``: write one kept (index, value) pair and, with error
  feedback, remove the value from the residual;
* the approximate method's plan (``sample_plan``), its constants, and
  ``uses_approx``, which decides between the methods.

The ``*_py`` functions call no other compiled function, so one source compiles
for both targets (the CPU versions are compiled here, the device versions in
``_cuda/topk.py`` and ``_cuda/select.py``).
"""
import math

import numpy as np
from numba import njit

# Failed refinements of the sampled threshold before the exact method takes over.
REFINEMENTS = 3
# Below this size the approximate method is not worth its sampling: use exact.
# ``uses_approx`` reads it at call time, so patching it here reaches both targets.
APPROX_MIN_N = 1 << 15
# Seed of the approximate method's sample positions (fixed: the result does not depend on it).
SAMPLE_SEED = 0x5EED

_U64 = np.uint64
_S32 = _U64(32)
_LOW32 = _U64(0xFFFFFFFF)


def uses_approx(method, n):
    """True when top-k of n elements with ``method`` runs the approximate method."""
    return method == "approx" and n >= APPROX_MIN_N


def sample_plan(n, k):
    """(m, ks, cap) of the approximate method for n elements and k kept."""
    m = int(min(n // 8, max(4096, min(1 << 16, 32 * n // max(k, 1)))))
    mu = k * m / n
    ks = int(min(m, math.ceil(mu + 3.0 * math.sqrt(mu) + 2.0)))
    cap = int(min(n, 3 * ks * (n // m + 1) + 1024))
    return m, ks, cap


def stratum_position_py(h, j, n, strata):
    """Index in stratum j = [floor(j n / strata), floor((j + 1) n / strata)) for random bits h.

    The offset into the stratum is the high word of h * size: uniform over the
    stratum for uniform h, without a division.  The bounds are j * (n // strata)
    plus j * (n % strata) // strata, the same integers as j * n // strata
    without forming j * n, which passes int64's range from n * strata >= 2^63
    (3e9 elements at a density of one); strata must stay below 2^32.  The
    offset takes the size's two 32-bit halves apart, so that a stratum of 2^32
    elements or more (n / strata that large) does not wrap the product.
    """
    per = n // strata
    rest = _U64(n - per * strata)
    lo = j * per + np.int64((_U64(j) * rest) // _U64(strata))
    hi = (j + 1) * per + np.int64((_U64(j + 1) * rest) // _U64(strata))
    size = _U64(hi - lo)
    offset = _U64(h) * (size >> _S32) + ((_U64(h) * (size & _LOW32)) >> _S32)
    return lo + np.int64(offset)


def keep_entry_py(idx, v, slot, out_idx, out_val, resid, has_res):
    """Write the kept pair (idx, v) at ``slot``; with has_res, take v out of the residual."""
    out_idx[slot] = idx
    out_val[slot] = v
    if has_res:
        resid[idx] = resid[idx] - v


stratum_position = njit(nogil=True, inline="always")(stratum_position_py)
keep_entry = njit(nogil=True, inline="always")(keep_entry_py)
