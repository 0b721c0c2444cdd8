"""1-bit compression: signs packed 32 per uint32 word plus one scale per chunk.

For each chunk of length L (c = x + e under error feedback, v = float32(c)):
  1. scale = sqrt(sum v**2 / L) (``scale="l2"``: ||c||_2 / sqrt(L), as 1-bit
     Adam uses) or sum |v| / L (``scale="mean_abs"``), summed in the wire order;
  2. bit i = 1 if v < 0, packed LSB-first 32 per word;
  3. x_hat = -scale if the bit is set else +scale;
  4. with error feedback, e <- c - x_hat.
``chunk`` must be a multiple of 32 (each chunk's signs fill whole words);
``chunk >= x.size`` gives one scale for the whole tensor.  Payload: ``OneBitFormat``.
"""
import numpy as np
from numba import njit, prange

from ._api import encode_payload, encode_rows
from ._chunk_rules import onebit_scale
from ._disk_cache import cached_njit
from ._host_chunks import chunk_source
from ._scalar import bits_f32, chunk_sum, f32_bits
from .errors import KernelParameterError
from .wire import OneBitFormat

SCALES = ("l2", "mean_abs")


@njit(nogil=True)
def encode_chunk(src, has_res, scale, words):
    """Sign words of one chunk view, 32 elements per word; with has_res, src
    holds c and becomes the residual c - x_hat."""
    for w in range(words.size):
        row = src[32 * w:32 * w + 32]
        word = np.uint32(0)
        for j in range(row.size):
            if np.float32(row[j]) < np.float32(0.0):
                word |= np.uint32(1) << np.uint32(j)
        words[w] = word
    if has_res:
        for i in range(src.size):
            c = src[i]
            src[i] = c - (-scale if np.float32(c) < np.float32(0.0) else scale)


@njit(nogil=True)
def encode_one(x, e, has_res, ci, chunk, size, square, scales, words):
    """Chunk ci of one payload of ``size`` elements (x may end short: zeros): form c (kept in
    e), the scale, then signs and residual.  ``scales``, ``words``: the payload's sections."""
    s, t, src = chunk_source(x, e, has_res, ci, chunk, size)
    scale = onebit_scale(chunk_sum(src, square), t - s, square)
    scales[ci] = scale
    encode_chunk(src, has_res, scale, words[s >> 5:(t + 31) >> 5])


@cached_njit(nogil=True, parallel=True)
def encode_cpu(x, e, has_res, chunk, square, scales, words):
    """CPU twin: one chunk per parallel iteration."""
    for ci in prange((x.size + chunk - 1) // chunk):
        encode_one(x, e, has_res, ci, chunk, x.size, square, scales, words)


@cached_njit(nogil=True, parallel=True)
def encode_rows_cpu(x, e, has_res, part, chunk, square, scales, scol, words, wcol):
    """CPU twin of the row form: partition k of x (and e) into row k of the (rows, width)
    views ``scales`` / ``words`` (sections at columns scol / wcol); one (partition, chunk)
    pair per parallel iteration, each exactly ``encode_cpu``'s chunk."""
    nc = (part + chunk - 1) // chunk
    nwords = (part + 31) // 32
    for j in prange(scales.shape[0] * nc):
        k = j // nc
        lo = k * part
        encode_one(x[lo:lo + part], e[lo:lo + part], has_res, j - k * nc, chunk, part, square,
                   scales[k, scol:scol + nc], words[k, wcol:wcol + nwords])


@njit(nogil=True, inline="always")
def fold_word(word, scale_bits, group, add):
    """group (+)= +-scale for the (up to 32) elements whose sign bits are ``word``'s, LSB
    first.  The sign is the scale's sign bit flipped by the element's bit, which is -scale
    where the bit is set, bit for bit (NaN and zero too), with no branch: a branch per
    element, mispredicted on half of them, made the decode five times slower, and reading
    the word once per element twice as slow again."""
    if add:
        for j in range(group.size):
            bit = (word >> np.uint32(j)) & np.uint32(1)
            group[j] = group[j] + bits_f32(scale_bits ^ (bit << np.uint32(31)))
    else:
        for j in range(group.size):
            bit = (word >> np.uint32(j)) & np.uint32(1)
            group[j] = bits_f32(scale_bits ^ (bit << np.uint32(31)))


@njit(nogil=True)
def decode_row(words, scale, out, add):
    """out (+)= +-scale for one chunk (views: words start at the chunk) of one row, a sign
    word (32 elements) at a time."""
    scale_bits = f32_bits(scale)
    for w in range((out.size + 31) >> 5):
        fold_word(words[w], scale_bits, out[32 * w:32 * w + 32], add)


@cached_njit(nogil=True, parallel=True)
def decode_cpu_kernel(scales, scol, words, wcol, chunk, out, accumulate):
    """out[i] (+)= sum over rows p of +-scale, rows in order."""
    n = out.size
    for ci in prange((n + chunk - 1) // chunk):
        s = ci * chunk
        t = min(n, s + chunk)
        for p in range(scales.shape[0]):
            decode_row(words[p, wcol + (s >> 5):], scales[p, scol + ci], out[s:t],
                       accumulate or p > 0)


@cached_njit(nogil=True, parallel=True)
def decode_rows_cpu_kernel(scales, scol, words, wcol, chunk, part, out):
    """out[k * part + i] = +-scale of element i of row k (each row on its own)."""
    nc = (part + chunk - 1) // chunk
    for j in prange(scales.shape[0] * nc):
        k = j // nc
        ci = j - k * nc
        s = ci * chunk
        t = min(part, s + chunk)
        decode_row(words[k, wcol + (s >> 5):], scales[k, scol + ci], out[k * part + s:k * part + t],
                   False)


def compress_onebit(x, chunk=4096, scale="l2", residual=None, out=None, stream=None):
    """Sign-compress x with one ``scale`` ('l2' or 'mean_abs') per chunk.

    Returns a Payload of ``OneBitFormat(x.size, chunk)``.  1-bit Adam uses
    ``scale='l2'`` with error feedback: ``compress_onebit(m, residual=e)``.
    Device launches: 1 (a block per chunk sums it and writes its signs, block 0
    zeroing the padding); 3 when chunk > 4096 (segment sums, chunk scales, segment
    encoding); none for an empty tensor.
    """
    if scale not in SCALES:
        raise KernelParameterError(f"scale must be one of {SCALES}, got {scale!r}")
    l2 = scale == "l2"

    def on_device(xa, ea, fmt, v, buf, st):
        from ._cuda import onebit as kern
        kern.encode(xa, ea, fmt, l2, v["scales"], v["signs"], buf, st)

    def on_host(xa, c, has_res, fmt, v):
        encode_cpu(xa, c, has_res, fmt.chunk, l2, v["scales"], v["signs"])

    return encode_payload(x, residual, out, stream, lambda n: OneBitFormat(n, chunk),
                          on_device, on_host)


def compress_onebit_rows(x, out, col=0, chunk=4096, scale="l2", residual=None, stream=None):
    """``compress_onebit`` of each of the len(out) partitions of x, into the rows of out.

    ``out`` is a (rows, width) uint8 matrix; partition k (x[k*P:(k+1)*P], P = ceil(x.size /
    rows); x zero-padded to rows * P, without a copy: elements past its end read as zeros)
    is encoded into out[k, col:col + fmt.nbytes], byte for byte what ``compress_onebit`` of
    that partition (with residual[k*P:(k+1)*P]; the residual has rows * P elements) writes;
    ``col`` and width are multiples of ALIGN.  Returns fmt = ``OneBitFormat(P, chunk)``,
    the format of each row's payload.
    Device launches: 1 (a block per (chunk, partition) pair); 3 when chunk > 4096 (as
    ``compress_onebit``, each over every partition at once); none for an empty tensor.
    """
    if scale not in SCALES:
        raise KernelParameterError(f"scale must be one of {SCALES}, got {scale!r}")
    l2 = scale == "l2"

    def on_device(xa, ea, fmt, v, mat, col, st):
        from ._cuda import onebit as kern
        kern.encode_rows(xa, ea, fmt, l2, v, mat, col, st)

    def on_host(xa, c, has_res, fmt, v):
        scales, scol = v["scales"]
        words, wcol = v["signs"]
        encode_rows_cpu(xa, c, has_res, fmt.n, fmt.chunk, l2, scales, scol, words, wcol)

    return encode_rows(x, residual, out, col, stream, lambda n: OneBitFormat(n, chunk),
                       on_device, on_host)


def decode_cpu(fmt, stack, col, out, accumulate):
    """Sum the payloads at byte column ``col`` of the rows of ``stack`` into out (see
    ``registry.Codec``)."""
    v = fmt.views2d(stack, col)
    scales, scol = v["scales"]
    words, wcol = v["signs"]
    decode_cpu_kernel(scales, scol, words, wcol, fmt.chunk, out, accumulate)


def decode_rows_cpu(fmt, matrix, col, out):
    """Row k of ``matrix`` (its payload at byte column ``col``) into out[k*n:(k+1)*n]."""
    v = fmt.views2d(matrix, col)
    scales, scol = v["scales"]
    words, wcol = v["signs"]
    decode_rows_cpu_kernel(scales, scol, words, wcol, fmt.chunk, fmt.n, out)


def decode_device(fmt, stack, col, out, accumulate, factor, stream):
    """The CUDA twin of ``decode_cpu`` (see ``registry.Codec``).

    Device launches: 1 (every row decoded and summed in one pass over out).
    """
    from ._cuda import onebit as kern
    kern.decode(fmt, stack, col, out, accumulate, factor, stream)


def decode_rows_device(fmt, matrix, col, out, stream):
    """The CUDA twin of ``decode_rows_cpu`` (see ``registry.Codec``).

    Device launches: 1 (a grid of blocks over the partition by rows, each row into its own
    partition of out).
    """
    from ._cuda import onebit as kern
    kern.decode_rows(fmt, matrix, col, out, stream)
