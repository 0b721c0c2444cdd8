"""CUDA kernels for per-chunk min-max quantization (see numba_kernels.minmax).

A chunk of at most SEGMENT elements is handled by one block in one kernel:
the block finds the chunk's range, then encodes it (the second read of x and e
hits the cache, so DRAM sees one read).  Longer chunks take three kernels:
per-segment ranges, per-chunk parameters, per-segment encoding.
"""
import math

import numpy as np
from numba import cuda

from .._bits import extract_py
from .._chunk_rules import minmax_inverse_py, minmax_params_py
from .._scalar import LANES, SEGMENT
from .common import (add_or_replace, at, block_range, fma32, greater, ilp_chunks, ilp_load,
                     ilp_store, ilp_store_times, lane_group_or, lesser, load_c, segment,
                     specialized, tree_range, zero_tail)
from .geometry import ILP, ILP_SPAN, NL, THREADS
from .launch import ChunkedEncoder, RowEncoder, decode_stack, row_sections
from .launch import decode_rows as decode_rows_launch

# Shared words for one row of LANES codes at up to 8 bits each.
_ROW_WORDS = LANES * 8 // 32

minmax_params = cuda.jit(device=True)(minmax_params_py)
minmax_inverse = cuda.jit(device=True)(minmax_inverse_py)
extract = cuda.jit(device=True)(extract_py)


@cuda.jit(device=True)
def _encode_range(x, e, has_res, s, t, bits, mn, scale, inv, words, buf, boff, sw):
    """Encode [s, t) (s at a row boundary of its chunk) one row of LANES at a time.

    8-bit codes are stored as bytes.  Codes of 1, 2 or 4 bits fill whole words from aligned
    groups of 32 / bits lanes: each group ORs its shifted codes across its lanes
    (``lane_group_or``) and its first lane stores the word, with no shared memory and no
    barrier.  Codes of 3, 5, 6 or 7 bits cross words: they are ORed into a shared row of
    words, which is then copied out."""
    tid = cuda.threadIdx.x
    levels = np.float32((1 << bits) - 1)   # a float32 clamp: no float64 compare per element
    grouped = bits != 8 and 32 % bits == 0
    group = 32 // bits
    shared = bits != 8 and not grouped
    row = s
    while row < t:
        cnt = lesser(t - row, LANES)
        nw = (cnt * bits + 31) // 32
        if shared:
            for w in range(tid, nw, THREADS):
                sw[w] = np.uint32(0)
            cuda.syncthreads()
        for sub in range(NL):
            lane = tid + sub * THREADS
            code = np.uint32(0)
            if lane < cnt:
                i = row + lane
                c = load_c(x, e, has_res, i)
                # math.floor: the CUDA target has no np.floor (the CPU's quantize); same integer
                q = math.floor(fma32(np.float32(c) - mn, inv, np.float32(0.5)))
                q = lesser(greater(q, np.float32(0.0)), levels)
                if has_res:
                    e[at(i)] = c - fma32(np.float32(q), scale, mn)
                if bits == 8:
                    buf[at(boff + i)] = np.uint8(q)
                else:
                    code = np.uint32(q)
                if shared:
                    bp = lane * bits
                    w = bp >> 5
                    off = bp & 31
                    cuda.atomic.or_(sw, w, code << np.uint32(off))
                    if off + bits > 32:
                        cuda.atomic.or_(sw, w + 1, code >> np.uint32(32 - off))
            if grouped:     # every lane, in range or not: the group's lanes all take part
                word = lane_group_or(code << np.uint32((lane * bits) & 31), group, sw)
                if (lane & (group - 1)) == 0 and lane < cnt:
                    words[at(((row + lane) * bits) >> 5)] = word
        if shared:
            cuda.syncthreads()
            base = (row * bits) >> 5
            for w in range(tid, nw, THREADS):
                words[at(base + w)] = sw[w]
            cuda.syncthreads()
        row += LANES


@cuda.jit(device=True)
def _fused_chunk(x, e, has_res, size, chunk, ci, bits, params, words, boff, buf):
    """The block's chunk ci of one payload of ``size`` elements (sections ``params``,
    ``words`` of ``buf``)."""
    shmin = cuda.shared.array(THREADS, np.float32)
    shmax = cuda.shared.array(THREADS, np.float32)
    sw = cuda.shared.array(_ROW_WORDS, np.uint32)
    s = ci * chunk
    t = lesser(size, s + chunk)
    lo, hi = block_range(x, e, has_res, s, t, shmin, shmax)
    mn, scale, inv = minmax_params(lo, hi, (1 << bits) - 1)
    if cuda.threadIdx.x == 0:
        params[2 * ci] = mn
        params[2 * ci + 1] = scale
    _encode_range(x, e, has_res, s, t, bits, mn, scale, inv, words, buf, boff, sw)


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
        mn = lesser(mn, part[ci * spc + s, 0])
        mx = greater(mx, part[ci * spc + s, 1])
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
    sw = cuda.shared.array(_ROW_WORDS, np.uint32)
    ci, s, t = segment(cuda.blockIdx.x, spc, chunk, size)
    if s < t:
        mn = params[2 * ci]
        scale = params[2 * ci + 1]
        _encode_range(x, e, has_res, s, t, bits, mn, scale, minmax_inverse(scale), words, buf,
                      boff, sw)


def _encoding_kernels(byte_codes, suffix):
    """The four encoding kernels (one payload or a row per partition; fused, or by segment for
    long chunks), for 8-bit codes (``byte_codes``) or for packed ones.  Two compiled sets, so
    that the packed codes' lane groups do not cost the byte kernels registers (32 a thread
    against 40 in one kernel, ``ptx_compile.py --resources``); the code width is a constant
    8 in the byte set."""

    @specialized(f"_fused{suffix}")
    def fused(x, e, has_res, chunk, bits, params, words, boff, buf, used, nbytes):
        zero_tail(buf, used, nbytes)
        _fused_chunk(x, e, has_res, x.size, chunk, cuda.blockIdx.x, 8 if byte_codes else bits,
                     params, words, boff, buf)

    @specialized(f"_fused_rows{suffix}")
    def fused_rows(x, e, has_res, part, chunk, bits, params, pcol, words, wcol, boff, mat, col,
                   used, nbytes):
        """Block (ci, k): chunk ci of partition k into row k of ``mat`` (sections at pcol,
        wcol)."""
        k = cuda.blockIdx.y
        buf = mat[k, col:col + nbytes]
        zero_tail(buf, used, nbytes)
        _fused_chunk(x[k * part:(k + 1) * part], e[k * part:(k + 1) * part], has_res, part,
                     chunk, cuda.blockIdx.x, 8 if byte_codes else bits,
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


@cuda.jit(device=True)
def _decoded(params, pcol, words, wcol, bytes8, bcol, bits, ci, p, i):
    """x_hat of element i (in chunk ci) of row p.  A packed code's second word is read whether
    the code spills into it or not (``extract`` masks it off), at an index kept inside the row,
    so no load waits on a branch."""
    mn = params[at(p), at(pcol + 2 * ci)]
    scale = params[at(p), at(pcol + 2 * ci + 1)]
    if bits == 8:
        q = np.uint32(bytes8[at(p), at(bcol + i)])
    else:
        pos = i * bits
        w = pos >> 5
        w1 = words[at(p), at(lesser(wcol + w + 1, words.shape[1] - 1))]
        q = extract(words[at(p), at(wcol + w)], w1, pos & 31, bits)
    return fma32(np.float32(q), scale, mn)


@cuda.jit
def _decode(params, pcol, words, wcol, bytes8, bcol, bits, chunk, out, accumulate, factor):
    """Every row decoded and summed into out in row order, times ``factor``, ILP elements
    per thread."""
    n = out.size
    acc = cuda.local.array(ILP, out.dtype)
    idx = cuda.local.array(ILP, np.int64)
    cix = cuda.local.array(ILP, np.int32)
    base = cuda.blockIdx.x * ILP_SPAN + cuda.threadIdx.x
    while base < n:
        ilp_load(out, acc, base, n, accumulate)
        ilp_chunks(base, n, chunk, idx, cix)     # once for every row
        for p in range(params.shape[0]):
            fold = accumulate or p > 0
            for u in range(ILP):
                value = _decoded(params, pcol, words, wcol, bytes8, bcol, bits, cix[u], p,
                                 idx[u])
                acc[u] = add_or_replace(acc[u], value, fold)
        ilp_store_times(out, acc, base, n, factor)
        base += cuda.gridDim.x * ILP_SPAN


@cuda.jit
def _decode_rows(params, pcol, words, wcol, bytes8, bcol, bits, chunk, part, out):
    """Block (b, k) strides over partition k: out[k * part + i] = x_hat of row k's element i
    (up to out's end), ILP elements per thread."""
    k = cuda.blockIdx.y
    stop = lesser(part, out.size - k * part)
    mine = out[k * part:]
    vals = cuda.local.array(ILP, out.dtype)
    idx = cuda.local.array(ILP, np.int64)
    cix = cuda.local.array(ILP, np.int32)
    base = cuda.blockIdx.x * ILP_SPAN + cuda.threadIdx.x
    while base < stop:
        ilp_chunks(base, stop, chunk, idx, cix)
        for u in range(ILP):
            vals[u] = _decoded(params, pcol, words, wcol, bytes8, bcol, bits, cix[u], k, idx[u])
        ilp_store(mine, vals, base, stop)
        base += cuda.gridDim.x * ILP_SPAN


# by whether the codes are bytes
_ENCODER = {True: ChunkedEncoder(_fused_bytes, _seg_range, _chunk_params, _seg_encode_bytes,
                                 part_shape=(2,)),
            False: ChunkedEncoder(_fused, _seg_range, _chunk_params, _seg_encode,
                                  part_shape=(2,))}
_ROWS = {True: RowEncoder(_fused_rows_bytes, _seg_range_rows, _chunk_params_rows,
                          _seg_encode_rows_bytes, part_shape=(2,)),
         False: RowEncoder(_fused_rows, _seg_range_rows, _chunk_params_rows, _seg_encode_rows,
                           part_shape=(2,))}


def encode(x, e, fmt, params, words, buf, stream):
    """Encode for MinMaxFormat ``fmt`` (x, e flat device arrays): 1 launch, 3 for long chunks."""
    boff = fmt.section("codes").offset
    _ENCODER[fmt.bits == 8](x, e, fmt, buf, stream, enc=(fmt.bits, params, words, boff),
                            comb=(fmt.bits, params))


def decode(fmt, stack, col, out, accumulate, factor, stream):
    """1 launch: every row's payload (at byte column ``col``) decoded and summed in one pass
    over out, times ``factor``."""
    decode_stack(_decode, fmt, stack, col, ("params", "codes"),
                 (stack, col + fmt.section("codes").offset, fmt.bits, fmt.chunk), out, accumulate,
                 factor, stream)


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
    v = fmt.views2d(mat, col)
    decode_rows_launch(_decode_rows, fmt, row_sections(v, ("params", "codes")),
                       (mat, col + fmt.section("codes").offset, fmt.bits, fmt.chunk),
                       mat.shape[0], out, stream)
