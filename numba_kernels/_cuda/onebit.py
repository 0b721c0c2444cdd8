"""CUDA kernels for 1-bit compression (see numba_kernels.onebit; scales from ``_chunk_rules``)."""
import numpy as np
from numba import cuda

from .._chunk_rules import onebit_scale_py
from .._scalar import LANES, SEGMENT
from .common import (at, ballot32, block_lane_combine, block_lane_sum, lesser, load_c, seg_sums,
                     seg_sums_rows, segment, zero_tail)
from .geometry import NL, THREADS
from .launch import ChunkedEncoder, RowEncoder, decode_stack, row_sections
from .launch import decode_rows as decode_rows_launch
from .word_decode import PER_BLOCK, PER_THREAD, word_decoders

onebit_scale = cuda.jit(device=True)(onebit_scale_py)


@cuda.jit(device=True)
def _encode_range(x, e, has_res, s, t, scale, words, scratch):
    """Signs of [s, t) (s a multiple of 32) one row of LANES at a time: a warp
    vote packs the 32 signs of each warp into its word, which lane 0 writes."""
    tid = cuda.threadIdx.x
    row = s
    while row < t:
        cnt = lesser(t - row, LANES)
        for sub in range(NL):
            lane = tid + sub * THREADS
            neg = False
            if lane < cnt:
                i = row + lane
                c = load_c(x, e, has_res, i)
                neg = np.float32(c) < np.float32(0.0)
                if has_res:
                    if neg:
                        e[at(i)] = c + scale
                    else:
                        e[at(i)] = c - scale
            word = ballot32(neg, scratch)        # every thread votes, in range or not
            first = lane - (lane & 31)
            if (lane & 31) == 0 and first < cnt:
                words[(row + first) >> 5] = word
        row += LANES


@cuda.jit(device=True)
def _fused_chunk(x, e, has_res, size, chunk, ci, square, scales, words):
    """The block's chunk ci of one payload of ``size`` elements (sections ``scales``,
    ``words``)."""
    sh = cuda.shared.array(LANES, np.float32)
    scratch = cuda.shared.array(THREADS, np.uint32)
    s = ci * chunk
    t = lesser(size, s + chunk)
    scale = onebit_scale(block_lane_sum(x, e, has_res, s, t, square, sh), t - s, square)
    if cuda.threadIdx.x == 0:
        scales[ci] = scale
    _encode_range(x, e, has_res, s, t, scale, words, scratch)


@cuda.jit
def _fused(x, e, has_res, chunk, square, scales, words, buf, used, nbytes):
    zero_tail(buf, used, nbytes)
    _fused_chunk(x, e, has_res, x.size, chunk, cuda.blockIdx.x, square, scales, words)


@cuda.jit
def _fused_rows(x, e, has_res, part, chunk, square, scales, scol, words, wcol, mat, col, used,
                nbytes):
    """Block (ci, k): chunk ci of partition k into row k of ``mat`` (sections at scol, wcol)."""
    k = cuda.blockIdx.y
    zero_tail(mat[k, col:col + nbytes], used, nbytes)
    _fused_chunk(x[k * part:(k + 1) * part], e[k * part:(k + 1) * part], has_res, part, chunk,
                 cuda.blockIdx.x, square, scales[k, scol:scol + (part + chunk - 1) // chunk],
                 words[k, wcol:wcol + (part + 31) // 32])


@cuda.jit(device=True)
def _chunk_scales_block(part, spc, chunk, n, square, scales):
    sh = cuda.shared.array(LANES, np.float32)
    ci = cuda.blockIdx.x
    length = lesser(n - ci * chunk, chunk)
    total = block_lane_combine(part, ci * spc, (length + SEGMENT - 1) // SEGMENT, sh)
    if cuda.threadIdx.x == 0:
        scales[ci] = onebit_scale(total, length, square)


@cuda.jit
def _chunk_scales(part, spc, chunk, n, square, scales):
    _chunk_scales_block(part, spc, chunk, n, square, scales)


@cuda.jit
def _chunk_scales_rows(part, spc, chunk, n, square, scales, scol):
    k = cuda.blockIdx.y
    _chunk_scales_block(part[k], spc, chunk, n, square, scales[k, scol:])


@cuda.jit(device=True)
def _seg_encode_block(x, e, has_res, size, chunk, spc, scales, words):
    scratch = cuda.shared.array(THREADS, np.uint32)
    ci, s, t = segment(cuda.blockIdx.x, spc, chunk, size)
    if s < t:
        _encode_range(x, e, has_res, s, t, scales[ci], words, scratch)


@cuda.jit
def _seg_encode(x, e, has_res, chunk, spc, square, scales, words, buf, used, nbytes):
    # ``square`` is unused (the scale is already known): the arguments follow ChunkedEncoder's
    # convention of passing the fused kernel's own arguments to the segment encoder.
    zero_tail(buf, used, nbytes)
    _seg_encode_block(x, e, has_res, x.size, chunk, spc, scales, words)


@cuda.jit
def _seg_encode_rows(x, e, has_res, part, chunk, spc, square, scales, scol, words, wcol, mat, col,
                     used, nbytes):
    k = cuda.blockIdx.y
    zero_tail(mat[k, col:col + nbytes], used, nbytes)
    _seg_encode_block(x[k * part:(k + 1) * part], e[k * part:(k + 1) * part], has_res, part,
                      chunk, spc, scales[k, scol:], words[k, wcol:wcol + (part + 31) // 32])


@cuda.jit(device=True)
def _chunk_scale(scales, scol, p, ci, unused):
    """(scale, unused) of chunk ci of row p."""
    return scales[at(p), at(scol + ci)], np.float32(0.0)


@cuda.jit(device=True)
def _code_value(bit, scale, unused):
    """A set sign bit decodes to -scale, a clear one to scale."""
    return -scale if bit else scale


_decode, _decode_rows = word_decoders(_chunk_scale, _code_value, __name__)


_ENCODER = ChunkedEncoder(_fused, seg_sums, _chunk_scales, _seg_encode)
_ROWS = RowEncoder(_fused_rows, seg_sums_rows, _chunk_scales_rows, _seg_encode_rows)


def encode(x, e, fmt, square, scales, words, buf, stream):
    """Encode for OneBitFormat ``fmt`` (x, e flat device arrays): 1 launch, 3 for long chunks."""
    _ENCODER(x, e, fmt, buf, stream, enc=(square, scales, words), red=(square,),
             comb=(square, scales))


def decode(fmt, stack, col, out, accumulate, factor, stream):
    """1 launch: every row's payload (at byte column ``col``) decoded and summed in one pass
    over out, times ``factor``."""
    decode_stack(_decode, fmt, stack, col, ("scales", "signs"), (1, fmt.chunk, 0), out,
                 accumulate, factor, stream, per_thread=PER_THREAD)


def encode_rows(x, e, fmt, square, views, mat, col, stream):
    """Partition k of x into row k of ``mat`` at ``col`` (``views``: ``fmt.views2d(mat, col)``),
    every k: 1 launch, 3 for long chunks."""
    scales, scol = views["scales"]
    words, wcol = views["signs"]
    _ROWS(x, e, mat.shape[0], fmt, mat, col, stream, enc=(square, scales, scol, words, wcol),
          red=(square,), comb=(square, scales, scol))


def decode_rows(fmt, mat, col, out, stream):
    """1 launch: row k of ``mat`` (payload at ``col``) into partition k of out, every k."""
    decode_rows_launch(_decode_rows, fmt, row_sections(fmt.views2d(mat, col), ("scales", "signs")),
                       (1, fmt.chunk, 0), mat.shape[0], out, stream, per_block=PER_BLOCK)
