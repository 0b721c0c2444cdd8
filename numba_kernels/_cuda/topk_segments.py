"""Device top-k of many segments, and gTop-k's merge and decode of them (see
numba_kernels.topk_segments): a block per segment, the segment's row of the table at
``cuda.blockIdx.x``, each block doing what the per-tensor one-block kernels do for one tensor.
"""
import numpy as np
from numba import cuda

from .. import _topk_segment_table as T
from .geometry import THREADS
from .launch import launch
from .merge import PAST_EVERY_INDEX, lower_bound, union_entry
from .scratch import scratch
from .select import block_select

# The merge keeps four slices of its segment (union indices and values, output indices and
# values) live through the whole selection, where the per-tensor merge reads those arrays from
# its parameters: 80 registers, 3 blocks an SM instead of 4. Its grid is a bucket's small
# layers, one block each, well under the 3 x 132 blocks an H100 holds at once at that count.
REGISTER_BUDGET = {"_merge_segments": 80}


@cuda.jit(device=True)
def _zero_padding(msg, table, s):
    col = table[s, T.COL]
    for b in range(col + table[s, T.USED] + cuda.threadIdx.x, col + table[s, T.NBYTES],
                   THREADS):
        msg[b] = 0


@cuda.jit
def _compress_segments(x, e, has_res, table, ints, floats, msg):
    """Segment s = blockIdx.x: c = x + e formed in e (with error feedback), then the exact
    top-k of c, its padding zeroed (``_one_block_topk`` on the segment's slices)."""
    s = cuda.blockIdx.x
    _zero_padding(msg, table, s)
    n = table[s, T.X_LEN]
    if has_res:
        start, r_off = table[s, T.X_OFF], table[s, T.R_OFF]
        for i in range(cuda.threadIdx.x, n, THREADS):
            e[r_off + i] = e[r_off + i] + x[start + i]
        cuda.syncthreads()   # every c is formed before any thread reads one
        arr = e[r_off:r_off + n]
    else:
        arr = x[table[s, T.X_OFF]:table[s, T.X_OFF] + n]
    k = table[s, T.K]
    if k > 0:   # the same for the whole block: its barriers are safe
        out_idx = ints[table[s, T.ICOL]:table[s, T.ICOL] + k]
        out_val = floats[table[s, T.VCOL]:table[s, T.VCOL] + k]
        block_select(arr, arr, out_idx, False, n, k, out_idx, out_val, arr, has_res)


@cuda.jit
def _merge_segments(ia, fa, ib, fb, io, fo, mo, table, uidx_all, uval_all):
    """Segment s = blockIdx.x: the union of its lists in a and b (prefilled past every index),
    then its exact top-k (``_one_block_merge`` on the segment's columns)."""
    s = cuda.blockIdx.x
    k, icol, vcol = table[s, T.K], table[s, T.ICOL], table[s, T.VCOL]
    _zero_padding(mo, table, s)
    if k == 0:
        return
    m = 2 * k
    uidx = uidx_all[table[s, T.U_OFF]:table[s, T.U_OFF] + m]
    uval = uval_all[table[s, T.U_OFF]:table[s, T.U_OFF] + m]
    tid = cuda.threadIdx.x
    for j in range(tid, m, THREADS):
        uidx[j] = PAST_EVERY_INDEX
        uval[j] = np.float32(0)
    cuda.syncthreads()
    a_idx = ia[icol:icol + k]
    b_idx = ib[icol:icol + k]
    for j in range(tid, m, THREADS):
        union_entry(a_idx, fa[vcol:vcol + k], b_idx, fb[vcol:vcol + k], uidx, uval, j)
    cuda.syncthreads()
    block_select(uval, uval, uidx, True, m, k, io[icol:icol + k], fo[vcol:vcol + k], uval,
                 False)


@cuda.jit
def _decompress_segments(isel, fsel, isent, fsent, out, e, has_res, table, factor):
    """Segment s = blockIdx.x: its place zeroed and what its selection dropped restored to its
    residual, then (after the barrier: sent may be the selected message itself) its selected
    values scaled in place and scattered."""
    s = cuda.blockIdx.x
    k, icol, vcol = table[s, T.K], table[s, T.ICOL], table[s, T.VCOL]
    start, n = table[s, T.X_OFF], table[s, T.X_LEN]
    tid = cuda.threadIdx.x
    mine = out[start:start + n]
    for i in range(tid, n, THREADS):
        mine[i] = np.float32(0)
    chosen = isel[icol:icol + k]
    if has_res:
        resid = e[table[s, T.R_OFF]:table[s, T.R_OFF] + n]
        for j in range(tid, k, THREADS):
            i = isent[icol + j]
            at = lower_bound(chosen, i)
            if not (at < k and chosen[at] == i):
                resid[i] = resid[i] + fsent[vcol + j]
    cuda.syncthreads()
    for j in range(tid, k, THREADS):
        v = fsel[vcol + j]
        if factor != 1:
            v = v * factor
            fsel[vcol + j] = v
        mine[chosen[j]] = v


def compress(x, e, table, ints, floats, msg, stream):
    """1 launch: every segment of ``table`` selected into its columns of the message."""
    has_res = e is not None
    launch(_compress_segments, table.shape[0], THREADS, stream, x, e if has_res else x,
           has_res, table, ints, floats, msg)


def merge(ia, fa, ib, fb, io, fo, mo, table, union_size, stream):
    """1 launch: every segment of ``table`` merged from messages a and b into ``mo``."""
    uidx = scratch("topk_segments.union_idx", max(union_size, 1), np.int64, stream)
    uval = scratch("topk_segments.union_val", max(union_size, 1), np.float32, stream)
    launch(_merge_segments, table.shape[0], THREADS, stream, ia, fa, ib, fb, io, fo, mo, table,
           uidx, uval)


def decompress(isel, fsel, isent, fsent, out, e, table, factor, stream):
    """1 launch: every segment of ``table`` restored (with ``e``), scaled and decoded."""
    has_res = e is not None
    launch(_decompress_segments, table.shape[0], THREADS, stream, isel, fsel, isent, fsent,
           out, e if has_res else out, has_res, table, factor)
