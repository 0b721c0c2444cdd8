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

from ._api import encode_payload
from ._chunk_rules import onebit_scale
from ._host_chunks import chunk_source
from ._scalar import add_or_replace, chunk_sum
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


@njit(nogil=True, parallel=True, cache=True)
def encode_cpu(x, e, has_res, chunk, square, scales, words):
    """CPU twin: per chunk, form c (kept in e), the scale, then signs and residual."""
    n = x.size
    for ci in prange((n + chunk - 1) // chunk):
        s, t, src = chunk_source(x, e, has_res, ci, chunk)
        scale = onebit_scale(chunk_sum(src, square), t - s, square)
        scales[ci] = scale
        encode_chunk(src, has_res, scale, words[s >> 5:(t + 31) >> 5])


@njit(nogil=True)
def decode_row(words, scale, out, add):
    """out (+)= +-scale for one chunk (views: words start at the chunk) of one row."""
    for i in range(out.size):
        bit = (words[i >> 5] >> np.uint32(i & 31)) & np.uint32(1)
        out[i] = add_or_replace(out[i], -scale if bit else scale, add)


@njit(nogil=True, parallel=True, cache=True)
def decode_cpu_kernel(scales, scol, words, wcol, chunk, out, accumulate):
    """out[i] (+)= sum over rows p of +-scale, rows in order."""
    n = out.size
    for ci in prange((n + chunk - 1) // chunk):
        s = ci * chunk
        t = min(n, s + chunk)
        for p in range(scales.shape[0]):
            decode_row(words[p, wcol + (s >> 5):], scales[p, scol + ci], out[s:t],
                       accumulate or p > 0)


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


def decode_cpu(fmt, stack, out, accumulate):
    v = fmt.views2d(stack)
    scales, scol = v["scales"]
    words, wcol = v["signs"]
    decode_cpu_kernel(scales, scol, words, wcol, fmt.chunk, out, accumulate)


def decode_device(fmt, stack, out, accumulate, stream):
    """The CUDA twin of ``decode_cpu`` (see ``registry.Codec``).

    Device launches: 1 (every row decoded and summed in one pass over out).
    """
    from ._cuda import onebit as kern
    kern.decode(fmt, stack, out, accumulate, stream)
