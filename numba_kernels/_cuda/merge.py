"""Device merges for gTop-k (see numba_kernels.merge)."""
import numpy as np
from numba import cuda

from . import select
from .common import fill
from .geometry import THREADS
from .launch import launch, launch_over
from .scratch import scratch

PAST_EVERY_INDEX = np.iinfo(np.int64).max


@cuda.jit(device=True)
def lower_bound(arr, value):
    """First position in ascending arr whose entry is >= value."""
    lo = 0
    hi = arr.size
    while lo < hi:
        mid = (lo + hi) // 2
        if arr[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


@cuda.jit(device=True)
def union_entry(ia, va, ib, vb, uidx, uval, j):
    """Place entry j of the concatenation a, b at its position in the union."""
    ka = ia.size
    if j < ka:
        i = ia[j]
        at = lower_bound(ib, i)
        v = va[j]
        if at < ib.size and ib[at] == i:
            v = v + vb[at]
        uidx[j + at] = i
        uval[j + at] = v
    elif j < ka + ib.size:
        jb = j - ka
        i = ib[jb]
        at = lower_bound(ia, i)
        if not (at < ka and ia[at] == i):
            uidx[jb + at] = i
            uval[jb + at] = vb[jb]


@cuda.jit
def _union(ia, va, ib, vb, uidx, uval):
    union_entry(ia, va, ib, vb, uidx, uval, cuda.grid(1))


@cuda.jit
def _one_block_merge(ia, va, ib, vb, uidx, uval, m, k, out_idx, out_val):
    """The whole merge by one block: prefill, union, exact selection, barriers between."""
    tid = cuda.threadIdx.x
    for j in range(tid, m, THREADS):
        uidx[j] = PAST_EVERY_INDEX
        uval[j] = np.float32(0)
    cuda.syncthreads()
    for j in range(tid, m, THREADS):
        union_entry(ia, va, ib, vb, uidx, uval, j)
    cuda.syncthreads()
    select.block_select(uval, uval, uidx, True, m, k, out_idx, out_val, uval, False)


@cuda.jit
def _restore(resid, sidx, sval, gidx):
    j = cuda.grid(1)
    if j < sidx.size:
        i = sidx[j]
        at = lower_bound(gidx, i)
        if not (at < gidx.size and gidx[at] == i):
            resid[i] = resid[i] + sval[j]


def merge(va, vb, fmt, out_idx, out_val, buf, stream):
    """Union of the two payloads' views va, vb, then exact top-k into ``buf``.

    Launches: 1 while the union has at most ``select.ONE_BLOCK_KEYS`` entries
    (one block prefills, unites and selects), else 10 (prefill the union's
    indices and values, the union, the exact selection's 7); +1 zeroing the
    padding (int64 indices, odd k); none but that when k is 0.
    """
    if fmt.nbytes > fmt.used_nbytes:
        fill(buf[fmt.used_nbytes:], 0, stream)
    if fmt.k == 0:
        return
    m = va["indices"].size + vb["indices"].size
    uidx = scratch("merge.union_idx", m, np.int64, stream)
    uval = scratch("merge.union_val", m, np.float32, stream)
    if select.one_block(m):
        launch(_one_block_merge, 1, THREADS, stream, va["indices"], va["values"], vb["indices"],
               vb["values"], uidx, uval, m, fmt.k, out_idx, out_val)
        return
    # Slots left after removing duplicate indices stay as zero-valued entries
    # past every real one: they lose all ties, and k <= the union size means
    # they are never needed.
    fill(uidx, PAST_EVERY_INDEX, stream)
    fill(uval, 0, stream)
    launch_over(_union, m, stream, va["indices"], va["values"], vb["indices"], vb["values"], uidx,
                uval, max_blocks=None)
    select.select_exact(uval, m, fmt.k, out_idx, out_val, uidx, None, stream)


def restore(resid, sidx, sval, gidx, stream):
    """1 launch (none when nothing was sent): one thread per sent entry."""
    if sidx.size:
        launch_over(_restore, sidx.size, stream, resid, sidx, sval, gidx, max_blocks=None)
