"""Exact top-k selection on the device: radix select, then ordered compaction.

Same definition as the CPU twin (``numba_kernels._select``): keep keys > T
and the first r keys == T in position order, listed by position.

Kernels, all on one stream and with no host round trip:
  1. ``_init``: state = [0, k, 0];
  2. four rounds of ``_hist`` (256-bin histogram of one key byte among keys
     whose higher bytes match the prefix found so far) and ``_pick`` (one
     thread walks the bins from the top, fixes that byte of T and the
     remaining rank); afterwards state = [T, r, .];
  3. ``_count``: per tile of TILE elements, how many keys are > T and == T;
  4. ``_scan``: one block turns the per-tile counts into exclusive offsets and
     stores the number selected in state[2];
  5. ``_compact``: each tile loads its keys to shared memory, each thread
     counts its ITEMS consecutive keys, a block scan gives every thread its
     output position, and the selected (index, value) pairs are written in
     order.
"""
import numpy as np
from numba import cuda

from .._device import empty
from .._sparse_rules import keep_entry_py
from .common import f32_bits, fill, lesser
from .geometry import ITEMS, THREADS, TILE, blocks_for
from .launch import launch

_ABS = np.uint32(0x7FFFFFFF)
_HIST_BLOCKS = 2048
keep_entry = cuda.jit(device=True)(keep_entry_py)


@cuda.jit(device=True)
def key_of(arr, i):
    """Magnitude key of float32(arr[i])."""
    return f32_bits(np.float32(arr[i])) & _ABS


@cuda.jit
def _init(state, k):
    state[0] = 0
    state[1] = k
    state[2] = 0


@cuda.jit
def _hist(arr, m, state, shift, hist):
    sh = cuda.shared.array(256, np.int32)
    tid = cuda.threadIdx.x
    for b in range(tid, 256, THREADS):
        sh[b] = 0
    cuda.syncthreads()
    prefix = np.int64(state[0])
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < m:
        key = np.int64(key_of(arr, i))
        if shift == 24 or (key >> (shift + 8)) == (prefix >> (shift + 8)):
            cuda.atomic.add(sh, (key >> shift) & 255, 1)
        i += stride
    cuda.syncthreads()
    for b in range(tid, 256, THREADS):
        if sh[b] > 0:
            cuda.atomic.add(hist, b, np.int64(sh[b]))


@cuda.jit
def _pick(hist, state, shift):
    rem = state[1]
    d = 255
    while d > 0 and hist[d] < rem:
        rem -= hist[d]
        d -= 1
    state[0] = state[0] | (np.int64(d) << shift)
    state[1] = rem
    for b in range(256):
        hist[b] = 0


@cuda.jit
def set_threshold(sample_state, state):
    """Select keys >= the sample's threshold: T = threshold - 1, take no ties."""
    state[0] = sample_state[0] - 1
    state[1] = 0
    state[2] = 0


@cuda.jit
def _count(arr, m, state, blk):
    shc = cuda.shared.array(2, np.int32)
    tid = cuda.threadIdx.x
    if tid < 2:
        shc[tid] = 0
    cuda.syncthreads()
    thr = state[0]
    base = cuda.blockIdx.x * TILE
    gt = 0
    eq = 0
    for j in range(ITEMS):
        i = base + j * THREADS + tid
        if i < m:
            key = np.int64(key_of(arr, i))
            if key > thr:
                gt += 1
            elif key == thr:
                eq += 1
    if gt:
        cuda.atomic.add(shc, 0, gt)
    if eq:
        cuda.atomic.add(shc, 1, eq)
    cuda.syncthreads()
    if tid == 0:
        blk[cuda.blockIdx.x, 0] = shc[0]
        blk[cuda.blockIdx.x, 1] = shc[1]


@cuda.jit(device=True)
def _block_scan(val, sh):
    """(exclusive prefix, block total) of the threads' int64 values."""
    t = cuda.threadIdx.x
    sh[t] = val
    cuda.syncthreads()
    off = 1
    while off < THREADS:
        add = np.int64(0)
        if t >= off:
            add = sh[t - off]
        cuda.syncthreads()
        sh[t] += add
        cuda.syncthreads()
        off *= 2
    incl = sh[t]
    total = sh[THREADS - 1]
    cuda.syncthreads()
    return incl - val, total


@cuda.jit
def _scan(blk, nblk, state):
    sh = cuda.shared.array(THREADS, np.int64)
    tid = cuda.threadIdx.x
    per = (nblk + THREADS - 1) // THREADS
    lo = lesser(nblk, tid * per)
    hi = lesser(nblk, lo + per)
    packed = np.int64(0)             # gt count in the low 32 bits, eq count above
    for b in range(lo, hi):
        packed += np.int64(blk[b, 0]) + (np.int64(blk[b, 1]) << 32)
    before, total = _block_scan(packed, sh)
    gt_off = before & 0xFFFFFFFF
    eq_off = before >> 32
    for b in range(lo, hi):
        g = blk[b, 0]
        q = blk[b, 1]
        blk[b, 0] = gt_off
        blk[b, 1] = eq_off
        gt_off += g
        eq_off += q
    if tid == 0:
        state[2] = (total & 0xFFFFFFFF) + lesser(total >> 32, state[1])


@cuda.jit
def _compact(arr, m, state, blk, out_idx, out_val, index_map, use_map, resid,
             has_res):
    keys = cuda.shared.array(TILE, np.uint32)
    sh = cuda.shared.array(THREADS, np.int64)
    tid = cuda.threadIdx.x
    base = cuda.blockIdx.x * TILE
    for j in range(ITEMS):
        i = base + j * THREADS + tid
        if i < m:
            keys[j * THREADS + tid] = key_of(arr, i)
    cuda.syncthreads()
    thr = state[0]
    r = state[1]
    mine = tid * ITEMS
    packed = np.int64(0)
    for j in range(ITEMS):
        if base + mine + j < m:
            key = np.int64(keys[mine + j])
            if key > thr:
                packed += 1
            elif key == thr:
                packed += np.int64(1) << 32
    before, total = _block_scan(packed, sh)
    gt = blk[cuda.blockIdx.x, 0] + (before & 0xFFFFFFFF)
    eq = blk[cuda.blockIdx.x, 1] + (before >> 32)
    for j in range(ITEMS):
        i = base + mine + j
        if i < m:
            key = np.int64(keys[mine + j])
            take = key > thr
            if key == thr:
                take = eq < r
            if take:
                idx = i
                if use_map:
                    idx = index_map[i]
                keep_entry(idx, np.float32(arr[i]), gt + lesser(eq, r), out_idx, out_val, resid,
                           has_res)
            if key > thr:
                gt += 1
            elif key == thr:
                eq += 1


def new_state(stream):
    """The selection's [T, r, count, .] state on the device (no launch: set by ``_init``)."""
    return empty(4, np.int64, True, stream)


def find_threshold(arr, m, k, state, hist, stream):
    """Steps 1-2, 9 launches: leave [T, r] of the k largest keys of arr[:m] in ``state``."""
    launch(_init, 1, 1, stream, state, k)
    grid = min(blocks_for(m, THREADS * 8), _HIST_BLOCKS)
    for shift in (24, 16, 8, 0):
        launch(_hist, grid, THREADS, stream, arr, m, state, shift, hist)
        launch(_pick, 1, 1, stream, hist, state, shift)


def count_and_scan(arr, m, state, stream):
    """Steps 3-4, 2 launches: per-tile offsets for ``state``'s threshold; state[2] = count taken."""
    nblk = blocks_for(m, TILE)
    blk = empty((nblk, 2), np.int64, True, stream)
    launch(_count, nblk, THREADS, stream, arr, m, state, blk)
    launch(_scan, 1, THREADS, stream, blk, nblk, state)
    return blk


def compact(arr, m, state, blk, out_idx, out_val, index_map, resid, stream):
    """Step 5, 1 launch (index_map None: output positions themselves; resid None: no feedback)."""
    use_map = index_map is not None
    has_res = resid is not None
    launch(_compact, blk.shape[0], THREADS, stream, arr, m, state, blk, out_idx, out_val,
           index_map if use_map else out_idx, use_map, resid if has_res else arr, has_res)


def zeroed_hist(stream):
    """A zeroed 256-bin histogram (1 launch; ``_pick`` leaves it zeroed for the next round)."""
    hist = empty(256, np.int64, True, stream)
    fill(hist, 0, stream)
    return hist


def select_exact(arr, m, k, out_idx, out_val, index_map, resid, stream):
    """The k largest keys of arr[:m] into (out_idx, out_val), in position order.

    Launches: 13 (zero the histogram, ``find_threshold``'s 9, ``count_and_scan``'s 2,
    ``compact``); none when k or m is 0.  No host synchronisation.
    """
    if k == 0 or m == 0:
        return
    state = new_state(stream)
    find_threshold(arr, m, k, state, zeroed_hist(stream), stream)
    blk = count_and_scan(arr, m, state, stream)
    compact(arr, m, state, blk, out_idx, out_val, index_map, resid, stream)
