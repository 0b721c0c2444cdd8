"""CUDA kernels for QSGD (see numba_kernels.qsgd; chunk norms and levels from ``_chunk_rules``)."""
import numpy as np
from numba import cuda

from .._chunk_rules import qsgd_level_py, qsgd_norm_py, qsgd_steps_py
from .._scalar import LANES, SEGMENT
from .common import (add_or_replace, block_lane_combine, block_lane_sum, lesser, load_c, mul32,
                     seg_sums, segment, uniform24, zero_tail)
from .geometry import THREADS
from .launch import ChunkedEncoder, decode_stack

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
    norm = qsgd_norm(block_lane_sum(x, e, has_res, s, t, True, sh))
    ratio, step = qsgd_steps(norm, levels)
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
        norms[ci] = qsgd_norm(total)


@cuda.jit
def _seg_encode(x, e, has_res, chunk, spc, levels, key, norms, codes, buf, used, nbytes):
    zero_tail(buf, used, nbytes)
    ci, s, t = segment(cuda.blockIdx.x, spc, chunk, x.size)
    if s < t:
        ratio, step = qsgd_steps(norms[ci], levels)
        _encode_range(x, e, has_res, s, t, levels, key, ratio, step, codes)


@cuda.jit
def _decode(norms, ncol, codes, ccol, levels, chunk, out, accumulate):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        ci = i // chunk
        acc = out[i]
        for p in range(norms.shape[0]):
            step = norms[p, ncol + ci] / np.float32(levels)
            acc = add_or_replace(acc, mul32(np.float32(codes[p, ccol + i]), step),
                                 accumulate or p > 0)
        out[i] = acc
        i += stride


_ENCODER = ChunkedEncoder(_fused, seg_sums, _chunk_norms, _seg_encode)


def encode(x, e, fmt, key, norms, codes, buf, stream):
    """Encode for QSGDFormat ``fmt`` (x, e flat device arrays): 1 launch, 3 for long chunks."""
    _ENCODER(x, e, fmt, buf, stream, enc=(fmt.levels, key, norms, codes), red=(True,),
             comb=(norms,))


def decode(fmt, stack, out, accumulate, stream):
    """1 launch: every row decoded and summed in one pass over out."""
    decode_stack(_decode, fmt, stack, ("norms", "codes"), (fmt.levels, fmt.chunk), out,
                 accumulate, stream)
