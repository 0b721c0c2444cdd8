"""Per-chunk min-max quantization to b bits (b = 1..8), densely bit-packed.

For each chunk of ``chunk`` elements (the last may be shorter), with
c = x + e under error feedback, v = float32(c):
  1. mn = min v, mx = max v over the chunk (a zero minimum is +0.0);
  2. scale = (mx - mn) / (2**bits - 1) in float32; inv = 1 / scale (0 if scale is 0);
  3. code = clamp(floor(fma(v - mn, inv, 0.5)), 0, 2**bits - 1) -- nearest level;
  4. x_hat = fma(code, scale, mn) -- so |v - x_hat| <= scale / 2 up to rounding;
  5. with error feedback, e <- c - x_hat (in c's dtype), in the same pass.
Payload: ``MinMaxFormat`` (per-chunk (mn, scale) float32 pairs, then the
codes packed LSB-first).  ``chunk`` must be a multiple of 32 so each chunk's
codes fill whole words.

Non-finite values: a NaN anywhere in a chunk makes its range NaN (``_scalar.range_min``,
whatever the position or the order of the reduction), so the chunk's mn and scale are NaN
(stored as the quiet NaN 0x7FC00000, ``minmax_params``), every code of the chunk is 0 (the
clamp of step 3 maps a NaN level to 0) and every element decodes to NaN: the averaged
gradient is not finite, so a loss scaler skips the step, as it would without compression.
An infinity gives an infinite or NaN scale and a NaN decode in the same way; the payload
bytes are the same on both targets.
"""

import numpy as np
from numba import njit, prange

from ._api import encode_payload, encode_rows
from ._bits import read_code
from ._chunk_rules import minmax_params
from ._disk_cache import cached_njit
from ._host_chunks import chunk_source
from ._scalar import fma32, greater, lesser, range_max, range_min
from .errors import KernelParameterError
from .wire import MinMaxFormat

_U64 = np.uint64
_MASK32 = _U64(0xFFFFFFFF)
_S32 = _U64(32)


@njit(nogil=True)
def value_range(a):
    """(min, max) of float32(a) for a chunk view: (NaN, NaN) where an element is NaN.  No
    fast math: nnan would let LLVM assume the NaN away (the min() it used dropped NaNs)."""
    mn = np.float32(np.inf)
    mx = np.float32(-np.inf)
    for i in range(a.size):
        v = np.float32(a[i])
        mn = range_min(mn, v)
        mx = range_max(mx, v)
    return mn, mx


@njit(nogil=True, inline="always")
def quantize(v, mn, inv, levels):
    """Nearest level of v as a float32 integer in [0, levels]; 0 where the level is NaN (a
    NaN v or mn, or an infinite v with inv 0): ``greater`` returns its bound for a NaN.

    (The device clamps before it rounds with ``math.floor`` (Numba's CUDA target has no
    ``np.floor``), so that the floor never takes a NaN, which the simulator's refuses: the
    same integer for every input.)"""
    q = np.floor(fma32(v - mn, inv, np.float32(0.5)))
    return lesser(greater(q, np.float32(0.0)), np.float32(levels))


@njit(nogil=True)
def encode_codes(src, has_res, mn, scale, inv, levels, codes):
    """codes[i] = code of src[i] for chunk views.  With has_res, src holds c and
    becomes the residual c - x_hat (one array read and written, so the loop
    vectorises without aliasing checks)."""
    if has_res:
        for i in range(src.size):
            c = src[i]
            q = quantize(np.float32(c), mn, inv, levels)
            codes[i] = np.uint8(np.int32(q))
            src[i] = c - fma32(q, scale, mn)
    else:
        for i in range(src.size):
            codes[i] = np.uint8(np.int32(quantize(np.float32(src[i]), mn, inv, levels)))


@njit(nogil=True)
def pack_codes(codes, bits, words):
    """Pack codes LSB-first into the words view (each 32 codes fill ``bits`` words)."""
    count = codes.size
    if 32 % bits == 0:
        # widths 1, 2, 4 (8 never packs): a word holds exactly 32 / bits codes
        per = 32 // bits
        full = count // per
        for w in range(full):
            group = codes[w * per:(w + 1) * per]
            word = np.uint32(0)
            for j in range(per):
                word |= np.uint32(group[j]) << np.uint32(j * bits)
            words[w] = word
        if full < words.size:
            word = np.uint32(0)
            for j in range(count - full * per):
                word |= np.uint32(codes[full * per + j]) << np.uint32(j * bits)
            words[full] = word
        return
    for g in range((count + 31) // 32):
        acc = _U64(0)
        nbits = 0
        w = g * bits
        for j in range(32):
            i = g * 32 + j
            code = _U64(codes[i]) if i < count else _U64(0)
            acc |= code << _U64(nbits)
            nbits += bits
            if nbits >= 32:
                if w < words.size:
                    words[w] = np.uint32(acc & _MASK32)
                w += 1
                acc >>= _S32
                nbits -= 32


@njit(nogil=True)
def encode_chunk(x, e, has_res, ci, chunk, size, bits, params, words):
    """Chunk ci of one payload of ``size`` elements (x may end short: zeros): form c (kept in
    e), find its range, then write codes (through a scratch row when packing) and the new
    residual.  ``params``, ``words``: the payload's sections."""
    levels = (1 << bits) - 1
    s, t, src = chunk_source(x, e, has_res, ci, chunk, size)
    lo, hi = value_range(src)
    mn, scale, inv = minmax_params(lo, hi, levels)
    params[2 * ci] = mn
    params[2 * ci + 1] = scale
    if bits == 8:
        encode_codes(src, has_res, mn, scale, inv, levels, words.view(np.uint8)[s:t])
    else:
        scratch = np.empty(t - s, np.uint8)
        encode_codes(src, has_res, mn, scale, inv, levels, scratch)
        w0 = (s * bits) >> 5
        pack_codes(scratch, bits, words[w0:min(words.size, w0 + chunk * bits // 32)])


@cached_njit(nogil=True, parallel=True)
def encode_cpu(x, e, has_res, chunk, bits, params, words):
    """CPU twin: one chunk per parallel iteration."""
    for ci in prange((x.size + chunk - 1) // chunk):
        encode_chunk(x, e, has_res, ci, chunk, x.size, bits, params, words)


@njit(nogil=True, inline="always")
def encode_rows_item(x, e, has_res, part, chunk, bits, params, pcol, words, wcol, j):
    """Item j of the row form: chunk j % nc of partition j // nc (nc chunks a partition)."""
    nc = (part + chunk - 1) // chunk
    k = j // nc
    lo = k * part
    encode_chunk(x[lo:lo + part], e[lo:lo + part], has_res, j - k * nc, chunk, part, bits,
                 params[k, pcol:pcol + 2 * nc], words[k, wcol:wcol + (part * bits + 31) // 32])


@cached_njit(nogil=True, parallel=True)
def encode_rows_cpu(x, e, has_res, part, chunk, bits, params, pcol, words, wcol):
    """CPU twin of the row form: partition k of x (and e) into row k of the (rows, width)
    views ``params`` / ``words``, its sections at columns pcol / wcol; one (partition, chunk)
    pair per parallel iteration, each exactly ``encode_cpu``'s chunk (x may end short of the
    last partitions: zeros there)."""
    for j in prange(params.shape[0] * ((part + chunk - 1) // chunk)):
        encode_rows_item(x, e, has_res, part, chunk, bits, params, pcol, words, wcol, j)


@njit(nogil=True, inline="always")
def fold_span(words, w0, bits, mn, scale, out, add):
    """out (+)= x_hat of the codes packed from ``words[w0]`` on (width ``bits``, dividing 32),
    two words (64 / bits codes) at a time. Called with ``bits`` a literal, so the shifts and
    the trip count are constants the compiler vectorises; a runtime width and one word per
    step decoded at about half the speed (1, 2 and 4 bits alike)."""
    per = 64 // bits
    mask = _U64((1 << bits) - 1)
    for w in range((out.size + per - 1) // per):
        span = _U64(words[w0 + 2 * w])
        if per * w + per // 2 < out.size:  # the second word holds codes of this chunk
            span |= _U64(words[w0 + 2 * w + 1]) << _S32
        group = out[per * w:per * (w + 1)]
        if add:
            for j in range(group.size):
                code = (span >> _U64(j * bits)) & mask
                group[j] = group[j] + fma32(np.float32(code), scale, mn)
        else:
            for j in range(group.size):
                code = (span >> _U64(j * bits)) & mask
                group[j] = fma32(np.float32(code), scale, mn)


@njit(nogil=True)
def decode_row(codes8, words, bits, mn, scale, out, add, first):
    """out (+)= x_hat for one chunk (views) of one payload row; ``first`` is the
    chunk's first element index (the bit position of packed codes)."""
    if bits == 8:
        if add:
            for i in range(out.size):
                out[i] = out[i] + fma32(np.float32(codes8[i]), scale, mn)
        else:
            for i in range(out.size):
                out[i] = fma32(np.float32(codes8[i]), scale, mn)
    elif 32 % bits == 0:
        # widths 1, 2, 4: whole codes per word, read two words at a time (the general read
        # below takes a 64-bit window and a branch per element); one call per literal width
        w0 = (first * bits) >> 5  # chunks start on word boundaries
        if bits == 4:
            fold_span(words, w0, 4, mn, scale, out, add)
        elif bits == 2:
            fold_span(words, w0, 2, mn, scale, out, add)
        else:
            fold_span(words, w0, 1, mn, scale, out, add)
    else:
        for i in range(out.size):
            xh = fma32(np.float32(read_code(words, first + i, bits)), scale, mn)
            out[i] = out[i] + xh if add else xh


@njit(nogil=True, inline="always")
def decode_sum_item(params, pcol, words, wcol, bytes8, bcol, bits, chunk, out, accumulate, ci):
    """Chunk ci of the stack decoder: out (+)= the sum of its decodes, rows in order."""
    s = ci * chunk
    t = min(out.size, s + chunk)
    for p in range(params.shape[0]):
        decode_row(bytes8[p, bcol + s:bcol + t], words[p, wcol:], bits,
                   params[p, pcol + 2 * ci], params[p, pcol + 2 * ci + 1], out[s:t],
                   accumulate or p > 0, s)


@cached_njit(nogil=True, parallel=True)
def decode_cpu_kernel(params, pcol, words, wcol, bytes8, bcol, bits, chunk, out, accumulate):
    """out[i] (+)= sum over rows p of fma(code, scale, mn), rows in order."""
    for ci in prange((out.size + chunk - 1) // chunk):
        decode_sum_item(params, pcol, words, wcol, bytes8, bcol, bits, chunk, out, accumulate,
                        ci)


@njit(nogil=True, inline="always")
def decode_rows_item(params, pcol, words, wcol, bytes8, bcol, bits, chunk, part, out, j):
    """Item j of the row decoder: chunk j % nc of row j // nc into its partition of out."""
    nc = (part + chunk - 1) // chunk
    k = j // nc
    s = (j - k * nc) * chunk
    t = min(part, s + chunk)
    decode_row(bytes8[k, bcol + s:bcol + t], words[k, wcol:], bits,
               params[k, pcol + 2 * (j - k * nc)], params[k, pcol + 2 * (j - k * nc) + 1],
               out[k * part + s:k * part + t], False, s)


@cached_njit(nogil=True, parallel=True)
def decode_rows_cpu_kernel(params, pcol, words, wcol, bytes8, bcol, bits, chunk, part, out):
    """out[k * part + i] = fma(code, scale, mn) of element i of row k (each row on its own)."""
    for j in prange(params.shape[0] * ((part + chunk - 1) // chunk)):
        decode_rows_item(params, pcol, words, wcol, bytes8, bcol, bits, chunk, part, out, j)


def compress_minmax(x, bits=8, chunk=1024, residual=None, out=None, stream=None):
    """Min-max quantize x per chunk to ``bits`` (1..8); fused error feedback via ``residual``.

    Returns a Payload of ``MinMaxFormat(x.size, bits, chunk)``.  With
    ``residual`` (same dtype and size as x, updated in place) the payload
    encodes c = x + residual and residual becomes c - decompress(payload).
    Example: ``p = compress_minmax(g, bits=4, residual=e); decompress(p, out=g)``.
    Device launches: 1 (a warp per chunk finds its range and encodes it, block 0
    zeroing the padding); 3 when chunk > 4096 (segment ranges, chunk parameters,
    segment encoding); none for an empty tensor.
    """
    def on_device(xa, ea, fmt, v, buf, st):
        from ._cuda import minmax as kern
        kern.encode(xa, ea, fmt, v["params"], v["codes"], buf, st)

    def on_host(xa, c, has_res, fmt, v):
        encode_cpu(xa, c, has_res, fmt.chunk, fmt.bits, v["params"], v["codes"])

    return encode_payload(x, residual, out, stream, lambda n: MinMaxFormat(n, bits, chunk),
                          on_device, on_host)


def compress_minmax_rows(x, out, col=0, bits=8, chunk=1024, residual=None, stream=None):
    """``compress_minmax`` of each of the len(out) partitions of x, into the rows of out.

    ``out`` is a (rows, width) uint8 matrix; partition k (x[k*P:(k+1)*P], P = ceil(x.size /
    rows); x zero-padded to rows * P, without a copy: elements past its end read as zeros)
    is encoded into out[k, col:col + fmt.nbytes], byte for byte what ``compress_minmax`` of
    that partition (with residual[k*P:(k+1)*P]; the residual has rows * P elements) writes;
    ``col`` and width are multiples of ALIGN.  Returns fmt = ``MinMaxFormat(P, bits, chunk)``,
    the format of each row's payload.
    Device launches: 1 (a team of threads per chunk, several chunks a block, one row of blocks
    per partition); 3 when chunk > 4096 (as
    ``compress_minmax``, each over every partition at once); none for an empty tensor.
    """
    def on_device(xa, ea, fmt, v, mat, col, st):
        from ._cuda import minmax as kern
        kern.encode_rows(xa, ea, fmt, v, mat, col, st)

    def on_host(xa, c, has_res, fmt, v):
        params, pcol = v["params"]
        words, wcol = v["codes"]
        encode_rows_cpu(xa, c, has_res, fmt.n, fmt.chunk, fmt.bits, params, pcol, words, wcol)

    return encode_rows(x, residual, out, col, stream, lambda n: MinMaxFormat(n, bits, chunk),
                       on_device, on_host)


def decode_cpu(fmt, stack, col, out, accumulate):
    """Sum the payloads at byte column ``col`` of the rows of ``stack`` into out (see
    ``registry.Codec``)."""
    v = fmt.views2d(stack, col)
    params, pcol = v["params"]
    words, wcol = v["codes"]
    decode_cpu_kernel(params, pcol, words, wcol, stack, col + fmt.section("codes").offset,
                      fmt.bits, fmt.chunk, out, accumulate)


def decode_rows_cpu(fmt, matrix, col, out):
    """Row k of ``matrix`` (its payload at byte column ``col``) into out[k*n:(k+1)*n]."""
    v = fmt.views2d(matrix, col)
    params, pcol = v["params"]
    words, wcol = v["codes"]
    decode_rows_cpu_kernel(params, pcol, words, wcol, matrix, col + fmt.section("codes").offset,
                           fmt.bits, fmt.chunk, fmt.n, out)


def decode_device(fmt, stack, col, out, accumulate, factor, stream):
    """The CUDA twin of ``decode_cpu`` (see ``registry.Codec``).

    Device launches: 1 (every row decoded and summed in one pass over out).
    """
    from ._cuda import minmax as kern
    kern.decode(fmt, stack, col, out, accumulate, factor, stream)


def decode_rows_device(fmt, matrix, col, out, stream):
    """The CUDA twin of ``decode_rows_cpu`` (see ``registry.Codec``).

    Device launches: 1 (a grid of blocks over the partition by rows, each row into its own
    partition of out).
    """
    from ._cuda import minmax as kern
    kern.decode_rows(fmt, matrix, col, out, stream)


@cached_njit(nogil=True, parallel=True)
def _minmax_errors_kernel(x, chunk, bits, out):
    """out[ci, j] = sum over chunk ci of (x - x_hat)^2 at bits[j], as compress + decompress."""
    n = x.size
    for ci in prange((n + chunk - 1) // chunk):
        s = ci * chunk
        t = min(n, s + chunk)
        xs = x[s:t]
        lo, hi = value_range(xs)
        for j in range(bits.size):
            levels = (1 << bits[j]) - 1
            mn, scale, inv = minmax_params(lo, hi, levels)
            acc = 0.0
            for i in range(xs.size):
                v = np.float32(xs[i])
                d = v - fma32(quantize(v, mn, inv, levels), scale, mn)
                acc += np.float64(d) * np.float64(d)
            out[ci, j] = acc


def minmax_errors(x, bits, chunk=1024):
    """||x - Q^-1 Q_b(x)||^2 for every b in ``bits`` in one pass over host float32 ``x``.

    Equal to compressing at each width with ``compress_minmax`` (no residual), decoding, and
    summing the float32 differences squared in float64 (per chunk, chunks added in order), so
    L-GreCo's error table costs one read of each layer instead of a round trip per width.
    """
    xa = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    widths = np.asarray(list(bits), dtype=np.int64)
    if widths.size and (widths.min() < 1 or widths.max() > 8):
        raise KernelParameterError(f"bits must be in 1..8, got {list(bits)}")
    if chunk <= 0 or chunk % 32:
        raise KernelParameterError(f"chunk must be a positive multiple of 32, got {chunk}")
    per_chunk = np.zeros(((xa.size + chunk - 1) // chunk, widths.size), dtype=np.float64)
    if xa.size:
        _minmax_errors_kernel(xa, chunk, widths, per_chunk)
    return per_chunk.sum(axis=0)
