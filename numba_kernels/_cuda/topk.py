"""Device top-k / random-k (see numba_kernels.topk for the definition and methods).

Random-k is one thread per stratum.  Up to ``select.ONE_BLOCK_KEYS`` elements,
either selection method is one block's exact selection, error feedback added
in the same kernel.  Above that, the exact method is ``select.select_exact``
over all of c, and the approximate method samples keys, finds the sample's
threshold in one block, counts the keys above it, gathers those candidates in
order when their count lies in [k, capacity], and runs the exact selection on
them, or on all of c when it does not: the device makes that choice itself,
so the host never waits (the CPU twin refines the threshold instead, with the
same result).  The rules shared with the CPU twin
(stratum positions, the sample plan) come from ``_sparse_rules``.
"""
import numpy as np
from numba import cuda

from .._scalar import rng_key
from .._sparse_rules import SAMPLE_SEED, sample_plan, stratum_position_py, uses_approx
from . import select
from .common import add_or_replace, fill, hash32
from .geometry import THREADS
from .launch import launch, launch_over
from .scratch import scratch
from .select import keep_entry

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
    """Approximate-threshold selection, decided on the device; returns the selection state
    (its MODE slot: 1 when the sampled threshold held, 0 when the whole array was selected).

    Launches: 12 whichever way it goes (sample, the sample's threshold, count and scan
    above it, gather the candidates, the selection's 7) and no host synchronisation: when
    the count falls outside [k, capacity] the gather writes nothing and the selection runs
    over the whole array instead of the candidates.
    """
    m, ks, cap = sample_plan(n, k)
    sample = scratch("topk.sample", m, np.float32, stream)
    launch_over(_sample, m, stream, arr, n, m, rng_key(SAMPLE_SEED), sample)
    cstate = select.new_state(stream, "topk.sample_state")
    select.sample_threshold(sample, m, ks, cstate, stream)
    blk = select.tile_counts(n, stream)
    select.count_and_scan(arr, arr, n, select.FULL, cstate, blk, stream)
    cidx = scratch("topk.cand_idx", cap, np.int64, stream)
    cval = scratch("topk.cand_val", cap, np.float32, stream)
    sel = select.new_state(stream)
    select.gather_candidates(arr, n, cstate, blk, k, cap, cidx, cval, sel, stream)
    select.select(arr, cval, cidx, n, select.DECIDED, k, out_idx, out_val, resid, sel, stream)
    return sel


def sparsify(x, e, fmt, rkey, method, out_idx, out_val, buf, stream):
    """Fill the TopKFormat payload ``buf`` from x (+ e, updated in place).

    Launches are listed in ``compress_topk`` and ``compress_randk``.
    """
    if fmt.nbytes > fmt.used_nbytes:
        fill(buf[fmt.used_nbytes:], 0, stream)
    if method != "random" and fmt.k and select.one_block(fmt.n):   # the residual added inside
        select.one_block_topk(x, e, fmt.k, out_idx, out_val, stream)
        return
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
        _approx(arr, fmt.n, fmt.k, out_idx, out_val, e, stream)
    else:
        select.select_exact(arr, fmt.n, fmt.k, out_idx, out_val, None, e, stream)


# A stack of at most this many (row, entry) pairs is scattered by one block of ROW_BLOCK
# threads, row after row; a larger one by a grid per row.  A launch costs the host about
# 50 us through Numba (H100 machine), more than such a block's work, 64 block-widths of
# entries, costs the device (chosen, not measured on a GPU).
ROW_BLOCK = 4 * THREADS
ONE_BLOCK_ENTRIES = 64 * ROW_BLOCK


@cuda.jit
def _scatter_rows(idx, icol, vals, vcol, rows, k, out, accumulate):
    """Every row of the stack by one block, in row order: a row's k indices are distinct, so
    its threads never write one element twice, and the barrier after each row orders the
    adds to an element that several rows hold, as the CPU twin does."""
    step = cuda.blockDim.x
    for row in range(rows):
        add = accumulate or row > 0
        j = cuda.threadIdx.x
        while j < k:
            i = idx[row, icol + j]
            out[i] = add_or_replace(out[i], vals[row, vcol + j], add)
            j += step
        cuda.syncthreads()


def decode(fmt, stack, col, out, accumulate, stream):
    """Zero out (unless accumulating), then scatter(-add) each row's k values (its payload at
    byte column ``col``), rows in order: 2 launches (1 accumulating) while rows x k is at most
    ONE_BLOCK_ENTRIES, else rows + 1 (rows)."""
    v = fmt.views2d(stack, col)
    idx, icol = v["indices"]
    vals, vcol = v["values"]
    rows = stack.shape[0]
    if not accumulate:
        fill(out, 0, stream)
    if not fmt.k or not rows:
        return
    if rows * fmt.k <= ONE_BLOCK_ENTRIES:
        launch(_scatter_rows, 1, ROW_BLOCK, stream, idx, icol, vals, vcol, rows, fmt.k, out,
               accumulate)
        return
    for row in range(rows):
        launch_over(_scatter, fmt.k, stream, idx, icol, vals, vcol, row, fmt.k, out,
                    accumulate or row > 0)
