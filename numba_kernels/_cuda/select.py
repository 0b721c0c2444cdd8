"""Exact top-k selection on the device: radix select, then ordered compaction.

Same definition as the CPU twin (``numba_kernels._select``): keep keys > T
and the first r keys == T in position order, listed by position.

Kernels, all on one stream, with no host round trip and no allocation once the
thread's scratch arrays exist (``scratch.py``):
  1. four launches of ``_round``: each block histograms one key byte (256
     bins, in shared memory) of the keys whose higher bytes match the prefix
     found so far and adds it to a global histogram; the last block to finish
     (a ticket taken after a memory fence) walks the bins from the top, fixes
     that byte of T and the remaining rank, and leaves the histogram and the
     ticket zeroed for the next round.  Afterwards state = [T, r, ...];
  2. ``_count``: per tile of TILE elements, how many keys are > T and == T;
  3. ``_scan``: one block turns the per-tile counts into exclusive offsets and
     stores the number selected in state[TAKEN];
  4. ``_compact``: each tile loads its keys to shared memory, each thread
     counts its ITEMS consecutive keys, a block scan gives every thread its
     output position, and the selected (index, value) pairs are written in
     order.

Up to ONE_BLOCK_KEYS keys, one block does all of it in one launch
(``block_select``): the four radix rounds with the histogram in shared
memory, then the tiles compacted one after another, each tile's offsets the
running counts of the tiles before it.  Top-k (``one_block_topk``) and the
gTop-k merge (``merge.py``) fuse their preparation into that launch.

Where the keys come from (``how``): ``FULL``, arr[:n] with the positions as
indices; ``MAPPED``, a candidate list cand[:n] whose indices are cidx[:n];
``DECIDED``, whichever of the two the device chose earlier on the stream
(state[MODE]; the candidates' length in state[LEN]), so that the approximate
method needs no host read to fall back to the full array.
"""
import numpy as np
from numba import cuda

from .._sparse_rules import keep_entry_py
from .common import f32_bits, fill, lesser
from .geometry import ITEMS, THREADS, TILE, blocks_for
from .launch import launch
from .scratch import scratch

_ABS = np.uint32(0x7FFFFFFF)
_HIST_BLOCKS = 2048
# Up to this many keys one block does a whole selection in 1 launch instead of the grid's 7
# (``block_select``: five passes over the keys, read from L2).  A launch costs the host about
# 50 us through Numba (H100 machine); one block's five passes over 32,768 keys should cost the
# device less than the six launches they replace (chosen, not measured on a GPU).
ONE_BLOCK_KEYS = 8 * TILE
keep_entry = cuda.jit(device=True)(keep_entry_py)

# Sources of the keys (see the module docstring).
FULL, MAPPED, DECIDED = 0, 1, 2
# Slots of a selection's int64 state array.
T, R, TAKEN, TICKET, LEN, MODE = 0, 1, 2, 3, 4, 5
STATE_SLOTS = 8


@cuda.jit(device=True)
def key_of(arr, i):
    """Magnitude key of float32(arr[i])."""
    return f32_bits(np.float32(arr[i])) & _ABS


@cuda.jit(device=True)
def _uses_cand(how, state):
    return how == MAPPED or (how == DECIDED and state[MODE] == 1)


@cuda.jit(device=True)
def _length(n, how, state):
    """Number of keys of the source: n, or the candidates the device counted."""
    if how == DECIDED and state[MODE] == 1:
        return state[LEN]
    return np.int64(n)


@cuda.jit(device=True)
def _key(arr, cand, use_cand, i):
    if use_cand:
        return np.int64(key_of(cand, i))
    return np.int64(key_of(arr, i))


@cuda.jit(device=True)
def _bin_key(bins, key, shift, prefix):
    """Count ``key`` in its bin of byte ``shift`` if its higher bytes match ``prefix``."""
    if shift == 24 or (key >> (shift + 8)) == (prefix >> (shift + 8)):
        cuda.atomic.add(bins, (key >> shift) & 255, 1)


@cuda.jit(device=True)
def _walk(bins, rem):
    """From the top bin down: the bin holding the rem-th largest key, and its rank in there."""
    d = 255
    while d > 0 and bins[d] < rem:
        rem -= bins[d]
        d -= 1
    return d, rem


@cuda.jit
def _round(arr, cand, n, how, state, k, shift, hist):
    """One radix round over the source's keys: histogram byte ``shift``, then (last block)
    fix it.  Round 1 (shift 24) starts from rank k and no prefix; later rounds read them."""
    sh = cuda.shared.array(256, np.int32)
    tot = cuda.shared.array(256, np.int64)
    last = cuda.shared.array(1, np.int32)
    tid = cuda.threadIdx.x
    for b in range(tid, 256, THREADS):
        sh[b] = 0
    cuda.syncthreads()
    use_cand = _uses_cand(how, state)
    m = _length(n, how, state)
    prefix = np.int64(0)
    if shift != 24:
        prefix = state[T]
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < m:
        _bin_key(sh, _key(arr, cand, use_cand, i), shift, prefix)
        i += stride
    cuda.syncthreads()
    for b in range(tid, 256, THREADS):
        if sh[b] > 0:
            cuda.atomic.add(hist, b, np.int64(sh[b]))
    # this block's additions land before its ticket: the last block sees every block's
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        last[0] = 1 if cuda.atomic.add(state, TICKET, 1) == cuda.gridDim.x - 1 else 0
    cuda.syncthreads()
    if last[0] == 0:
        return
    for b in range(tid, 256, THREADS):
        tot[b] = cuda.atomic.exch(hist, b, np.int64(0))   # read from L2 and leave the bin zeroed
    cuda.syncthreads()
    if tid == 0:
        rem = np.int64(k)
        if shift != 24:
            rem = state[R]
        d, rem = _walk(tot, rem)
        state[T] = prefix | (np.int64(d) << shift)
        state[R] = rem
        state[TICKET] = 0


@cuda.jit
def _count(arr, cand, n, how, state, blk):
    shc = cuda.shared.array(2, np.int32)
    tid = cuda.threadIdx.x
    if tid < 2:
        shc[tid] = 0
    cuda.syncthreads()
    use_cand = _uses_cand(how, state)
    m = _length(n, how, state)
    thr = state[T]
    base = cuda.blockIdx.x * TILE
    gt = 0
    eq = 0
    for j in range(ITEMS):
        i = base + j * THREADS + tid
        if i < m:
            key = _key(arr, cand, use_cand, i)
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
    gt_mine = np.int64(0)
    eq_mine = np.int64(0)
    for b in range(lo, hi):
        gt_mine += blk[b, 0]
        eq_mine += blk[b, 1]
    # one scan per count, not both packed in one int64 as a tile's are: over the whole array
    # the ties can pass 2^31 (a threshold of zero in a mostly zero gradient ties every zero)
    gt_off, gt_total = _block_scan(gt_mine, sh)
    eq_off, eq_total = _block_scan(eq_mine, sh)
    for b in range(lo, hi):
        g = blk[b, 0]
        q = blk[b, 1]
        blk[b, 0] = gt_off
        blk[b, 1] = eq_off
        gt_off += g
        eq_off += q
    if tid == 0:
        state[TAKEN] = gt_total + lesser(eq_total, state[R])


@cuda.jit(device=True)
def _compact_tile(arr, cand, cidx, use_cand, m, base, thr, r, gt, eq, out_idx, out_val, resid,
                  has_res, keys, sh):
    """Write the keys > thr and the first r keys == thr of the tile at ``base`` at their
    output positions, given gt keys > thr and eq keys == thr before the tile; return the
    tile's own counts, packed (gt in the low 32 bits, eq above).  Every thread of the block
    calls it."""
    tid = cuda.threadIdx.x
    for j in range(ITEMS):
        i = base + j * THREADS + tid
        if i < m:
            keys[j * THREADS + tid] = np.uint32(_key(arr, cand, use_cand, i))
    cuda.syncthreads()
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
    gt += before & 0xFFFFFFFF
    eq += before >> 32
    for j in range(ITEMS):
        i = base + mine + j
        if i < m:
            key = np.int64(keys[mine + j])
            take = key > thr
            if key == thr:
                take = eq < r
            if take:
                if use_cand:
                    keep_entry(cidx[i], np.float32(cand[i]), gt + lesser(eq, r), out_idx,
                               out_val, resid, has_res)
                else:
                    keep_entry(i, np.float32(arr[i]), gt + lesser(eq, r), out_idx, out_val,
                               resid, has_res)
            if key > thr:
                gt += 1
            elif key == thr:
                eq += 1
    return total


@cuda.jit
def _compact(arr, cand, cidx, n, how, state, blk, out_idx, out_val, resid, has_res):
    keys = cuda.shared.array(TILE, np.uint32)
    sh = cuda.shared.array(THREADS, np.int64)
    b = cuda.blockIdx.x
    _compact_tile(arr, cand, cidx, _uses_cand(how, state), _length(n, how, state), b * TILE,
                  state[T], state[R], blk[b, 0], blk[b, 1], out_idx, out_val, resid, has_res,
                  keys, sh)


@cuda.jit
def _gather_candidates(arr, n, cstate, blk, k, cap, cidx, cval, sel):
    """The approximate method's candidates: when k <= count <= cap (cstate: threshold and
    count), compact the keys above the threshold into (cidx, cval) in position order; block
    0 records the choice for the selection that follows (sel's MODE 1 and LEN = count, or
    MODE 0: select over the whole array)."""
    keys = cuda.shared.array(TILE, np.uint32)
    sh = cuda.shared.array(THREADS, np.int64)
    count = cstate[TAKEN]
    ok = k <= count and count <= cap
    if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
        sel[MODE] = 1 if ok else 0
        sel[LEN] = count
    if ok:   # the same for every thread of the block: the block scan's barriers are safe
        b = cuda.blockIdx.x
        _compact_tile(arr, arr, cidx, False, np.int64(n), b * TILE, cstate[T], cstate[R],
                      blk[b, 0], blk[b, 1], cidx, cval, cval, False, keys, sh)


@cuda.jit(device=True)
def _block_kth(arr, cand, use_cand, m, k, bins, found):
    """(T, r) of the source's first m keys, found by one block alone: four radix rounds over
    the keys, each histogramming one byte in shared memory (``bins``: 256 int32; ``found``:
    2 int64).  Every thread of the block calls it and gets the same pair."""
    tid = cuda.threadIdx.x
    if tid == 0:
        found[0] = 0
        found[1] = k
    shift = 24
    while shift >= 0:
        for b in range(tid, 256, THREADS):
            bins[b] = 0
        cuda.syncthreads()
        prefix = found[0]
        for i in range(tid, m, THREADS):
            _bin_key(bins, _key(arr, cand, use_cand, i), shift, prefix)
        cuda.syncthreads()
        if tid == 0:
            d, rem = _walk(bins, found[1])
            found[0] = prefix | (np.int64(d) << shift)
            found[1] = rem
        cuda.syncthreads()
        shift -= 8
    thr = found[0]
    r = found[1]
    cuda.syncthreads()   # every thread has read ``found`` before a later call resets it
    return thr, r


@cuda.jit(device=True)
def block_select(arr, cand, cidx, use_cand, m, k, out_idx, out_val, resid, has_res):
    """The whole exact selection by one block (every thread calls it): the k-th key, then
    the tiles compacted in order, each starting from the counts of the tiles before it."""
    bins = cuda.shared.array(256, np.int32)
    found = cuda.shared.array(2, np.int64)
    keys = cuda.shared.array(TILE, np.uint32)
    sh = cuda.shared.array(THREADS, np.int64)
    thr, r = _block_kth(arr, cand, use_cand, m, k, bins, found)
    gt = np.int64(0)
    eq = np.int64(0)
    base = np.int64(0)
    while base < m:
        total = _compact_tile(arr, cand, cidx, use_cand, m, base, thr, r, gt, eq, out_idx,
                              out_val, resid, has_res, keys, sh)
        gt += total & 0xFFFFFFFF
        eq += total >> 32
        base += TILE
        cuda.syncthreads()   # the tile's keys are read before the next tile overwrites them


@cuda.jit
def _sample_threshold(sample, m, ks, cstate):
    """One block: T = the ks-th largest key of sample[:m]; cstate = [T - 1, 0] selects the
    keys >= T (keys > T - 1, no ties to take)."""
    bins = cuda.shared.array(256, np.int32)
    found = cuda.shared.array(2, np.int64)
    thr, _ = _block_kth(sample, sample, False, m, ks, bins, found)
    if cuda.threadIdx.x == 0:
        cstate[T] = thr - 1
        cstate[R] = 0


@cuda.jit
def _one_block_topk(x, arr, has_res, n, k, out_idx, out_val):
    """compress_topk's selection by one block: with error feedback c = x + e is formed in
    ``arr`` (= e) first, and the selected values are taken out of it."""
    if has_res:
        for i in range(cuda.threadIdx.x, n, THREADS):
            arr[i] = arr[i] + x[i]
        cuda.syncthreads()   # every c is formed before any thread reads one
    block_select(arr, arr, out_idx, False, n, k, out_idx, out_val, arr, has_res)


def one_block(m):
    """Whether a selection over m keys runs in one block (``ONE_BLOCK_KEYS``)."""
    return m <= ONE_BLOCK_KEYS


def one_block_topk(x, e, k, out_idx, out_val, stream):
    """1 launch: the k largest keys of x (+ e, formed in e and updated in place) into
    (out_idx, out_val), x of at most ONE_BLOCK_KEYS elements and k >= 1."""
    has_res = e is not None
    launch(_one_block_topk, 1, THREADS, stream, x, e if has_res else x, has_res, x.size, k,
           out_idx, out_val)


def _zeroed(stream):
    return lambda arr: fill(arr, 0, stream)


def sample_threshold(sample, m, ks, cstate, stream):
    """1 launch (one block): cstate selects the keys >= the ks-th largest of sample[:m]."""
    launch(_sample_threshold, 1, THREADS, stream, sample, m, ks, cstate)


def gather_candidates(arr, n, cstate, blk, k, cap, cidx, cval, sel, stream):
    """1 launch: the candidates above cstate's threshold into (cidx, cval) when k <= their
    count <= cap, and sel's MODE saying whether they were (``blk``: count_and_scan's)."""
    launch(_gather_candidates, blk.shape[0], THREADS, stream, arr, n, cstate, blk, k, cap, cidx,
           cval, sel)


def new_state(stream, name="select.state"):
    """A selection's int64 state (scratch, ticket zeroed: ``_round`` leaves it so)."""
    return scratch(name, STATE_SLOTS, np.int64, stream, on_allocate=_zeroed(stream))


def _hist(stream):
    """The global 256-bin histogram (scratch; every ``_round`` leaves it zeroed)."""
    return scratch("select.hist", 256, np.int64, stream, on_allocate=_zeroed(stream))


def tile_counts(n, stream):
    """Per-tile (gt, eq) counts for n keys (scratch)."""
    return scratch("select.tiles", (blocks_for(n, TILE), 2), np.int64, stream)


def count_and_scan(arr, cand, n, how, state, blk, stream):
    """Steps 2-3, 2 launches: per-tile offsets for ``state``'s threshold; state[TAKEN] = count."""
    nblk = blk.shape[0]
    launch(_count, nblk, THREADS, stream, arr, cand, n, how, state, blk)
    launch(_scan, 1, THREADS, stream, blk, nblk, state)


def select(arr, cand, cidx, n, how, k, out_idx, out_val, resid, state, stream):
    """The k largest keys of the source (``how``; n: its length, or the most it can be) into
    (out_idx, out_val), in position order.  7 launches, no host synchronisation."""
    hist = _hist(stream)
    grid = min(blocks_for(n, THREADS * 8), _HIST_BLOCKS)
    for shift in (24, 16, 8, 0):
        launch(_round, grid, THREADS, stream, arr, cand, n, how, state, k, shift, hist)
    blk = tile_counts(n, stream)
    count_and_scan(arr, cand, n, how, state, blk, stream)
    has_res = resid is not None
    launch(_compact, blk.shape[0], THREADS, stream, arr, cand, cidx, n, how, state, blk, out_idx,
           out_val, resid if has_res else out_val, has_res)


def select_exact(arr, m, k, out_idx, out_val, index_map, resid, stream):
    """The k largest keys of arr[:m] into (out_idx, out_val), in position order (index_map:
    the output index of position i is index_map[i]; resid: error feedback at those indices).

    Launches: 7 (4 radix rounds, count, scan, compact); none when k or m is 0; +2 the
    first time a thread selects on a stream (zeroing its cached state and histogram).
    No host synchronisation.
    """
    if k == 0 or m == 0:
        return
    state = new_state(stream)
    if index_map is None:
        select(arr, arr, out_idx, m, FULL, k, out_idx, out_val, resid, state, stream)
    else:
        select(arr, arr, index_map, m, MAPPED, k, out_idx, out_val, resid, state, stream)
