"""QSGD: stochastic rounding to ``levels`` (s) levels per sign, scaled by the chunk norm.

For each chunk (c = x + e under error feedback, v = float32(c)):
  1. norm = sqrt(sum v**2) in the wire summation order (``_scalar.chunk_sum``);
  2. ratio = s / norm (0 when norm is 0); step = norm / s;
  3. r = |v| * ratio; lo = floor(r); level = lo + 1 with probability r - lo,
     else lo, drawing u = uniform24(key, i) for element i (level <= s);
  4. code = sign(v) * level stored as int8; x_hat = code * step;
  5. with error feedback, e <- c - x_hat.
E[level] = r (u is uniform on a 2**-24 grid, so up to 2**-24), hence
E[x_hat] = v: the quantizer is unbiased.  The same ``seed`` gives the same
payload on every run and on host and device.  Payload: ``QSGDFormat``.
"""
import numpy as np
from numba import njit, prange

from ._api import encode_payload, encode_rows
from ._chunk_rules import qsgd_level, qsgd_norm, qsgd_steps
from ._disk_cache import cached_njit
from ._host_chunks import chunk_source
from ._scalar import chunk_sum, mul32, rng_key, row_key, row_prefix, uniform24
from .wire import QSGDFormat


@njit(nogil=True, inline="always")
def qsgd_code(v, ratio, levels, key, i):
    """Signed stochastic level of v (see module docstring, step 3)."""
    return qsgd_level(v, mul32(abs(v), ratio), uniform24(key, i), levels)


@njit(nogil=True)
def encode_chunk(src, has_res, first, ratio, step, levels, key, codes):
    """Codes of one chunk view; with has_res, src holds c and becomes the
    residual.  ``first`` is the chunk's global index, the RNG counter of its
    first element."""
    if has_res:
        for i in range(src.size):
            c = src[i]
            code = qsgd_code(np.float32(c), ratio, levels, key, first + i)
            codes[i] = np.int8(code)
            src[i] = c - mul32(np.float32(code), step)
    else:
        for i in range(src.size):
            codes[i] = np.int8(qsgd_code(np.float32(src[i]), ratio, levels, key, first + i))


@njit(nogil=True)
def encode_one(x, e, has_res, ci, chunk, size, levels, key, norms, codes):
    """Chunk ci of one payload of ``size`` elements (x may end short: zeros): form c (kept in
    e), its norm, then codes and residual.  ``norms``, ``codes``: the payload's sections."""
    s, t, src = chunk_source(x, e, has_res, ci, chunk, size)
    norm = qsgd_norm(chunk_sum(src, True))
    ratio, step = qsgd_steps(norm, levels)
    norms[ci] = norm
    encode_chunk(src, has_res, s, ratio, step, levels, key, codes[s:t])


@cached_njit(nogil=True, parallel=True)
def encode_cpu(x, e, has_res, chunk, levels, key, norms, codes):
    """CPU twin: one chunk per parallel iteration."""
    for ci in prange((x.size + chunk - 1) // chunk):
        encode_one(x, e, has_res, ci, chunk, x.size, levels, key, norms, codes)


@cached_njit(nogil=True, parallel=True)
def encode_rows_cpu(x, e, has_res, part, chunk, levels, prefix, phase, norms, ncol, codes,
                    ccol):
    """CPU twin of the row form: partition k of x (and e) into row k of the (rows, width)
    views ``norms`` / ``codes`` (sections at columns ncol / ccol), keyed by
    ``row_key(prefix, k, phase)``; one (partition, chunk) pair per parallel iteration, each
    exactly ``encode_cpu``'s chunk."""
    rows = norms.shape[0]
    nc = (part + chunk - 1) // chunk
    keys = np.empty(rows, np.uint64)
    for k in range(rows):
        keys[k] = row_key(prefix, np.uint64(k), phase)
    for j in prange(rows * nc):
        k = j // nc
        lo = k * part
        encode_one(x[lo:lo + part], e[lo:lo + part], has_res, j - k * nc, chunk, part, levels,
                   keys[k], norms[k, ncol:ncol + nc], codes[k, ccol:ccol + part])


@njit(nogil=True)
def decode_row(codes, step, out, add):
    """out (+)= code * step for one chunk (views) of one payload row."""
    if add:
        for i in range(out.size):
            out[i] = out[i] + mul32(np.float32(codes[i]), step)
    else:
        for i in range(out.size):
            out[i] = mul32(np.float32(codes[i]), step)


@cached_njit(nogil=True, parallel=True)
def decode_cpu_kernel(norms, ncol, codes, ccol, levels, chunk, out, accumulate):
    """out[i] (+)= sum over rows p of code * (norm / levels), rows in order."""
    n = out.size
    for ci in prange((n + chunk - 1) // chunk):
        s = ci * chunk
        t = min(n, s + chunk)
        for p in range(norms.shape[0]):
            step = norms[p, ncol + ci] / np.float32(levels)
            decode_row(codes[p, ccol + s:ccol + t], step, out[s:t], accumulate or p > 0)


@cached_njit(nogil=True, parallel=True)
def decode_rows_cpu_kernel(norms, ncol, codes, ccol, levels, chunk, part, out):
    """out[k * part + i] = code * (norm / levels) of element i of row k (each row on its own)."""
    nc = (part + chunk - 1) // chunk
    for j in prange(norms.shape[0] * nc):
        k = j // nc
        ci = j - k * nc
        s = ci * chunk
        t = min(part, s + chunk)
        step = norms[k, ncol + ci] / np.float32(levels)
        decode_row(codes[k, ccol + s:ccol + t], step, out[k * part + s:k * part + t], False)


def compress_qsgd(x, levels=127, chunk=1024, seed=0, residual=None, out=None, stream=None):
    """QSGD-quantize x with ``levels`` (1..127) per sign and per-chunk norms.

    ``seed`` makes the stochastic rounding reproducible (derive it from the
    step and rank).  Returns a Payload of ``QSGDFormat(x.size, levels, chunk)``.
    Example: ``p = compress_qsgd(g, seed=step); decompress(p, out=g)``.
    Device launches: 1 (a block per chunk sums its squares and encodes it, block 0
    zeroing the padding); 3 when chunk > 4096 (segment sums, chunk norms, segment
    encoding); none for an empty tensor.
    """
    key = rng_key(seed)

    def on_device(xa, ea, fmt, v, buf, st):
        from ._cuda import qsgd as kern
        kern.encode(xa, ea, fmt, key, v["norms"], v["codes"], buf, st)

    def on_host(xa, c, has_res, fmt, v):
        encode_cpu(xa, c, has_res, fmt.chunk, fmt.levels, key, v["norms"], v["codes"])

    return encode_payload(x, residual, out, stream, lambda n: QSGDFormat(n, levels, chunk),
                          on_device, on_host)


def compress_qsgd_rows(x, out, col=0, levels=127, chunk=1024, row_seeds=(0, 0, 0),
                       residual=None, stream=None):
    """``compress_qsgd`` of each of the len(out) partitions of x, into the rows of out.

    ``out`` is a (rows, width) uint8 matrix; partition k (x[k*P:(k+1)*P], P = ceil(x.size /
    rows); x zero-padded to rows * P, without a copy: elements past its end read as zeros)
    is encoded into out[k, col:col + fmt.nbytes], byte for byte what ``compress_qsgd`` of
    that partition (with residual[k*P:(k+1)*P]; the residual has rows * P elements) writes
    with ``seed=row_seed(base, rank, k, phase)`` for ``row_seeds=(base, rank, phase)``: the CRC-32
    of the int64 words (base, rank, k, phase) & 0x7FFFFFFF, bagua_mpi's
    ``call_seed(base, rank, k, phase)`` (the device derives each row's key itself).  ``col``
    and width are multiples of ALIGN.  Returns fmt = ``QSGDFormat(P, levels, chunk)``.
    Device launches: 1 (a block per (chunk, partition) pair); 3 when chunk > 4096 (as
    ``compress_qsgd``, each over every partition at once); none for an empty tensor.
    """
    base, rank, phase = (int(v) for v in row_seeds)
    prefix = row_prefix(base, rank)
    phase = np.int64(phase).view(np.uint64)

    def on_device(xa, ea, fmt, v, mat, col, st):
        from ._cuda import qsgd as kern
        kern.encode_rows(xa, ea, fmt, prefix, phase, v, mat, col, st)

    def on_host(xa, c, has_res, fmt, v):
        norms, ncol = v["norms"]
        codes, ccol = v["codes"]
        encode_rows_cpu(xa, c, has_res, fmt.n, fmt.chunk, fmt.levels, prefix, phase, norms,
                        ncol, codes, ccol)

    return encode_rows(x, residual, out, col, stream, lambda n: QSGDFormat(n, levels, chunk),
                       on_device, on_host)


def decode_cpu(fmt, stack, col, out, accumulate):
    """Sum the payloads at byte column ``col`` of the rows of ``stack`` into out (see
    ``registry.Codec``)."""
    v = fmt.views2d(stack, col)
    norms, ncol = v["norms"]
    codes, ccol = v["codes"]
    decode_cpu_kernel(norms, ncol, codes, ccol, fmt.levels, fmt.chunk, out, accumulate)


def decode_rows_cpu(fmt, matrix, col, out):
    """Row k of ``matrix`` (its payload at byte column ``col``) into out[k*n:(k+1)*n]."""
    v = fmt.views2d(matrix, col)
    norms, ncol = v["norms"]
    codes, ccol = v["codes"]
    decode_rows_cpu_kernel(norms, ncol, codes, ccol, fmt.levels, fmt.chunk, fmt.n, out)


def decode_device(fmt, stack, col, out, accumulate, factor, stream):
    """The CUDA twin of ``decode_cpu`` (see ``registry.Codec``).

    Device launches: 1 (every row decoded and summed in one pass over out).
    """
    from ._cuda import qsgd as kern
    kern.decode(fmt, stack, col, out, accumulate, factor, stream)


def decode_rows_device(fmt, matrix, col, out, stream):
    """The CUDA twin of ``decode_rows_cpu`` (see ``registry.Codec``).

    Device launches: 1 (a grid of blocks over the partition by rows, each row into its own
    partition of out).
    """
    from ._cuda import qsgd as kern
    kern.decode_rows(fmt, matrix, col, out, stream)
