"""CUDA kernels for QSGD (see numba_kernels.qsgd; chunk norms and levels from ``_chunk_rules``)."""
import numpy as np
from numba import cuda

from .._chunk_rules import qsgd_level_py, qsgd_norm_py, qsgd_steps_py
from .._scalar import LANES, SEGMENT
from .common import (add_or_replace, at, block_lane_combine, block_lane_sum, block_row_key,
                     ilp_chunks, ilp_load, ilp_store, ilp_store_times, lesser, load_c, mul32,
                     seg_sums, seg_sums_rows, segment, uniform24, zero_tail)
from .geometry import GROUP, ILP, ILP_SPAN, THREADS
from .launch import ChunkedEncoder, RowEncoder, decode_stack, row_sections
from .launch import decode_rows as decode_rows_launch
from .word_decode import PER_BLOCK, PER_THREAD, word_decoders

qsgd_level = cuda.jit(device=True)(qsgd_level_py)
qsgd_norm = cuda.jit(device=True)(qsgd_norm_py)
qsgd_steps = cuda.jit(device=True)(qsgd_steps_py)


@cuda.jit(device=True)
def _code(v, ratio, levels, key, i):
    """Signed stochastic level of v, as the CPU twin's qsgd_code."""
    return qsgd_level(v, mul32(abs(v), ratio), uniform24(key, i), levels)


@cuda.jit(device=True)
def _encode_range(x, e, has_res, s, t, levels, key, ratio, step, codes):
    i = s + cuda.threadIdx.x
    while i < t:
        c = load_c(x, e, has_res, i)
        code = _code(np.float32(c), ratio, levels, key, i)
        codes[at(i)] = np.int8(code)
        if has_res:
            e[at(i)] = c - mul32(np.float32(code), step)
        i += THREADS


@cuda.jit(device=True)
def _fused_chunk(x, e, has_res, size, chunk, ci, levels, key, norms, codes):
    """The block's chunk ci of one payload of ``size`` elements (sections ``norms``,
    ``codes``)."""
    sh = cuda.shared.array(LANES, np.float32)
    s = ci * chunk
    t = lesser(size, s + chunk)
    norm = qsgd_norm(block_lane_sum(x, e, has_res, s, t, True, sh))
    ratio, step = qsgd_steps(norm, levels)
    if cuda.threadIdx.x == 0:
        norms[ci] = norm
    _encode_range(x, e, has_res, s, t, levels, key, ratio, step, codes)


@cuda.jit
def _fused(x, e, has_res, chunk, levels, key, norms, codes, buf, used, nbytes):
    zero_tail(buf, used, nbytes)
    _fused_chunk(x, e, has_res, x.size, chunk, cuda.blockIdx.x, levels, key, norms, codes)


@cuda.jit
def _fused_rows(x, e, has_res, part, chunk, levels, prefix, phase, norms, ncol, codes, ccol, mat,
                col, used, nbytes):
    """Block (ci, k): chunk ci of partition k into row k of ``mat`` (sections at ncol, ccol),
    drawing with ``row_key(prefix, k, phase)``."""
    k = cuda.blockIdx.y
    zero_tail(mat[k, col:col + nbytes], used, nbytes)
    key = block_row_key(prefix, phase)
    _fused_chunk(x[k * part:(k + 1) * part], e[k * part:(k + 1) * part], has_res, part, chunk,
                 cuda.blockIdx.x, levels, key, norms[k, ncol:ncol + (part + chunk - 1) // chunk],
                 codes[k, ccol:ccol + part])


@cuda.jit(device=True)
def _chunk_norms_block(part, spc, chunk, n, norms):
    sh = cuda.shared.array(LANES, np.float32)
    ci = cuda.blockIdx.x
    nseg = (lesser(n - ci * chunk, chunk) + SEGMENT - 1) // SEGMENT
    total = block_lane_combine(part, ci * spc, nseg, sh)
    if cuda.threadIdx.x == 0:
        norms[ci] = qsgd_norm(total)


@cuda.jit
def _chunk_norms(part, spc, chunk, n, norms):
    _chunk_norms_block(part, spc, chunk, n, norms)


@cuda.jit
def _chunk_norms_rows(part, spc, chunk, n, norms, ncol):
    k = cuda.blockIdx.y
    _chunk_norms_block(part[k], spc, chunk, n, norms[k, ncol:])


@cuda.jit(device=True)
def _seg_encode_block(x, e, has_res, size, chunk, spc, levels, key, norms, codes):
    ci, s, t = segment(cuda.blockIdx.x, spc, chunk, size)
    if s < t:
        ratio, step = qsgd_steps(norms[ci], levels)
        _encode_range(x, e, has_res, s, t, levels, key, ratio, step, codes)


@cuda.jit
def _seg_encode(x, e, has_res, chunk, spc, levels, key, norms, codes, buf, used, nbytes):
    zero_tail(buf, used, nbytes)
    _seg_encode_block(x, e, has_res, x.size, chunk, spc, levels, key, norms, codes)


@cuda.jit
def _seg_encode_rows(x, e, has_res, part, chunk, spc, levels, prefix, phase, norms, ncol, codes,
                     ccol, mat, col, used, nbytes):
    k = cuda.blockIdx.y
    zero_tail(mat[k, col:col + nbytes], used, nbytes)
    key = block_row_key(prefix, phase)
    _seg_encode_block(x[k * part:(k + 1) * part], e[k * part:(k + 1) * part], has_res, part,
                      chunk, spc, levels, key, norms[k, ncol:], codes[k, ccol:ccol + part])


@cuda.jit(device=True)
def _steps(norms, ncol, levels, p, cix, steps):
    """steps[u] = the quantization step of chunk cix[u] of row p; the group's elements mostly
    share a chunk, so the division is made once per chunk met."""
    for u in range(ILP):
        if u > 0 and cix[u] == cix[u - 1]:
            steps[u] = steps[u - 1]
        else:
            steps[u] = norms[p, ncol + cix[u]] / np.float32(levels)


@cuda.jit(device=True)
def _decoded(codes, ccol, step, p, i):
    """x_hat of element i of row p, whose chunk's step is ``step``."""
    return mul32(np.float32(codes[at(p), at(ccol + i)]), step)


@cuda.jit
def _decode(norms, ncol, codes, ccol, levels, chunk, out, accumulate, factor):
    """Every row decoded and summed into out in row order, times ``factor``, ILP elements
    per thread."""
    n = out.size
    acc = cuda.local.array(ILP, out.dtype)
    idx = cuda.local.array(ILP, np.int64)
    cix = cuda.local.array(ILP, np.int32)
    steps = cuda.local.array(ILP, np.float32)
    base = cuda.blockIdx.x * ILP_SPAN + cuda.threadIdx.x
    while base < n:
        ilp_load(out, acc, base, n, accumulate)
        ilp_chunks(base, n, chunk, idx, cix, ILP)     # once for every row
        for p in range(norms.shape[0]):
            fold = accumulate or p > 0
            _steps(norms, ncol, levels, p, cix, steps)
            for u in range(ILP):
                value = _decoded(codes, ccol, steps[u], p, idx[u])
                acc[u] = add_or_replace(acc[u], value, fold)
        ilp_store_times(out, acc, base, n, factor)
        base += cuda.gridDim.x * ILP_SPAN


@cuda.jit
def _decode_rows(norms, ncol, codes, ccol, levels, chunk, part, out):
    """Block (b, k) strides over partition k: out[k * part + i] = x_hat of row k's element i
    (up to out's end), ILP elements per thread."""
    k = cuda.blockIdx.y
    stop = lesser(part, out.size - k * part)
    mine = out[k * part:]
    vals = cuda.local.array(ILP, out.dtype)
    idx = cuda.local.array(ILP, np.int64)
    cix = cuda.local.array(ILP, np.int32)
    steps = cuda.local.array(ILP, np.float32)
    base = cuda.blockIdx.x * ILP_SPAN + cuda.threadIdx.x
    while base < stop:
        ilp_chunks(base, stop, chunk, idx, cix, ILP)
        _steps(norms, ncol, levels, k, cix, steps)
        for u in range(ILP):
            vals[u] = _decoded(codes, ccol, steps[u], k, idx[u])
        ilp_store(mine, vals, base, stop)
        base += cuda.gridDim.x * ILP_SPAN


@cuda.jit(device=True)
def _chunk_step(norms, ncol, p, ci, levels):
    """(step, unused) of chunk ci of row p: its norm / levels, as ``_steps`` divides."""
    return norms[at(p), at(ncol + ci)] / np.float32(levels), np.float32(0.0)


@cuda.jit(device=True)
def _code_value(q, step, unused):
    """The int8 code whose byte is q, times its chunk's step."""
    return mul32(np.float32(np.int8(q)), step)


# Where a chunk is a multiple of GROUP elements (the default 1024 is), the word decoders: one
# word load brings four codes; otherwise a group could straddle two chunks, and the element
# decoders above run.
_decode_words, _decode_rows_words = word_decoders(_chunk_step, _code_value, __name__, "_words")


def _code_words(fmt, stack, col):
    """The codes section as uint32 words: (view of the stack's rows, its first column)."""
    return stack.view(np.uint32), (col + fmt.section("codes").offset) // 4


_ENCODER = ChunkedEncoder(_fused, seg_sums, _chunk_norms, _seg_encode)
_ROWS = RowEncoder(_fused_rows, seg_sums_rows, _chunk_norms_rows, _seg_encode_rows)


def encode(x, e, fmt, key, norms, codes, buf, stream):
    """Encode for QSGDFormat ``fmt`` (x, e flat device arrays): 1 launch, 3 for long chunks."""
    _ENCODER(x, e, fmt, buf, stream, enc=(fmt.levels, key, norms, codes), red=(True,),
             comb=(norms,))


def decode(fmt, stack, col, out, accumulate, factor, stream):
    """1 launch: every row's payload (at byte column ``col``) decoded and summed in one pass
    over out, times ``factor``."""
    if fmt.chunk % GROUP:
        decode_stack(_decode, fmt, stack, col, ("norms", "codes"), (fmt.levels, fmt.chunk), out,
                     accumulate, factor, stream)
        return
    decode_stack(_decode_words, fmt, stack, col, ("norms",),
                 (*_code_words(fmt, stack, col), 8, fmt.chunk, fmt.levels), out, accumulate,
                 factor, stream, per_thread=PER_THREAD)


def encode_rows(x, e, fmt, prefix, phase, views, mat, col, stream):
    """Partition k of x into row k of ``mat`` at ``col`` (``views``: ``fmt.views2d(mat, col)``),
    keyed ``row_key(prefix, k, phase)``, every k: 1 launch, 3 for long chunks."""
    norms, ncol = views["norms"]
    codes, ccol = views["codes"]
    _ROWS(x, e, mat.shape[0], fmt, mat, col, stream,
          enc=(fmt.levels, prefix, phase, norms, ncol, codes, ccol), red=(True,),
          comb=(norms, ncol))


def decode_rows(fmt, mat, col, out, stream):
    """1 launch: row k of ``mat`` (payload at ``col``) into partition k of out, every k."""
    views = fmt.views2d(mat, col)
    if fmt.chunk % GROUP:
        decode_rows_launch(_decode_rows, fmt, row_sections(views, ("norms", "codes")),
                           (fmt.levels, fmt.chunk), mat.shape[0], out, stream)
        return
    decode_rows_launch(_decode_rows_words, fmt, row_sections(views, ("norms",)),
                       (*_code_words(fmt, mat, col), 8, fmt.chunk, fmt.levels), mat.shape[0],
                       out, stream, per_block=PER_BLOCK)
