"""Device top-k / random-k (see numba_kernels.topk for the definition and methods).

Random-k is one thread per stratum.  The exact method is
``select.select_exact`` over all of c.  The approximate method samples keys,
finds the sample's threshold with the same radix select, counts the keys above
it (one host read of the count per attempt), compacts those candidates in
order and runs the exact selection on them.
"""
import logging

import numpy as np
from numba import cuda

from .. import _device
from .._scalar import rng_key
from ..topk import APPROX_MIN_N, REFINEMENTS, _SAMPLE_SEED, sample_plan, stratum_offset_py
from . import select
from .common import THREADS, blocks_for, fill, hash32

log = logging.getLogger(__name__)
_GRID = 65536
stratum_offset = cuda.jit(device=True)(stratum_offset_py)


@cuda.jit
def _add(e, x):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < x.size:
        e[i] = e[i] + x[i]
        i += stride


@cuda.jit
def _sample(arr, n, m, skey, out):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < m:
        lo = (j * n) // m
        hi = ((j + 1) * n) // m
        out[j] = np.float32(arr[lo + stratum_offset(hash32(skey, j), hi - lo)])
        j += stride


@cuda.jit
def _randk(arr, n, k, rkey, out_idx, out_val, resid, has_res):
    j = cuda.grid(1)
    if j < k:
        lo = (j * n) // k
        hi = ((j + 1) * n) // k
        i = lo + stratum_offset(hash32(rkey, j), hi - lo)
        v = np.float32(arr[i])
        out_idx[j] = i
        out_val[j] = v
        if has_res:
            resid[i] = resid[i] - v


@cuda.jit
def _scatter(idx, icol, vals, vcol, row, k, out, add):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < k:
        i = idx[row, icol + j]
        if add:
            out[i] = out[i] + vals[row, vcol + j]
        else:
            out[i] = vals[row, vcol + j]
        j += stride


def _grid(n):
    return min(blocks_for(n, THREADS), _GRID)


def _read_count(state, stream):
    """state[2] on the host (a copy on a non-default stream is asynchronous: wait for it)."""
    host = state[2:3].copy_to_host(stream=stream)
    if stream != 0:
        stream.synchronize()
    return int(host[0])


def _approx(arr, n, k, out_idx, out_val, resid, stream):
    """Approximate-threshold selection; returns False when the exact fallback is needed."""
    c = _device.cuda()
    m, ks, cap = sample_plan(n, k)
    sample = c.device_array(m, np.float32, stream=stream)
    _sample[_grid(m), THREADS, stream](arr, n, m, rng_key(_SAMPLE_SEED), sample)
    hist = select.zeroed_hist(stream)
    sample_state = select.new_state(stream)
    state = select.new_state(stream)
    cidx = c.device_array(cap, np.int64, stream=stream)
    cval = c.device_array(cap, np.float32, stream=stream)
    for _ in range(REFINEMENTS + 1):
        select.find_threshold(sample, m, ks, sample_state, hist, stream)
        select._set_threshold[1, 1, stream](sample_state, state)
        blk = select.count_and_scan(arr, n, state, stream)
        cnt = _read_count(state, stream)
        if cnt > cap:
            ks = max(1, ks // 2)
        elif cnt < k:
            ks = min(m, 4 * ks)
        else:
            select.compact(arr, n, state, blk, cidx, cval, None, None, stream)
            select.select_exact(cval, cnt, k, out_idx, out_val, cidx, resid, stream)
            return True
    return False


def sparsify(x, e, fmt, rkey, method, out_idx, out_val, buf, stream):
    """Fill the TopKFormat payload ``buf`` from x (+ e, updated in place)."""
    if fmt.nbytes > fmt.used_nbytes:
        fill(buf[fmt.used_nbytes:], 0, stream)
    if e is not None:
        _add[_grid(x.size), THREADS, stream](e, x)
    if fmt.k == 0:
        return
    arr = x if e is None else e
    if method == "random":
        _randk[blocks_for(fmt.k, THREADS), THREADS, stream](arr, fmt.n, fmt.k, rkey, out_idx,
                                                            out_val, arr, e is not None)
        return
    if method == "approx" and fmt.n >= APPROX_MIN_N:
        if _approx(arr, fmt.n, fmt.k, out_idx, out_val, e, stream):
            return
        log.debug("approximate top-k (n=%d, k=%d) fell back to the exact method", fmt.n, fmt.k)
    select.select_exact(arr, fmt.n, fmt.k, out_idx, out_val, None, e, stream)


def decode(fmt, stack, out, accumulate, stream):
    v = fmt.views2d(stack)
    idx, icol = v["indices"]
    vals, vcol = v["values"]
    if not accumulate:
        fill(out, 0, stream)
    for row in range(stack.shape[0]):
        if fmt.k:
            _scatter[_grid(fmt.k), THREADS, stream](idx, icol, vals, vcol, row, fmt.k, out,
                                                    accumulate or row > 0)
