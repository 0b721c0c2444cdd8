"""Device building blocks shared by every CUDA kernel.

Mirrors ``numba_kernels._scalar``: the same FMA, bit casts and RNG, and the
block-level version of the wire summation order (thread t of a block owns
lanes t, t + THREADS, ... of the LANES lanes; see ``geometry`` for the block
size).  Also the small utility kernels ``fill``, ``scale`` and
``scale_columns``, which bagua_mpi launches on its own device buffers too.
"""
import math

import numpy as np
from numba import cuda

from .._scalar import (LANES, SEGMENT, add_or_replace_py, greater_py, hash32_py, lesser_py,
                       range_max_py, range_min_py, row_key_py, uniform24_py)
from .geometry import GROUP, GROUPS, ILP, NL, SIM, SIM_SHAPES, THREADS, WARP
from .launch import launch_over

uniform24 = cuda.jit(device=True)(uniform24_py)
# Numba's builtin min/max are generic overloads that the CUDA target of some
# Numba versions fails to compile; these are plain comparisons.
lesser = cuda.jit(device=True)(lesser_py)
greater = cuda.jit(device=True)(greater_py)
# A range's min/max, NaN where either operand is (the CPU twin's ``range_min``): the
# reductions below fold a chunk's range with them, so that a NaN reaches every lane whatever
# lane and order it starts from (``lesser`` passed it on to some lanes of a butterfly only).
range_min = cuda.jit(device=True)(range_min_py)
range_max = cuda.jit(device=True)(range_max_py)
hash32 = cuda.jit(device=True)(hash32_py)
add_or_replace = cuda.jit(device=True)(add_or_replace_py)
row_key = cuda.jit(device=True)(row_key_py)


if SIM:
    def _fma_exact(a, b, c):
        """float32 a*b + c rounded once, computed in float64 with an exact error term."""
        a, b, c = float(np.float32(a)), float(np.float32(b)), float(np.float32(c))
        p = a * b                      # exact: 24 + 24 significant bits fit a double
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)    # Knuth's TwoSum: s + err == p + c exactly
        y = np.float32(s)
        if err != 0.0 and float(y) != s and math.isfinite(s):
            if float(y) > s:
                lo, hi = np.nextafter(y, np.float32(-np.inf)), y
            else:
                lo, hi = y, np.nextafter(y, np.float32(np.inf))
            if (float(lo) + float(hi)) * 0.5 == s:   # s sits on a float32 tie
                y = hi if err > 0.0 else lo
        return y

    @cuda.jit(device=True)
    def fma32(a, b, c):
        return _fma_exact(a, b, c)

    @cuda.jit(device=True)
    def mul32(a, b):
        return _fma_exact(a, b, 0.0)

    @cuda.jit(device=True)
    def f32_bits(x):
        return np.float32(x).view(np.uint32)

    @cuda.jit(device=True)
    def bits_f32(u):
        return np.uint32(u).view(np.float32)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def fma32(a, b, c):
        return cuda.fma(np.float32(a), np.float32(b), np.float32(c))

    @cuda.jit(device=True)
    def mul32(a, b):
        return cuda.fma(np.float32(a), np.float32(b), np.float32(0.0))

    @cuda.jit(device=True)
    def f32_bits(x):
        return np.uint32(libdevice.float_as_int(np.float32(x)))

    @cuda.jit(device=True)
    def bits_f32(u):
        return libdevice.int_as_float(np.int32(u))


# Warp operations: shared-memory stand-ins in the simulator's own shapes, the intrinsics on
# a GPU (and in the simulator with NUMBA_KERNELS_GPU_SHAPES=1, which gives it them).
if SIM_SHAPES:
    @cuda.jit(device=True)
    def warp_range(mn, mx, shmin, shmax):
        """(min, max) of (mn, mx) over the caller's WARP threads, through shared memory (no
        warp shuffles in the simulator's shapes), NaN if any is; every thread of the block
        must call it."""
        t = cuda.threadIdx.x
        shmin[t] = mn
        shmax[t] = mx
        cuda.syncthreads()
        first = t - t % WARP
        for j in range(WARP):
            mn = range_min(mn, shmin[first + j])
            mx = range_max(mx, shmax[first + j])
        cuda.syncthreads()
        return mn, mx

    @cuda.jit(device=True)
    def lane_group_or(v, group, scratch):
        """The OR of ``v`` over the caller's group of ``group`` lanes (a power of two up to 32,
        groups aligned in the warp), through shared memory (no warp shuffles in the
        simulator's shapes).  Every thread of the block must call it; ``scratch``: shared
        uint32[THREADS] or longer."""
        t = cuda.threadIdx.x
        scratch[t] = v
        cuda.syncthreads()
        first = t - t % group
        word = np.uint32(0)
        for j in range(group):
            word |= scratch[first + j]
        cuda.syncthreads()
        return word

    @cuda.jit(device=True)
    def ballot32(pred, scratch):
        """Warp vote without warp intrinsics (the simulator's shapes): bit j of the
        result is ``pred`` of lane j of the caller's warp.  Every thread of the block
        must call it; ``scratch`` is a shared uint32[THREADS]."""
        bit = np.uint32(1) if pred else np.uint32(0)
        return lane_group_or(bit << np.uint32(cuda.threadIdx.x & 31), 32, scratch)
else:
    @cuda.jit(device=True)
    def ballot32(pred, scratch):
        """Bit j = ``pred`` of lane j of the caller's warp (every lane must call)."""
        return np.uint32(cuda.ballot_sync(0xFFFFFFFF, pred))

    @cuda.jit(device=True)
    def warp_range(mn, mx, shmin, shmax):
        """(min, max) of (mn, mx) over the caller's warp, by butterfly shuffles (the shared
        arrays are the simulator's), NaN on every lane if any lane's is; every lane of the
        warp must call it."""
        for k in range(5):
            mn = range_min(mn, cuda.shfl_xor_sync(0xFFFFFFFF, mn, 1 << k))
            mx = range_max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 1 << k))
        return mn, mx

    @cuda.jit(device=True)
    def lane_group_or(v, group, scratch):
        """The OR of ``v`` over the caller's aligned group of ``group`` lanes (a power of two up
        to 32), by butterfly shuffles: every lane of the warp must call it."""
        for k in range(5):                  # unrolled: masks 1, 2, 4, 8, 16 below group
            if (1 << k) < group:
                v |= np.uint32(cuda.shfl_xor_sync(0xFFFFFFFF, np.int32(v), 1 << k))
        return v


def specialized(name, module=None):
    """``cuda.jit`` for a kernel that a factory builds once per compile-time constant, under
    ``name`` (and ``module``, for a factory shared by several modules): where its module binds
    it, by which the simulator suite's launch record and the PTX compile find it (each build
    would otherwise carry the factory's name)."""
    def jit(fn):
        fn.__name__ = fn.__qualname__ = name
        if module is not None:
            fn.__module__ = module
        return cuda.jit(fn)
    return jit


@cuda.jit(device=True)
def at(i):
    """Index i, never negative, as unsigned.  Numba wraps every signed index around for
    Python's negative indexing: a few instructions and two registers an access, which took
    the min-max stack decoder from 48 registers to 72 (``tests/kernels/ptx_compile.py
    --resources``)."""
    return np.uint64(i)


@cuda.jit(device=True)
def load_c(x, e, has_res, i):
    """c_i = x_i + e_i with error feedback, x_i without (in x's dtype).  Past x's end x_i is
    0: a row form's partition that the tensor ends short of reads as its zero padding (the
    sum 0 + e_i included, which turns -0.0 into +0.0 as the padded copy did)."""
    if i < x.size:
        xi = x[at(i)]
    else:
        xi = np.float32(0.0)
    if has_res:
        return xi + e[at(i)]
    return xi


@cuda.jit(device=True)
def ilp_index(base, u, n):
    """Element u of the thread's group (base, base + THREADS, ..., ILP of them) clamped to
    n - 1: the loads of the group stay in bounds without a branch, so they issue together;
    ``ilp_load`` and ``ilp_store`` check base + u * THREADS < n."""
    return lesser(base + u * THREADS, n - 1)


@cuda.jit(device=True)
def ilp_chunks(base, n, chunk, idx, cix, count):
    """idx[u] = ilp_index(base, u, n) and cix[u] = idx[u] // chunk for u < count (ILP, or
    GROUPS for the word decoders' groups), with one division: the indices rise with u, so each
    chunk index follows from the one before by stepping over chunk boundaries.  (A 64-bit
    division is a long instruction sequence on the device; taken per element and row it made
    the stack decoders compute-bound.)  The
    decoders keep cix in int32, which fits any chunk index of an array under 2**31 chunks and
    saves the 1-bit decoder 8 registers."""
    c = ilp_index(base, 0, n) // chunk
    end = (c + 1) * chunk          # the first element past chunk c
    for u in range(count):
        i = ilp_index(base, u, n)
        while i >= end:
            end += chunk
            c += 1
        idx[u] = i
        cix[u] = c


@cuda.jit(device=True)
def ilp_load(out, acc, base, n, accumulate):
    """acc[u] = out's element u of the group when accumulating (0 otherwise: not read)."""
    for u in range(ILP):
        acc[u] = 0
        if accumulate and base + u * THREADS < n:
            acc[u] = out[at(base + u * THREADS)]


@cuda.jit(device=True)
def ilp_store(out, acc, base, n):
    """out's element u of the group = acc[u], for the elements before n."""
    for u in range(ILP):
        if base + u * THREADS < n:
            out[at(base + u * THREADS)] = acc[u]


@cuda.jit(device=True)
def ilp_store_times(out, acc, base, n, factor):
    """out's element u of the group = acc[u] * factor (one rounded multiply: the bytes of a
    separate scaling pass; times 1 changes nothing), for the elements before n."""
    for u in range(ILP):
        if base + u * THREADS < n:
            out[at(base + u * THREADS)] = acc[u] * factor


@cuda.jit(device=True)
def group_load(out, acc, base, n, accumulate):
    """acc[u * GROUP + j] = out's element j of the thread's group u (groups base, base +
    THREADS, ..., GROUPS of them) when accumulating (0 otherwise: not read)."""
    for u in range(GROUPS):
        for j in range(GROUP):
            i = (base + u * THREADS) * GROUP + j
            acc[u * GROUP + j] = 0
            if accumulate and i < n:
                acc[u * GROUP + j] = out[at(i)]


@cuda.jit(device=True)
def group_store(out, vals, base, n):
    """out's element j of the thread's group u = vals[u * GROUP + j], for the elements
    before n."""
    for u in range(GROUPS):
        for j in range(GROUP):
            i = (base + u * THREADS) * GROUP + j
            if i < n:
                out[at(i)] = vals[u * GROUP + j]


@cuda.jit(device=True)
def group_store_times(out, acc, base, n, factor):
    """``group_store`` of acc times ``factor`` (one rounded multiply, as ``ilp_store_times``)."""
    for u in range(GROUPS):
        for j in range(GROUP):
            i = (base + u * THREADS) * GROUP + j
            if i < n:
                out[at(i)] = acc[u * GROUP + j] * factor


@cuda.jit(device=True)
def block_tree_sum(sh):
    """Pairwise tree over the LANES entries of shared ``sh``; all threads get sh[0]."""
    t = cuda.threadIdx.x
    w = LANES // 2
    while w > 0:
        for sub in range(NL):
            lane = t + sub * THREADS
            if lane < w:
                sh[lane] = sh[lane] + sh[lane + w]
        cuda.syncthreads()
        w //= 2
    total = sh[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def block_lane_sum(x, e, has_res, start, stop, square, sh):
    """Sum of float32(c) or float32(c)**2 over [start, stop) in the wire order."""
    t = cuda.threadIdx.x
    for sub in range(NL):
        lane = t + sub * THREADS
        acc = np.float32(0.0)
        j = start + lane
        while j < stop:
            v = np.float32(load_c(x, e, has_res, j))
            if square:
                acc = fma32(v, v, acc)
            else:
                acc = acc + abs(v)
            j += LANES
        sh[lane] = acc
    cuda.syncthreads()
    return block_tree_sum(sh)


@cuda.jit(device=True)
def block_lane_combine(part, first, count, sh):
    """Sum part[first + s] over s < count: segment s to lane s % LANES, then the tree."""
    t = cuda.threadIdx.x
    for sub in range(NL):
        lane = t + sub * THREADS
        acc = np.float32(0.0)
        s = lane
        while s < count:
            acc = acc + part[first + s]
            s += LANES
        sh[lane] = acc
    cuda.syncthreads()
    return block_tree_sum(sh)


@cuda.jit(device=True)
def tree_range(mn, mx, shmin, shmax):
    """Block-wide (min, max) of every thread's (mn, mx), returned to every thread: each warp's
    by shuffles, then the warps' from shared memory, two barriers in all (a tree in shared
    memory took one a level, nine).  Min and max are exact whatever the order, NaN if any
    operand is (``range_min``), and the chunk parameters turn -0.0 into +0.0 and store one NaN,
    so the payload is the CPU twin's."""
    t = cuda.threadIdx.x
    mn, mx = warp_range(mn, mx, shmin, shmax)
    if t % WARP == 0:
        shmin[t // WARP] = mn
        shmax[t // WARP] = mx
    cuda.syncthreads()
    mn = shmin[0]
    mx = shmax[0]
    for w in range(1, THREADS // WARP):
        mn = range_min(mn, shmin[w])
        mx = range_max(mx, shmax[w])
    cuda.syncthreads()
    return mn, mx


if SIM_SHAPES:
    @cuda.jit(device=True)
    def team_range(mn, mx, shmin, shmax):
        """(min, max) over the caller's team of TEAM threads: in the simulator's shapes the team
        is the block (``tree_range``)."""
        return tree_range(mn, mx, shmin, shmax)

    @cuda.jit(device=True)
    def team_sync():
        """Barrier of the caller's team: the block in the simulator's shapes."""
        cuda.syncthreads()
else:
    team_range = warp_range     # a team is a warp

    @cuda.jit(device=True)
    def team_sync():
        """Barrier of the caller's team (its warp): orders its shared-memory accesses."""
        cuda.syncwarp(0xFFFFFFFF)


@cuda.jit(device=True)
def block_range(x, e, has_res, start, stop, shmin, shmax):
    """(min, max) of float32(c) over [start, stop), returned to every thread; NaN if any
    element is."""
    mn = np.float32(np.inf)
    mx = np.float32(-np.inf)
    j = start + cuda.threadIdx.x
    while j < stop:
        v = np.float32(load_c(x, e, has_res, j))
        mn = range_min(mn, v)
        mx = range_max(mx, v)
        j += THREADS
    return tree_range(mn, mx, shmin, shmax)


@cuda.jit(device=True)
def zero_tail(buf8, used, nbytes):
    """Block 0, thread 0 zeroes the payload's padding bytes [used, nbytes)."""
    if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
        for b in range(used, nbytes):
            buf8[b] = 0


@cuda.jit
def _fill(arr, value):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < arr.size:
        arr[i] = value
        i += stride


def fill(arr, value, stream=0):
    """arr[:] = value for a 1-D device array.  Device launches: 1 (none for an empty array)."""
    if arr.size:
        launch_over(_fill, arr.size, stream, arr, value, max_blocks=1024)


@cuda.jit(device=True)
def segment(g, spc, chunk, n):
    """Block g's (chunk index, start, stop) when each chunk has spc SEGMENT-long segments."""
    ci = g // spc
    start = ci * chunk + (g % spc) * SEGMENT
    stop = lesser(start + SEGMENT, lesser(ci * chunk + chunk, n))
    return ci, start, stop


@cuda.jit(device=True)
def seg_sum_block(x, e, has_res, size, chunk, spc, square, part):
    """part[g] = wire-order sum over block g's segment of the ``size`` elements."""
    sh = cuda.shared.array(LANES, np.float32)
    g = cuda.blockIdx.x
    ci, s, t = segment(g, spc, chunk, size)
    if s < t:
        total = block_lane_sum(x, e, has_res, s, t, square, sh)
        if cuda.threadIdx.x == 0:
            part[g] = total


@cuda.jit
def seg_sums(x, e, has_res, chunk, spc, square, part):
    """part[g] = wire-order sum over block g's segment (long chunks only)."""
    seg_sum_block(x, e, has_res, x.size, chunk, spc, square, part)


@cuda.jit
def seg_sums_rows(x, e, has_res, n, chunk, spc, square, part):
    """part[k, g] = ``seg_sums`` of block (g, k) over partition k (x[k * n:(k + 1) * n])."""
    k = cuda.blockIdx.y
    seg_sum_block(x[k * n:(k + 1) * n], e[k * n:(k + 1) * n], has_res, n, chunk, spc, square,
                  part[k])


@cuda.jit(device=True)
def block_row_key(prefix, phase):
    """``row_key`` of the block's row (blockIdx.y), computed once and shared with the block."""
    sh = cuda.shared.array(1, np.uint64)
    if cuda.threadIdx.x == 0:
        sh[0] = row_key(prefix, np.uint64(cuda.blockIdx.y), phase)
    cuda.syncthreads()
    key = sh[0]
    return key


@cuda.jit
def _scale(arr, factor):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < arr.size:
        arr[i] = arr[i] * factor
        i += stride


def scale(arr, factor, stream=0):
    """arr[:] *= factor (in arr's dtype) for a 1-D device array.

    Device launches: 1 (none for an empty array)."""
    if arr.size:
        launch_over(_scale, arr.size, stream, arr, factor, max_blocks=1024)


@cuda.jit
def _scale_columns(arr, col, width, factor):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < arr.shape[0] * width:
        row = i // width
        at = col + i - row * width
        arr[row, at] = arr[row, at] * factor
        i += stride


def scale_columns(arr, col, width, factor, stream=0):
    """arr[:, col:col + width] *= factor (in arr's dtype) for a 2-D device array, every row.

    Device launches: 1 (none when there is nothing to scale)."""
    if arr.shape[0] and width:
        launch_over(_scale_columns, arr.shape[0] * width, stream, arr, col, width, factor,
                    max_blocks=1024)
