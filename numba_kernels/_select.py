"""Exact top-k selection on the CPU (the twin of ``_cuda/select.py``).

Selection works on 32-bit keys: ``|float32(v)|`` as its bit pattern
(non-negative floats order like their bits; NaN sorts above infinity).  The
result is defined, whatever the method,
as: sort by (key descending, position ascending), keep the first k, and list
them by ascending position.  So ties at the k-th magnitude go to the lower
index, and every implementation returns the same set in the same order.

Steps of ``select_exact``:
  1. T (the k-th largest key) and r, the number of keys equal to T that are
     taken.  Radix select: histogram the top 16 key bits, walk down from the
     top bin to the one holding the k-th key; repeat on the low 16 bits among
     keys with that prefix.  Up to ``PARTITION_MAX`` keys, a partition of a
     copy of the keys instead: the radix histogram (2^16 counts, cleared
     twice) costs some 60 us whatever the length, 20-60 times a partition of
     1024 keys (``benchmarks/results/select_small.md``);
  2. compaction: one pass keeps keys > T and the first r keys == T, writing
     (index, float32 value) in position order.
"""
import numpy as np
from numba import njit

from ._disk_cache import cached_njit
from ._scalar import f32_bits
from ._sparse_rules import keep_entry

_ABS = np.uint32(0x7FFFFFFF)
_LOW16 = np.uint32(0xFFFF)
_S16 = np.uint32(16)
# Up to this many keys, kth_key partitions them (see the module docstring); measured crossover
# with the radix passes: 32K-64K keys
PARTITION_MAX = 1 << 15


@njit(nogil=True, inline="always")
def key_of(arr, i):
    """Magnitude key of float32(arr[i])."""
    return f32_bits(np.float32(arr[i])) & _ABS


@njit(nogil=True)
def _kth_key_partitioned(arr, m, k):
    """``kth_key`` by a partition of a copy of the keys (O(m), no fixed cost)."""
    keys = np.empty(m, np.uint32)
    for i in range(m):
        keys[i] = key_of(arr, i)
    t = np.partition(keys, m - k)[m - k]
    above = 0
    for i in range(m):
        above += keys[i] > t
    return t, k - above


@cached_njit(nogil=True)
def kth_key(arr, m, k):
    """(T, r): the k-th largest key of arr[:m] and how many keys == T to take (1 <= k <= m)."""
    if m <= PARTITION_MAX:
        return _kth_key_partitioned(arr, m, k)
    hist = np.zeros(1 << 16, np.int64)
    for i in range(m):
        hist[key_of(arr, i) >> _S16] += 1
    rem = k
    hi = (1 << 16) - 1
    while hist[hi] < rem:
        rem -= hist[hi]
        hi -= 1
    hist[:] = 0
    top = np.uint32(hi)
    for i in range(m):
        key = key_of(arr, i)
        if (key >> _S16) == top:
            hist[key & _LOW16] += 1
    lo = (1 << 16) - 1
    while hist[lo] < rem:
        rem -= hist[lo]
        lo -= 1
    return (top << _S16) | np.uint32(lo), rem


@cached_njit(nogil=True)
def compact(arr, m, thr, r, out_idx, out_val, resid, has_res, index_map, use_map):
    """Write keys > thr and the first r keys == thr, in position order.

    The output index is ``index_map[i]`` when ``use_map`` (candidate lists),
    else i.  With ``has_res`` the taken value is removed from resid at that
    index (error feedback: the residual keeps what was not sent).
    """
    pos = 0
    eq = 0
    for i in range(m):
        key = key_of(arr, i)
        take = key > thr
        if key == thr:
            take = eq < r
            eq += 1
        if take:
            keep_entry(index_map[i] if use_map else i, np.float32(arr[i]), pos, out_idx, out_val,
                       resid, has_res)
            pos += 1
    return pos


@cached_njit(nogil=True)
def select_exact(arr, m, k, out_idx, out_val, resid, has_res, index_map, use_map):
    """Exact top-k of arr[:m] into (out_idx, out_val); see the module docstring."""
    if k == 0:
        return 0
    thr, r = kth_key(arr, m, k)
    return compact(arr, m, thr, r, out_idx, out_val, resid, has_res, index_map,
                   use_map)
