"""Scalar building blocks of the CPU twins, and the rules they share with the GPU.

The payloads are specified bit for bit, so a CPU rank and a GPU rank that
compress the same tensor send the same bytes.  Four things make that possible;
``_cuda/common.py`` holds their device versions:

* ``fma32(a, b, c)`` -- multiply-add rounded once.  CUDA compilers contract
  ``a * b + c`` into an FMA by themselves and CPU compilers do not; writing the
  FMA explicitly on both sides removes the difference.  ``mul32(a, b)`` is
  ``fma32(a, b, 0)``: a product the device compiler cannot fuse with a
  following addition.
* ``f32_bits`` / ``bits_f32`` reinterpret float32 <-> uint32.
* ``range_min`` / ``range_max`` fold a range that keeps a NaN: a NaN anywhere makes it NaN,
  whatever the order of the fold (``range_min_py``; LLVM's NaN-keeping intrinsics here).
* A counter-based RNG: element ``i`` draws ``mix64(key + (i + 1) * golden)``
  (SplitMix64's finaliser), the same number wherever and in whatever order it
  is processed.  QSGD's row form keys row k with ``row_key_py``: the stream
  key of the seed CRC-32(int64 words (base, rank, k, phase)) & 0x7FFFFFFF,
  derived on the device itself so that no per-row seed array is copied there.

Functions named ``*_py`` here and in the other leaf modules (``_bits``,
``_half_bits``, ``_chunk_rules``, ``_sparse_rules``) are plain integer/float
code without target-specific calls: the very same Python source is compiled by
``njit`` for the CPU and by ``cuda.jit(device=True)`` for the GPU.  The
``_cuda`` modules import these leaves, never the public modules that use them.

``segment_sum`` / ``chunk_sum`` define the summation order of every per-chunk
sum (QSGD norm, 1-bit scale).
"""
import zlib

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# Every per-chunk sum runs over this many lanes (one per thread of a 256-thread block).
LANES = 256
# A chunk longer than SEGMENT is summed per segment first (one thread block each).
SEGMENT = 4096

U64 = np.uint64
GOLDEN = U64(0x9E3779B97F4A7C15)
MIX1 = U64(0xBF58476D1CE4E5B9)
MIX2 = U64(0x94D049BB133111EB)
S27, S30, S31, S32, S40 = U64(27), U64(30), U64(31), U64(32), U64(40)
ONE64 = U64(1)
INV24 = np.float32(1.0 / (1 << 24))


def rng_key(seed):
    """Host side: the 64-bit stream key of a user seed (any Python int)."""
    z = (int(seed) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return U64(z ^ (z >> 31))


def _crc32_table():
    """zlib's CRC-32 (reflected polynomial 0xEDB88320) byte table, as uint64."""
    table = np.empty(256, U64)
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ (0xEDB88320 if c & 1 else 0)
        table[b] = c
    return table


CRC_TABLE = _crc32_table()
_CRC_MASK = 0xFFFFFFFF


def row_prefix(base, rank):
    """Host side: the CRC-32 register after the int64 words (base, rank), which ``row_key_py``
    continues with (row, phase).  Raises OverflowError where the words do not fit int64, as
    ``np.asarray(words, np.int64)`` does."""
    words = np.asarray([base, rank], dtype=np.int64)
    return U64(zlib.crc32(words.tobytes()) ^ _CRC_MASK)


def row_seed(base, rank, row, phase):
    """Host side: the 31-bit seed of row ``row``, CRC-32 of the little-endian int64 words
    (base, rank, row, phase) & 0x7FFFFFFF (bagua_mpi's ``call_seed(base, rank, row, phase)``)."""
    words = np.asarray([base, rank, row, phase], dtype=np.int64)
    return zlib.crc32(words.tobytes()) & 0x7FFFFFFF


def row_key_py(prefix, row, phase):
    """The stream key of row ``row`` of a batched stochastic compression: ``rng_key`` of
    ``row_seed(base, rank, row, phase)``, with ``prefix = row_prefix(base, rank)`` and
    ``row``, ``phase`` uint64 (two's complement of the int64 words).

    The CRC continues over the 16 bytes of (row, phase) a byte at a time through
    ``CRC_TABLE`` (a constant array on both targets); all uint64 arithmetic."""
    state = prefix
    for j in range(16):
        word = row if j < 8 else phase
        byte = (word >> U64(8 * (j & 7))) & U64(0xFF)
        state = CRC_TABLE[(state ^ byte) & U64(0xFF)] ^ (state >> U64(8))
    z = ((state ^ U64(0xFFFFFFFF)) & U64(0x7FFFFFFF)) + GOLDEN
    z = (z ^ (z >> S30)) * MIX1
    z = (z ^ (z >> S27)) * MIX2
    return z ^ (z >> S31)


def uniform24_py(key, i):
    """Element ``i``'s uniform draw in [0, 1), a multiple of 2**-24."""
    z = key + (U64(i) + ONE64) * GOLDEN
    z = (z ^ (z >> S30)) * MIX1
    z = (z ^ (z >> S27)) * MIX2
    z = z ^ (z >> S31)
    return np.float32(z >> S40) * INV24


def hash32_py(key, i):
    """Element ``i``'s 32 random bits (random-k keys, sample positions)."""
    z = key + (U64(i) + ONE64) * GOLDEN
    z = (z ^ (z >> S30)) * MIX1
    z = (z ^ (z >> S27)) * MIX2
    z = z ^ (z >> S31)
    return np.uint32(z >> S32)


def lesser_py(a, b):
    """min(a, b) as one comparison, the same on both targets (returns b on ties).

    A NaN ``a`` gives b (the comparison is false): the clamps rely on it, mapping a NaN
    level to their bound.  Ranges, which must keep a NaN, take ``range_min_py``."""
    return a if a < b else b


def greater_py(a, b):
    """max(a, b) as one comparison, the same on both targets (returns b on ties); a NaN ``a``
    gives b, as ``lesser_py``."""
    return a if a > b else b


def range_min_py(a, b):
    """min(a, b) that keeps a NaN: NaN where either operand is NaN (whichever NaN), else the
    smaller one (b on ties).  A fold of a chunk's range by it is NaN exactly when an element
    is, whatever the order of the fold (lane, warp butterfly, block), so every lane of a team
    and both targets agree on the chunk; ``lesser_py`` kept a NaN only where it came last.
    The NaN test is part of the one select: no second pass.  (No caller may compile it with
    fast math's nnan, which would fold ``a != a`` to false.)"""
    return a if (a < b or a != a) else b


def range_max_py(a, b):
    """max(a, b) that keeps a NaN, as ``range_min_py``."""
    return a if (a > b or a != a) else b


def add_or_replace_py(acc, value, add):
    """A decoded row folded into the output: acc + value, or value where the row replaces acc
    (the first row of a decode without accumulate).  Rows are folded in order on both targets."""
    return acc + value if add else value


lesser = njit(nogil=True, inline="always")(lesser_py)
add_or_replace = njit(nogil=True, inline="always")(add_or_replace_py)
greater = njit(nogil=True, inline="always")(greater_py)
uniform24 = njit(nogil=True, inline="always")(uniform24_py)
hash32 = njit(nogil=True, inline="always")(hash32_py)
row_key = njit(nogil=True)(row_key_py)


@intrinsic
def _fma(typingctx, a, b, c):
    """LLVM's ``llvm.fma``: a*b + c rounded once (a hardware FMA where present)."""
    if not (isinstance(a, types.Float) and a == b and b == c):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


def _nan_keeping(name):
    """LLVM's ``llvm.minimum`` / ``llvm.maximum`` (``name``) of two equal float types: IEEE
    754-2019 minimum / maximum, NaN where either operand is NaN (and -0.0 < +0.0)."""
    @intrinsic
    def call(typingctx, a, b):
        if not (isinstance(a, types.Float) and a == b):
            return None

        def codegen(context, builder, signature, args):
            ty = args[0].type
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty]),
                                                f"llvm.{name}.{ty.intrinsic_name}")
            return builder.call(fn, args)

        return a(a, b), codegen
    return call


_minimum = _nan_keeping("minimum")
_maximum = _nan_keeping("maximum")


@intrinsic
def _bitcast_f32_u32(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bitcast_u32_f32(typingctx, x):
    if x != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.uint32), codegen


@njit(nogil=True, inline="always")
def fma32(a, b, c):
    return _fma(np.float32(a), np.float32(b), np.float32(c))


@njit(nogil=True, inline="always")
def mul32(a, b):
    return _fma(np.float32(a), np.float32(b), np.float32(0.0))


# The CPU's ``range_min_py`` / ``range_max_py``: the same value, bar the sign of a zero that
# ties with a zero of the other sign (which the range's users canonicalise to +0.0), as LLVM's
# NaN-keeping intrinsics, which the loop vectoriser takes as a min/max reduction: the 8-bit
# encoder took 0.29 ns an element (one thread) against 0.68 with the earlier fast-math min()
# (nnan, which dropped NaNs) and 1.3 with the two-compare select, which it left scalar.  No
# fast-math flag applies to them (nnan on the call would let LLVM assume no NaN): the
# callers have none.
@njit(nogil=True, inline="always")
def range_min(a, b):
    return _minimum(a, b)


@njit(nogil=True, inline="always")
def range_max(a, b):
    return _maximum(a, b)


@njit(nogil=True, inline="always")
def f32_bits(x):
    return _bitcast_f32_u32(np.float32(x))


@njit(nogil=True, inline="always")
def bits_f32(u):
    return _bitcast_u32_f32(np.uint32(u))


@njit(nogil=True)
def lane_tree(acc):
    """Pairwise tree over LANES partial sums: acc[l] += acc[l + w] for w = 128, 64, .., 1."""
    w = LANES // 2
    while w > 0:
        for lane in range(w):
            acc[lane] = acc[lane] + acc[lane + w]
        w //= 2
    return acc[0]


@njit(nogil=True)
def segment_sum(c, square, acc):
    """Sum of float32(c) (of squares if ``square``) over a segment view, in the wire order.

    Steps, for one segment of at most SEGMENT elements:
      1. lane l accumulates elements l, l + LANES, l + 2 LANES, ... in order,
         from 0: ``acc = fma(v, v, acc)`` for squares, ``acc + |v|`` otherwise;
      2. ``lane_tree`` combines the LANES partial sums.
    A 256-thread block does exactly this with thread t owning lane t.
    (Loops index views from 0 so that Numba can drop its negative-index
    checks and vectorise.)
    """
    acc[:] = 0.0
    rows = c.size // LANES
    for r in range(rows + 1):
        row = c[r * LANES:(r + 1) * LANES]
        for lane in range(row.size):
            v = np.float32(row[lane])
            if square:
                acc[lane] = fma32(v, v, acc[lane])
            else:
                acc[lane] = acc[lane] + abs(v)
    return lane_tree(acc)


@njit(nogil=True)
def chunk_sum(c, square):
    """Sum over one chunk view in the wire order.

    A chunk of at most SEGMENT elements is one segment.  A longer chunk is cut
    into segments of SEGMENT elements whose sums are combined like elements
    are (segment s to lane s % LANES, then ``lane_tree``); with a single
    segment this gives the segment's sum unchanged.
    """
    acc = np.empty(LANES, np.float32)
    if c.size <= SEGMENT:
        return segment_sum(c, square, acc)
    nseg = (c.size + SEGMENT - 1) // SEGMENT
    segs = np.empty(nseg, np.float32)
    for s in range(nseg):
        segs[s] = segment_sum(c[s * SEGMENT:(s + 1) * SEGMENT], square, acc)
    acc[:] = 0.0
    for s in range(nseg):
        acc[s % LANES] = acc[s % LANES] + segs[s]
    return lane_tree(acc)
