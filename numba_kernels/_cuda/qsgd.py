"""CUDA kernels for QSGD (see numba_kernels.qsgd)."""
import math

import numpy as np
from numba import cuda

from .._scalar import LANES, SEGMENT
from .common import (THREADS, block_lane_combine, block_lane_sum, blocks_for, lesser, load_c, mul32,
                     seg_sums, segment, uniform24, zero_tail)


@cuda.jit(device=True)
def _code(v, ratio, levels, key, i):
    r = mul32(abs(v), ratio)
    lo = math.floor(r)
    level = lo
    if uniform24(key, i) < r - np.float32(lo):
        level = lo + 1
    level = lesser(level, levels)
    if v < np.float32(0.0):
        return -level
    return level


@cuda.jit(device=True)
def _norm_params(sumsq, levels):
    norm = np.float32(math.sqrt(sumsq))
    ratio = np.float32(0.0)
    if norm > np.float32(0.0):
        ratio = np.float32(levels) / norm
    return norm, ratio, norm / np.float32(levels)


@cuda.jit(device=True)
def _encode_range(x, e, has_res, s, t, levels, key, ratio, step, codes):
    i = s + cuda.threadIdx.x
    while i < t:
        c = load_c(x, e, has_res, i)
        code = _code(np.float32(c), ratio, levels, key, i)
        codes[i] = np.int8(code)
        if has_res:
            e[i] = c - mul32(np.float32(code), step)
        i += THREADS


@cuda.jit
def _fused(x, e, has_res, chunk, levels, key, norms, codes, buf, used, nbytes):
    zero_tail(buf, used, nbytes)
    sh = cuda.shared.array(LANES, np.float32)
    ci = cuda.blockIdx.x
    s = ci * chunk
    t = lesser(x.size, s + chunk)
    norm, ratio, step = _norm_params(block_lane_sum(x, e, has_res, s, t, True, sh), levels)
    if cuda.threadIdx.x == 0:
        norms[ci] = norm
    _encode_range(x, e, has_res, s, t, levels, key, ratio, step, codes)


@cuda.jit
def _chunk_norms(part, spc, chunk, n, norms):
    sh = cuda.shared.array(LANES, np.float32)
    ci = cuda.blockIdx.x
    nseg = (lesser(n - ci * chunk, chunk) + SEGMENT - 1) // SEGMENT
    total = block_lane_combine(part, ci * spc, nseg, sh)
    if cuda.threadIdx.x == 0:
        norms[ci] = np.float32(math.sqrt(total))


@cuda.jit
def _seg_encode(x, e, has_res, chunk, spc, levels, key, norms, codes, buf, used, nbytes):
    zero_tail(buf, used, nbytes)
    ci, s, t = segment(cuda.blockIdx.x, spc, chunk, x.size)
    if s < t:
        norm = norms[ci]
        ratio = np.float32(0.0)
        if norm > np.float32(0.0):
            ratio = np.float32(levels) / norm
        _encode_range(x, e, has_res, s, t, levels, key, ratio, norm / np.float32(levels), codes)


@cuda.jit
def _decode(norms, ncol, codes, ccol, levels, chunk, out, accumulate):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        ci = i // chunk
        acc = out[i]
        for p in range(norms.shape[0]):
            step = norms[p, ncol + ci] / np.float32(levels)
            xh = mul32(np.float32(codes[p, ccol + i]), step)
            if accumulate or p > 0:
                acc = acc + xh
            else:
                acc = xh
        out[i] = acc
        i += stride


def encode(x, e, fmt, key, norms, codes, buf, stream):
    """Launch the QSGD encoder for ``fmt`` (x, e flat device arrays)."""
    ee, has_res = (x, False) if e is None else (e, True)
    if fmt.chunk <= SEGMENT:
        _fused[fmt.nchunks, THREADS, stream](x, ee, has_res, fmt.chunk, fmt.levels, key, norms,
                                             codes, buf, fmt.used_nbytes, fmt.nbytes)
        return
    from .. import _device
    spc = -(-fmt.chunk // SEGMENT)
    nblk = fmt.nchunks * spc
    part = _device.cuda().device_array(nblk, np.float32, stream=stream)
    seg_sums[nblk, THREADS, stream](x, ee, has_res, fmt.chunk, spc, True, part)
    _chunk_norms[fmt.nchunks, THREADS, stream](part, spc, fmt.chunk, x.size, norms)
    _seg_encode[nblk, THREADS, stream](x, ee, has_res, fmt.chunk, spc, fmt.levels, key, norms,
                                       codes, buf, fmt.used_nbytes, fmt.nbytes)


def decode(fmt, stack, out, accumulate, stream):
    v = fmt.views2d(stack)
    norms, ncol = v["norms"]
    codes, ccol = v["codes"]
    grid = min(blocks_for(out.size, THREADS), 65536)
    _decode[grid, THREADS, stream](norms, ncol, codes, ccol, fmt.levels, fmt.chunk, out, accumulate)
