"""CUDA kernels for 1-bit compression (see numba_kernels.onebit)."""
import math

import numpy as np
from numba import cuda

from .._scalar import LANES, SEGMENT
from .common import (NL, THREADS, ballot32, block_lane_combine, block_lane_sum, blocks_for, lesser,
                     load_c, seg_sums, segment, zero_tail)

@cuda.jit(device=True)
def _scale(total, length, square):
    mean = total / np.float32(length)
    if square:
        return np.float32(math.sqrt(mean))
    return mean


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
    scale = _scale(block_lane_sum(x, e, has_res, s, t, square, sh), t - s, square)
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
        scales[ci] = _scale(total, length, square)


@cuda.jit
def _seg_encode(x, e, has_res, chunk, spc, scales, words, buf, used, nbytes):
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
            scale = scales[p, scol + ci]
            xh = scale
            if (words[p, wcol + (i >> 5)] >> np.uint32(i & 31)) & np.uint32(1):
                xh = -scale
            if accumulate or p > 0:
                acc = acc + xh
            else:
                acc = xh
        out[i] = acc
        i += stride


def encode(x, e, fmt, square, scales, words, buf, stream):
    """Launch the 1-bit encoder for ``fmt`` (x, e flat device arrays)."""
    ee, has_res = (x, False) if e is None else (e, True)
    if fmt.chunk <= SEGMENT:
        _fused[fmt.nchunks, THREADS, stream](x, ee, has_res, fmt.chunk, square, scales, words,
                                             buf, fmt.used_nbytes, fmt.nbytes)
        return
    from .. import _device
    spc = -(-fmt.chunk // SEGMENT)
    nblk = fmt.nchunks * spc
    part = _device.cuda().device_array(nblk, np.float32, stream=stream)
    seg_sums[nblk, THREADS, stream](x, ee, has_res, fmt.chunk, spc, square, part)
    _chunk_scales[fmt.nchunks, THREADS, stream](part, spc, fmt.chunk, x.size, square, scales)
    _seg_encode[nblk, THREADS, stream](x, ee, has_res, fmt.chunk, spc, scales, words, buf,
                                       fmt.used_nbytes, fmt.nbytes)


def decode(fmt, stack, out, accumulate, stream):
    v = fmt.views2d(stack)
    scales, scol = v["scales"]
    words, wcol = v["signs"]
    grid = min(blocks_for(out.size, THREADS), 65536)
    _decode[grid, THREADS, stream](scales, scol, words, wcol, fmt.chunk, out, accumulate)
