"""CUDA kernels for per-chunk min-max quantization (see numba_kernels.minmax).

A chunk of at most SEGMENT elements is handled by one team of TEAM threads (a
warp) in one kernel: the team finds the chunk's range by shuffles, then encodes
it (the second read of x and e hits the caches, so DRAM sees one read), with no
block barrier, so a block's teams work on their chunks independently.  Longer
chunks take three kernels: per-segment ranges, per-chunk parameters,
per-segment encoding.
"""
import math

import numpy as np
from numba import cuda

from .. import _segment_table as T
from .._chunk_rules import minmax_inverse_py, minmax_params_py
from .._scalar import SEGMENT
from .common import (at, block_range, fma32, greater, lane_group_or, lesser, load_c,
                     range_max, range_min, segment, specialized, team_range, team_sync,
                     tree_range, zero_tail)
from .geometry import TEAM, TEAMS, THREADS
from .launch import ChunkedEncoder, RowEncoder, decode_stack, launch, row_sections
from .launch import decode_rows as decode_rows_launch
from .word_decode import PER_BLOCK, PER_THREAD, word_decoders

minmax_params = cuda.jit(device=True)(minmax_params_py)
minmax_inverse = cuda.jit(device=True)(minmax_inverse_py)


@cuda.jit(device=True)
def _encode_rows(x, e, has_res, row, t, stride, bits, mn, scale, inv, words, buf, boff, sw):
    """The caller's team encodes the rows of TEAM elements at row, row + stride, ... below t
    (each row starting at a multiple of TEAM): lane l quantizes element row + l.

    8-bit codes are stored as bytes.  A row of TEAM codes at b bits fills exactly b words.
    Codes of 1, 2 or 4 bits fill whole words from aligned groups of 32 / b lanes: each group
    ORs its shifted codes across its lanes (``lane_group_or``) and its first lane stores the
    word.  Codes of 3, 5, 6 or 7 bits cross words: they are ORed into the team's b words in
    shared memory (``sw[team * 8:]``), which its first lanes then copy out."""
    lane = cuda.threadIdx.x % TEAM
    mine = (cuda.threadIdx.x // TEAM) * 8
    levels = np.float32((1 << bits) - 1)   # a float32 clamp: no float64 compare per element
    grouped = bits != 8 and 32 % bits == 0
    group = 32 // bits
    crossing = bits != 8 and not grouped
    while row < t:
        i = row + lane
        code = np.uint32(0)
        if crossing:
            if lane < bits:
                sw[mine + lane] = np.uint32(0)
            team_sync()
        if i < t:
            c = load_c(x, e, has_res, i)
            # the CPU's quantize: clamp(floor(level)), 0 for a NaN level (a chunk of NaN
            # range, an infinity times inv 0).  Clamped before math.floor (the CUDA target
            # has no np.floor), the same integer, so that the floor never takes a NaN: the
            # simulator's (Python's) refuses one
            q = fma32(np.float32(c) - mn, inv, np.float32(0.5))
            q = math.floor(lesser(greater(q, np.float32(0.0)), levels))
            if has_res:
                e[at(i)] = c - fma32(np.float32(q), scale, mn)
            if bits == 8:
                buf[at(boff + i)] = np.uint8(q)
            else:
                code = np.uint32(q)
            if crossing:
                bp = lane * bits
                w = bp >> 5
                off = bp & 31
                cuda.atomic.or_(sw, mine + w, code << np.uint32(off))
                if off + bits > 32:
                    cuda.atomic.or_(sw, mine + w + 1, code >> np.uint32(32 - off))
        if grouped:     # every lane, in range or not: the group's lanes all take part
            word = lane_group_or(code << np.uint32((lane * bits) & 31), group, sw)
            if (lane & (group - 1)) == 0 and i < t:
                words[at((i * bits) >> 5)] = word
        if crossing:
            team_sync()
            if lane * 32 < lesser(t - row, TEAM) * bits:     # the row's words that hold codes
                words[at(((row * bits) >> 5) + lane)] = sw[mine + lane]
            team_sync()
        row += stride


@cuda.jit(device=True)
def _team_chunk(x, e, has_res, size, chunk, bits, params, words, boff, buf):
    """The caller's team encodes its chunk (block b's team j: chunk b * TEAMS + j) of one
    payload of ``size`` elements (sections ``params``, ``words`` of ``buf``): its range by
    ``team_range``, its parameters (every lane computes them; lane 0 stores them), its rows.
    The range is NaN on every lane if an element is (``range_min``), so that every lane
    encodes with the parameters lane 0 stores."""
    shmin = cuda.shared.array(THREADS, np.float32)
    shmax = cuda.shared.array(THREADS, np.float32)
    # the teams' words (TEAMS * 8 <= THREADS), and the simulator's lane_group_or scratch
    sw = cuda.shared.array(THREADS, np.uint32)
    ci = cuda.blockIdx.x * TEAMS + cuda.threadIdx.x // TEAM
    s = ci * chunk
    if s >= size:
        return
    t = lesser(size, s + chunk)
    lo = np.float32(np.inf)
    hi = np.float32(-np.inf)
    j = s + cuda.threadIdx.x % TEAM
    while j < t:
        v = np.float32(load_c(x, e, has_res, j))
        lo = range_min(lo, v)
        hi = range_max(hi, v)
        j += TEAM
    lo, hi = team_range(lo, hi, shmin, shmax)
    mn, scale, inv = minmax_params(lo, hi, (1 << bits) - 1)
    if cuda.threadIdx.x % TEAM == 0:
        params[2 * ci] = mn
        params[2 * ci + 1] = scale
    _encode_rows(x, e, has_res, s, t, TEAM, bits, mn, scale, inv, words, buf, boff, sw)


@cuda.jit(device=True)
def _seg_range_block(x, e, has_res, size, chunk, spc, part):
    shmin = cuda.shared.array(THREADS, np.float32)
    shmax = cuda.shared.array(THREADS, np.float32)
    g = cuda.blockIdx.x
    ci, s, t = segment(g, spc, chunk, size)
    if s < t:
        mn, mx = block_range(x, e, has_res, s, t, shmin, shmax)
        if cuda.threadIdx.x == 0:
            part[g, 0] = mn
            part[g, 1] = mx


@cuda.jit
def _seg_range(x, e, has_res, chunk, spc, part):
    _seg_range_block(x, e, has_res, x.size, chunk, spc, part)


@cuda.jit
def _seg_range_rows(x, e, has_res, n, chunk, spc, part):
    k = cuda.blockIdx.y
    _seg_range_block(x[k * n:(k + 1) * n], e[k * n:(k + 1) * n], has_res, n, chunk, spc,
                     part[k])


@cuda.jit(device=True)
def _chunk_params_block(part, spc, chunk, n, bits, params):
    shmin = cuda.shared.array(THREADS, np.float32)
    shmax = cuda.shared.array(THREADS, np.float32)
    ci = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nseg = (lesser(n - ci * chunk, chunk) + SEGMENT - 1) // SEGMENT
    mn = np.float32(np.inf)
    mx = np.float32(-np.inf)
    for s in range(tid, nseg, THREADS):
        mn = range_min(mn, part[ci * spc + s, 0])
        mx = range_max(mx, part[ci * spc + s, 1])
    mn, mx = tree_range(mn, mx, shmin, shmax)
    if tid == 0:
        lo, scale, inv = minmax_params(mn, mx, (1 << bits) - 1)
        params[2 * ci] = lo
        params[2 * ci + 1] = scale


@cuda.jit
def _chunk_params(part, spc, chunk, n, bits, params):
    _chunk_params_block(part, spc, chunk, n, bits, params)


@cuda.jit
def _chunk_params_rows(part, spc, chunk, n, bits, params, pcol):
    k = cuda.blockIdx.y
    _chunk_params_block(part[k], spc, chunk, n, bits, params[k, pcol:])


@cuda.jit(device=True)
def _seg_encode_block(x, e, has_res, size, chunk, spc, bits, params, words, boff, buf):
    """Block g encodes its segment with its chunk's parameters, team j taking rows j,
    j + TEAMS, ... of the segment."""
    sw = cuda.shared.array(THREADS, np.uint32)
    ci, s, t = segment(cuda.blockIdx.x, spc, chunk, size)
    if s < t:
        mn = params[2 * ci]
        scale = params[2 * ci + 1]
        _encode_rows(x, e, has_res, s + (cuda.threadIdx.x // TEAM) * TEAM, t, TEAM * TEAMS,
                     bits, mn, scale, minmax_inverse(scale), words, buf, boff, sw)


def _encoding_kernels(byte_codes, suffix):
    """The four encoding kernels (one payload or a row per partition; a team per chunk, or a
    block per segment for long chunks), for 8-bit codes (``byte_codes``) or for packed ones.
    Two compiled sets, so that the packed codes' lane groups do not cost the byte kernels
    registers (32 a thread against 40 in one kernel, ``ptx_compile.py --resources``); the
    code width is a constant 8 in the byte set."""

    @specialized(f"_fused{suffix}")
    def fused(x, e, has_res, chunk, bits, params, words, boff, buf, used, nbytes):
        zero_tail(buf, used, nbytes)
        _team_chunk(x, e, has_res, x.size, chunk, 8 if byte_codes else bits, params, words,
                    boff, buf)

    @specialized(f"_fused_rows{suffix}")
    def fused_rows(x, e, has_res, part, chunk, bits, params, pcol, words, wcol, boff, mat, col,
                   used, nbytes):
        """Team j of block (b, k): chunk b * TEAMS + j of partition k into row k of ``mat``
        (sections at pcol, wcol)."""
        k = cuda.blockIdx.y
        buf = mat[k, col:col + nbytes]
        zero_tail(buf, used, nbytes)
        _team_chunk(x[k * part:(k + 1) * part], e[k * part:(k + 1) * part], has_res, part,
                    chunk, 8 if byte_codes else bits,
                    params[k, pcol:pcol + 2 * ((part + chunk - 1) // chunk)],
                    words[k, wcol:wcol + (part * bits + 31) // 32], boff, buf)

    @specialized(f"_seg_encode{suffix}")
    def seg_encode(x, e, has_res, chunk, spc, bits, params, words, boff, buf, used, nbytes):
        zero_tail(buf, used, nbytes)
        _seg_encode_block(x, e, has_res, x.size, chunk, spc, 8 if byte_codes else bits, params,
                          words, boff, buf)

    @specialized(f"_seg_encode_rows{suffix}")
    def seg_encode_rows(x, e, has_res, part, chunk, spc, bits, params, pcol, words, wcol, boff,
                        mat, col, used, nbytes):
        k = cuda.blockIdx.y
        buf = mat[k, col:col + nbytes]
        zero_tail(buf, used, nbytes)
        _seg_encode_block(x[k * part:(k + 1) * part], e[k * part:(k + 1) * part], has_res,
                          part, chunk, spc, 8 if byte_codes else bits, params[k, pcol:],
                          words[k, wcol:wcol + (part * bits + 31) // 32], boff, buf)

    return fused, fused_rows, seg_encode, seg_encode_rows


# Module-level names: the simulator suite's launch record finds each kernel by its name.
_fused_bytes, _fused_rows_bytes, _seg_encode_bytes, _seg_encode_rows_bytes = \
    _encoding_kernels(True, "_bytes")
_fused, _fused_rows, _seg_encode, _seg_encode_rows = _encoding_kernels(False, "")


@cuda.jit
def _fused_rows_segments(x, e, has_res, table, chunk, params, words, mat):
    """Team j of block (b, k, s): chunk b * TEAMS + j of partition k of segment s (row s of
    ``table``, columns in ``numba_kernels._segment_table``) into row k of ``mat``, the bytes
    of ``_fused_rows`` on that segment alone. x and e are base arrays that every segment's
    values and error memory lie in; ``params`` and ``words`` are ``mat`` as float32 and uint32.
    The code width comes from the table, so 8-bit segments take this (packed) set's byte
    branch."""
    s = cuda.blockIdx.z
    k = cuda.blockIdx.y
    part = table[s, T.PART]
    bits = table[s, T.BITS]
    start = table[s, T.X_OFF] + lesser(k * part, table[s, T.X_LEN])
    stop = table[s, T.X_OFF] + lesser((k + 1) * part, table[s, T.X_LEN])
    err = table[s, T.E_OFF] + k * part
    col = table[s, T.COL]
    nbytes = table[s, T.NBYTES]
    buf = mat[k, col:col + nbytes]
    zero_tail(buf, table[s, T.USED], nbytes)
    pcol = table[s, T.PCOL]
    wcol = table[s, T.WCOL]
    _team_chunk(x[start:stop], e[err:err + part], has_res, part, chunk, bits,
                params[k, pcol:pcol + 2 * ((part + chunk - 1) // chunk)],
                words[k, wcol:wcol + (part * bits + 31) // 32], table[s, T.BOFF], buf)


@cuda.jit(device=True)
def _chunk_params_of(params, pcol, p, ci, unused):
    """(mn, scale) of chunk ci of row p."""
    return params[at(p), at(pcol + 2 * ci)], params[at(p), at(pcol + 2 * ci + 1)]


@cuda.jit(device=True)
def _code_value(q, mn, scale):
    return fma32(np.float32(q), scale, mn)


_decode, _decode_rows, _decode_segments, _decode_rows_segments = word_decoders(
    _chunk_params_of, _code_value, __name__, segmented=True)


# by whether the codes are bytes
_ENCODER = {True: ChunkedEncoder(_fused_bytes, _seg_range, _chunk_params, _seg_encode_bytes,
                                 part_shape=(2,), chunks_per_block=TEAMS),
            False: ChunkedEncoder(_fused, _seg_range, _chunk_params, _seg_encode,
                                  part_shape=(2,), chunks_per_block=TEAMS)}
_ROWS = {True: RowEncoder(_fused_rows_bytes, _seg_range_rows, _chunk_params_rows,
                          _seg_encode_rows_bytes, part_shape=(2,), chunks_per_block=TEAMS),
         False: RowEncoder(_fused_rows, _seg_range_rows, _chunk_params_rows, _seg_encode_rows,
                           part_shape=(2,), chunks_per_block=TEAMS)}


def encode(x, e, fmt, params, words, buf, stream):
    """Encode for MinMaxFormat ``fmt`` (x, e flat device arrays): 1 launch, 3 for long chunks."""
    boff = fmt.section("codes").offset
    _ENCODER[fmt.bits == 8](x, e, fmt, buf, stream, enc=(fmt.bits, params, words, boff),
                            comb=(fmt.bits, params))


def decode(fmt, stack, col, out, accumulate, factor, stream):
    """1 launch: every row's payload (at byte column ``col``) decoded and summed in one pass
    over out, times ``factor``."""
    decode_stack(_decode, fmt, stack, col, ("params", "codes"), (fmt.bits, fmt.chunk, 0), out,
                 accumulate, factor, stream, per_thread=PER_THREAD)


def encode_rows(x, e, fmt, views, mat, col, stream):
    """Partition k of x into row k of ``mat`` at ``col`` (``views``: ``fmt.views2d(mat, col)``),
    every k: 1 launch, 3 for long chunks."""
    params, pcol = views["params"]
    words, wcol = views["codes"]
    boff = fmt.section("codes").offset
    _ROWS[fmt.bits == 8](x, e, mat.shape[0], fmt, mat, col, stream,
          enc=(fmt.bits, params, pcol, words, wcol, boff), comb=(fmt.bits, params, pcol))


def decode_rows(fmt, mat, col, out, stream):
    """1 launch: row k of ``mat`` (payload at ``col``) into partition k of out, every k."""
    decode_rows_launch(_decode_rows, fmt, row_sections(fmt.views2d(mat, col), ("params", "codes")),
                       (fmt.bits, fmt.chunk, 0), mat.shape[0], out, stream, per_block=PER_BLOCK)


def encode_segments(x, e, table, blocks, chunk, mat, stream):
    """1 launch: partition k of every segment of ``table`` (x, e: their base arrays) into row
    k of ``mat``, every k; ``blocks``: the most team blocks a segment's partition needs."""
    ee, has_res = (x, False) if e is None else (e, True)
    launch(_fused_rows_segments, (blocks, mat.shape[0], table.shape[0]), THREADS, stream, x, ee,
           has_res, table, chunk, mat.view(np.float32), mat.view(np.uint32), mat)


def decode_segments(stack, table, blocks, chunk, out, factor, stream):
    """1 launch: every segment's payloads in the rows of ``stack`` decoded and summed into its
    place in out, times ``factor``."""
    launch(_decode_segments, (blocks, 1, table.shape[0]), THREADS, stream, stack.view(np.float32),
           stack.view(np.uint32), table, chunk, 0, out, np.float32(factor))


def decode_rows_segments(mat, table, blocks, chunk, out, stream):
    """1 launch: row k of every segment's payloads into partition k of its place in out."""
    launch(_decode_rows_segments, (blocks, mat.shape[0], table.shape[0]), THREADS, stream,
           mat.view(np.float32), mat.view(np.uint32), table, chunk, 0, out)
