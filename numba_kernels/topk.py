"""Top-k and random-k sparsification with fused error feedback.

``compress_topk(x, k)`` keeps the k entries of c = x + e with the largest
float32 magnitude (ties: lower index first).  ``compress_randk(x, k, seed)``
keeps k random entries by stratified sampling: stratum j = [floor(j n / k),
floor((j + 1) n / k)) contributes one index drawn with ``hash32(key, j)``, so
the indices are distinct and ascending, each index is kept with probability
1 / (its stratum's size) -- k / n when k divides n -- and the cost is O(k).
The payload (``TopKFormat``) lists the kept indices in ascending order with
their float32 values; decompression scatters (or scatter-adds) them.  With
``residual`` the call first forms c in place (e <- x + e), then removes what
was sent: the residual keeps every unselected entry and, at selected ones,
c - float32(c) (zero for float32 input).

Two methods, one result:
* ``method="exact"``: radix select over all of c (``_select.select_exact``);
* ``method="approx"``, O(n) in one pass for large tensors:
    1. draw a stratified sample of m keys (one at a jittered position in each
       of m equal strata) and take its ks-th largest key as threshold, with
       ks = mu + 3 sqrt(mu) + 2 for mu = k m / n expected sample hits, so that
       the threshold falls below the true k-th key with high probability;
    2. one pass collects the candidates with key >= threshold, up to a
       capacity of a few times the expected count;
    3. if the count is in [k, capacity], the exact selection among the
       candidates is the exact top-k (every true top-k key is >= threshold);
       if too few, quadruple ks; if too many, halve it; after
       ``REFINEMENTS`` failed refinements fall back to the exact method.
       On a GPU there is one attempt, and the device itself chooses between
       the candidates and the whole array for the exact selection, so the host
       never waits for the count.
  So "approx" is approximate in its threshold, never in its result.
"""
import logging

import numpy as np

from ._api import prepare
from ._disk_cache import cached_njit
from ._scalar import hash32, rng_key
from ._select import key_of, select_exact
from ._sparse_rules import (REFINEMENTS, SAMPLE_SEED, keep_entry, sample_plan, stratum_position,
                            uses_approx)
from .errors import KernelParameterError
from .wire import Payload, TopKFormat

log = logging.getLogger(__name__)


# select_exact's use_map flag as a plain bool: for a True or False literal here Numba compiled
# select_exact and compact once more for each value (about 3 s more from an empty cache)
_ON_CANDIDATES = np.bool_(True)
_ON_ALL = np.bool_(False)


@cached_njit(nogil=True)
def select_approx(arr, n, k, m, ks, cap, skey, out_idx, out_val, resid, has_res):
    """Approximate-threshold top-k of arr (magnitudes); returns the attempts used
    (REFINEMENTS + 2 means the exact fallback ran)."""
    sample = np.empty(m, np.uint32)
    for j in range(m):
        sample[j] = key_of(arr, stratum_position(hash32(skey, j), j, n, m))
    sample = np.sort(sample)
    cidx = np.empty(cap, np.int64)
    cval = np.empty(cap, np.float32)
    for attempt in range(REFINEMENTS + 1):
        thr = sample[m - ks]
        cnt = 0
        for i in range(n):
            key = key_of(arr, i)
            if key >= thr:
                if cnt == cap:
                    cnt += 1
                    break
                cidx[cnt] = i
                cval[cnt] = np.float32(arr[i])
                cnt += 1
        if cnt > cap:
            ks = max(1, ks // 2)
        elif cnt < k:
            ks = min(m, 4 * ks)
        else:
            select_exact(cval, cnt, k, out_idx, out_val, resid, has_res, cidx, _ON_CANDIDATES)
            return attempt + 1
    select_exact(arr, n, k, out_idx, out_val, resid, has_res, cidx, _ON_ALL)
    return REFINEMENTS + 2


@cached_njit(nogil=True)
def add_inplace(e, x):
    for i in range(x.size):
        e[i] = e[i] + x[i]


@cached_njit(nogil=True)
def randk_cpu(arr, n, k, rkey, out_idx, out_val, resid, has_res):
    """Stratified random-k: one index per stratum, ascending."""
    for j in range(k):
        i = stratum_position(hash32(rkey, j), j, n, k)
        keep_entry(i, np.float32(arr[i]), j, out_idx, out_val, resid, has_res)


def _sparsify(x, k, index_dtype, residual, out, stream, seed, method):
    """Shared body of compress_topk (method 'exact'/'approx') and compress_randk ('random')."""
    if method not in ("exact", "approx", "random"):
        raise KernelParameterError(f"method must be 'exact' or 'approx', got {method!r}")
    if method == "random" and k >= 1 << 32:   # the strata's bounds (_sparse_rules)
        raise KernelParameterError(f"random-k keeps fewer than 2^32 entries, got k={k}")
    xa, ea, dev, fmt, buf, st = prepare(x, residual, out,
                                        lambda n: TopKFormat(n, k, index_dtype), stream)
    v = fmt.views(buf)
    if dev:
        from ._cuda import topk as kern
        kern.sparsify(xa, ea, fmt, rng_key(seed), method, v["indices"], v["values"], buf, st)
        return Payload(fmt, buf)
    buf[fmt.used_nbytes:] = 0
    arr = xa
    if ea is not None:
        add_inplace(ea, xa)
        arr = ea
    if fmt.k == 0:
        return Payload(fmt, buf)
    has_res = ea is not None
    if method == "random":
        randk_cpu(arr, fmt.n, fmt.k, rng_key(seed), v["indices"], v["values"], arr, has_res)
    elif uses_approx(method, fmt.n):
        m, ks, cap = sample_plan(fmt.n, fmt.k)
        attempts = select_approx(arr, fmt.n, fmt.k, m, ks, cap, rng_key(SAMPLE_SEED),
                                 v["indices"], v["values"], arr, has_res)
        if attempts > REFINEMENTS + 1:
            log.debug("approximate top-k (n=%d, k=%d) fell back to the exact method",
                      fmt.n, fmt.k)
    else:
        select_exact(arr, fmt.n, fmt.k, v["indices"], v["values"], arr, has_res,
                     np.empty(1, np.int64), False)
    return Payload(fmt, buf)


def compress_topk(x, k, index_dtype="int32", method="approx", residual=None, out=None,
                  stream=None):
    """Keep the k largest-magnitude entries of x (+ residual); see the module docstring.

    Returns a Payload of ``TopKFormat(x.size, k, index_dtype)``.
    Example: ``p = compress_topk(g, k=g.numel() // 1000, residual=r)``.

    Device launches: 1 up to 32,768 elements (4,096 under the simulator), either
    method: one block adds the residual and selects.  Above that, 7 with
    method='exact' (4 radix rounds to find the k-th key, count, scan, compact)
    and +1 with ``residual`` (c = x + e); method='approx': 12 (sample, the
    sample's threshold, count and scan above it, gather the candidates, the
    selection's 7), the same when the device falls back to the whole array,
    +1 with ``residual`` (under the simulator, whose one-block limit is lower,
    sizes from 4,096 to 32,768 take the exact 7 with either method).  Any size:
    +1 zeroing the padding (int64 indices, odd k); only that and the residual's
    when k is 0.  No host synchronisation.
    Scratch arrays are cached per thread and stream, so only a thread's first
    call on a stream above 32,768 elements (or a later one larger than any
    before) allocates; the first also zeroes the selection's state and
    histogram: +2 launches, or +3 with 'approx'.
    """
    if method not in ("exact", "approx"):
        raise KernelParameterError(f"method must be 'exact' or 'approx', got {method!r}")
    return _sparsify(x, k, index_dtype, residual, out, stream, 0, method)


def compress_randk(x, k, seed=0, index_dtype="int32", residual=None, out=None, stream=None):
    """Keep k random entries of x (+ residual), one per stratum, reproducibly for ``seed``.

    Device launches: 1 (a thread per stratum); +1 with ``residual`` (c = x + e), +1
    zeroing the padding (int64 indices, odd k); only those two when k is 0.
    """
    return _sparsify(x, k, index_dtype, residual, out, stream, seed, "random")


@cached_njit(nogil=True)
def decode_cpu_kernel(idx, icol, vals, vcol, k, out, accumulate):
    """Scatter (accumulate=False: out = 0 first) then scatter-add every row in order."""
    if not accumulate:
        out[:] = 0
    for p in range(idx.shape[0]):
        for j in range(k):
            i = idx[p, icol + j]
            out[i] = out[i] + vals[p, vcol + j] if (accumulate or p > 0) else vals[p, vcol + j]


def decode_cpu(fmt, stack, col, out, accumulate):
    """Sum the payloads at byte column ``col`` of the rows of ``stack`` into out (see
    ``registry.Codec``)."""
    v = fmt.views2d(stack, col)
    idx, icol = v["indices"]
    vals, vcol = v["values"]
    decode_cpu_kernel(idx, icol, vals, vcol, fmt.k, out, accumulate)


def decode_device(fmt, stack, col, out, accumulate, factor, stream):
    """The CUDA twin of ``decode_cpu`` (see ``registry.Codec``), times ``factor``.

    Device launches: 2 for a stack of P rows while P x k is at most 65,536 (zero out, then
    one block scatters the rows in order; 8,192 under the simulator), else P + 1 (a grid per
    row, in order); one fewer with ``accumulate``; one more scaling out by a factor other
    than 1.
    """
    from ._cuda import topk as kern
    kern.decode(fmt, stack, col, out, accumulate, stream)
    if factor != 1.0:
        from ._cuda.common import scale
        scale(out, np.float32(factor), stream)
