"""Device top-k / random-k (see numba_kernels.topk for the definition and methods).

Random-k is one thread per stratum.  The exact method is
``select.select_exact`` over all of c.  The approximate method samples keys,
finds the sample's threshold with the same radix select, counts the keys above
it (one host read of the count per attempt), compacts those candidates in
order and runs the exact selection on them.  The rules shared with the CPU
twin (stratum positions, the sample plan) come from ``_sparse_rules``.
"""
import logging

import numpy as np
from numba import cuda

from .._device import empty
from .._scalar import rng_key
from .._sparse_rules import REFINEMENTS, SAMPLE_SEED, sample_plan, stratum_position_py, uses_approx
from . import select
from .common import add_or_replace, fill, hash32
from .launch import launch, launch_over, read_scalar
from .select import keep_entry

log = logging.getLogger(__name__)
stratum_position = cuda.jit(device=True)(stratum_position_py)


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
        out[j] = np.float32(arr[stratum_position(hash32(skey, j), j, n, m)])
        j += stride


@cuda.jit
def _randk(arr, n, k, rkey, out_idx, out_val, resid, has_res):
    j = cuda.grid(1)
    if j < k:
        i = stratum_position(hash32(rkey, j), j, n, k)
        keep_entry(i, np.float32(arr[i]), j, out_idx, out_val, resid, has_res)


@cuda.jit
def _scatter(idx, icol, vals, vcol, row, k, out, add):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < k:
        i = idx[row, icol + j]
        out[i] = add_or_replace(out[i], vals[row, vcol + j], add)
        j += stride


def _approx(arr, n, k, out_idx, out_val, resid, stream):
    """Approximate-threshold selection; returns False when the exact fallback is needed.

    Launches: 2 (sample, zero the histogram), then 12 per attempt (the sample's
    threshold: 9, mark it, count, scan) with one host read of the count each,
    and on success 14 (compact the candidates, then the exact selection's 13).
    """
    m, ks, cap = sample_plan(n, k)
    sample = empty(m, np.float32, True, stream)
    launch_over(_sample, m, stream, arr, n, m, rng_key(SAMPLE_SEED), sample)
    hist = select.zeroed_hist(stream)
    sample_state = select.new_state(stream)
    state = select.new_state(stream)
    cidx = empty(cap, np.int64, True, stream)
    cval = empty(cap, np.float32, True, stream)
    for _ in range(REFINEMENTS + 1):
        select.find_threshold(sample, m, ks, sample_state, hist, stream)
        launch(select.set_threshold, 1, 1, stream, sample_state, state)
        blk = select.count_and_scan(arr, n, state, stream)
        cnt = int(read_scalar(state, 2, stream))
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
    """Fill the TopKFormat payload ``buf`` from x (+ e, updated in place).

    Launches are listed in ``compress_topk`` and ``compress_randk``.
    """
    if fmt.nbytes > fmt.used_nbytes:
        fill(buf[fmt.used_nbytes:], 0, stream)
    if e is not None:
        launch_over(_add, x.size, stream, e, x)
    if fmt.k == 0:
        return
    arr = x if e is None else e
    if method == "random":
        launch_over(_randk, fmt.k, stream, arr, fmt.n, fmt.k, rkey, out_idx, out_val, arr,
                    e is not None, max_blocks=None)
        return
    if uses_approx(method, fmt.n):
        if _approx(arr, fmt.n, fmt.k, out_idx, out_val, e, stream):
            return
        log.debug("approximate top-k (n=%d, k=%d) fell back to the exact method", fmt.n, fmt.k)
    select.select_exact(arr, fmt.n, fmt.k, out_idx, out_val, None, e, stream)


def decode(fmt, stack, out, accumulate, stream):
    """Zero out (unless accumulating), then scatter(-add) each row's k values: rows + 1 launches."""
    v = fmt.views2d(stack)
    idx, icol = v["indices"]
    vals, vcol = v["values"]
    if not accumulate:
        fill(out, 0, stream)
    for row in range(stack.shape[0]):
        if fmt.k:
            launch_over(_scatter, fmt.k, stream, idx, icol, vals, vcol, row, fmt.k, out,
                        accumulate or row > 0)
