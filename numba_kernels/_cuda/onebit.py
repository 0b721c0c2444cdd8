"""CUDA kernels for 1-bit compression (see numba_kernels.onebit; scales from ``_chunk_rules``)."""
import numpy as np
from numba import cuda

from .._chunk_rules import onebit_scale_py
from .._scalar import LANES, SEGMENT
from .common import (add_or_replace, ballot32, block_lane_combine, block_lane_sum, lesser, load_c,
                     seg_sums, segment, zero_tail)
from .geometry import NL, THREADS
from .launch import ChunkedEncoder, decode_stack

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
                        e[i] = c + scale
                    else:
                        e[i] = c - scale
            word = ballot32(neg, scratch)        # every thread votes, in range or not
            first = lane - (lane & 31)
            if (lane & 31) == 0 and first < cnt:
                words[((row + first) >> 5)] = word
        row += LANES


@cuda.jit
def _fused(x, e, has_res, chunk, square, scales, words, buf, used, nbytes):
    zero_tail(buf, used, nbytes)
    sh = cuda.shared.array(LANES, np.float32)
    scratch = cuda.shared.array(THREADS, np.uint32)
    ci = cuda.blockIdx.x
    s = ci * chunk
    t = lesser(x.size, s + chunk)
    scale = onebit_scale(block_lane_sum(x, e, has_res, s, t, square, sh), t - s, square)
    if cuda.threadIdx.x == 0:
        scales[ci] = scale
    _encode_range(x, e, has_res, s, t, scale, words, scratch)


@cuda.jit
def _chunk_scales(part, spc, chunk, n, square, scales):
    sh = cuda.shared.array(LANES, np.float32)
    ci = cuda.blockIdx.x
    length = lesser(n - ci * chunk, chunk)
    total = block_lane_combine(part, ci * spc, (length + SEGMENT - 1) // SEGMENT, sh)
    if cuda.threadIdx.x == 0:
        scales[ci] = onebit_scale(total, length, square)


@cuda.jit
def _seg_encode(x, e, has_res, chunk, spc, square, scales, words, buf, used, nbytes):
    # ``square`` is unused (the scale is already known): the arguments follow ChunkedEncoder's
    # convention of passing the fused kernel's own arguments to the segment encoder.
    zero_tail(buf, used, nbytes)
    scratch = cuda.shared.array(THREADS, np.uint32)
    ci, s, t = segment(cuda.blockIdx.x, spc, chunk, x.size)
    if s < t:
        _encode_range(x, e, has_res, s, t, scales[ci], words, scratch)


@cuda.jit
def _decode(scales, scol, words, wcol, chunk, out, accumulate):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        ci = i // chunk
        acc = out[i]
        for p in range(scales.shape[0]):
            xh = scales[p, scol + ci]
            if (words[p, wcol + (i >> 5)] >> np.uint32(i & 31)) & np.uint32(1):
                xh = -xh
            acc = add_or_replace(acc, xh, accumulate or p > 0)
        out[i] = acc
        i += stride


_ENCODER = ChunkedEncoder(_fused, seg_sums, _chunk_scales, _seg_encode)


def encode(x, e, fmt, square, scales, words, buf, stream):
    """Encode for OneBitFormat ``fmt`` (x, e flat device arrays): 1 launch, 3 for long chunks."""
    _ENCODER(x, e, fmt, buf, stream, enc=(square, scales, words), red=(square,),
             comb=(square, scales))


def decode(fmt, stack, out, accumulate, stream):
    """1 launch: every row decoded and summed in one pass over out."""
    decode_stack(_decode, fmt, stack, ("scales", "signs"), (fmt.chunk,), out, accumulate, stream)
