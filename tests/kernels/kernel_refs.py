"""Plain NumPy references for the compression kernels (no Numba).

Each reference follows the documented algorithm and byte layout
independently of the kernels: vectorised NumPy, ``np.packbits`` for the bit
streams, float64 arithmetic rounded once to float32 where the kernels use an
FMA (a product of two float32 values is exact in float64).
"""
import numpy as np

SIZES = [0, 1, 31, 32, 33, 1023, 1024, 1025, 10**6]
DTYPES = [np.float32, np.float64]
MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def ceil_div(a, b):
    return -(-a // b)


def pad8(buf):
    """Append zero bytes up to a multiple of 8 (the payload alignment)."""
    return np.concatenate([buf, np.zeros((-buf.size) % 8, np.uint8)])


def chunks(n, chunk):
    return [(s, min(n, s + chunk)) for s in range(0, n, chunk)]


def pack_codes(codes, bits):
    """LSB-first bit stream of ``bits``-wide codes, padded to whole 32-bit words."""
    n = codes.size
    planes = ((codes.astype(np.uint32)[:, None] >> np.arange(bits, dtype=np.uint32)) & 1)
    stream = np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little")
    return np.concatenate([stream, np.zeros(4 * ceil_div(n * bits, 32) - stream.size, np.uint8)])


def unpack_codes(stream, n, bits):
    planes = np.unpackbits(stream, bitorder="little")[: n * bits].reshape(n, bits)
    return (planes.astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(axis=1)


# ---- casts -----------------------------------------------------------------

def fp16_bits(x):
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(np.float16).view(np.uint16)


def bf16_bits(x):
    """Round float32 to bfloat16, nearest even, from first principles in float64."""
    x32 = x.astype(np.float32)
    u = x32.view(np.uint32).astype(np.uint64)
    lo_bits = u >> np.uint64(16)
    with np.errstate(invalid="ignore"):
        mag = np.abs(x32.astype(np.float64))
        lo_f32 = (lo_bits << np.uint64(16)).astype(np.uint32).view(np.float32)
        lo = np.abs(lo_f32.astype(np.float64))
    exp = ((u >> np.uint64(23)) & np.uint64(0xFF)).astype(np.int64)
    ulp = np.ldexp(1.0, np.maximum(exp, 1) - 127 - 7)
    with np.errstate(invalid="ignore"):
        rest = mag - lo
    up = (rest > ulp / 2) | ((rest == ulp / 2) & ((lo_bits & np.uint64(1)) == 1))
    out = (lo_bits + up.astype(np.uint64)).astype(np.uint16)
    nan = np.isnan(x32)
    out[nan] = (lo_bits[nan].astype(np.uint16) | np.uint16(0x40))
    return out


# ---- min-max ---------------------------------------------------------------

# the one NaN a min-max payload stores for a NaN minimum or scale
NAN32 = np.array([0x7FC00000], np.uint32).view(np.float32)[0]


def minmax_payload(c, bits, chunk):
    """(payload bytes, per-chunk scale per element) of min-max quantization.

    Non-finite values, written out as rules (NumPy's own NaN arithmetic and NaN-to-integer
    casts are not the kernels'): a chunk holding a NaN stores (NAN32, NAN32) and codes 0; a
    NaN scale (a chunk of infinities of one sign) is stored as NAN32; a NaN level (an
    infinity times inv 0) is code 0."""
    v = c.astype(np.float32)
    levels = (1 << bits) - 1
    params, codes, scale_of = [], np.zeros(v.size, np.uint32), np.zeros(v.size, np.float32)
    for s, t in chunks(v.size, chunk):
        if np.isnan(v[s:t]).any():
            params += [NAN32, NAN32]
            scale_of[s:t] = np.nan
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            mn, mx = v[s:t].min() + np.float32(0), v[s:t].max() + np.float32(0)
            scale = np.float32((mx - mn) / np.float32(levels))
            inv = np.float32(1) / scale if scale > 0 else np.float32(0)
            d = (v[s:t] - mn).astype(np.float64)
            t32 = (d * np.float64(inv) + 0.5).astype(np.float32)
        t32[np.isnan(t32)] = 0
        codes[s:t] = np.clip(np.floor(t32), 0, levels)
        params += [mn, NAN32 if np.isnan(scale) else scale]
        scale_of[s:t] = scale
    head = np.array(params, np.float32).view(np.uint8)
    return pad8(np.concatenate([head, pack_codes(codes, bits)])), scale_of


def minmax_decode(payload, n, bits, chunk):
    nc = ceil_div(n, chunk)
    params = payload[: 8 * nc].view(np.float32).reshape(nc, 2).astype(np.float64)
    codes = unpack_codes(payload[8 * nc:], n, bits).astype(np.float64)
    ci = np.arange(n) // chunk
    with np.errstate(invalid="ignore"):     # 0 x an infinite scale: NaN, as the kernels'
        return (codes * params[ci, 1] + params[ci, 0]).astype(np.float32)


# ---- QSGD ------------------------------------------------------------------

def rng_key(seed):
    z = (int(seed) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return np.uint64(z ^ (z >> 31))


def mix_stream(key, idx):
    """SplitMix64 finaliser of key + (i + 1) * golden for each i (NumPy arrays wrap silently)."""
    z = key + (idx.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniform24(seed, idx):
    top24 = mix_stream(rng_key(seed), idx) >> np.uint64(40)
    return top24.astype(np.float32) * np.float32(2.0 ** -24)


def qsgd_codes(c, norms, levels, chunk, seed):
    """Codes of QSGD given the per-chunk norms (the norms are checked separately)."""
    v = c.astype(np.float32)
    norm = np.repeat(norms, chunk)[: v.size]
    with np.errstate(divide="ignore"):
        ratio = np.where(norm > 0, np.float32(levels) / norm, np.float32(0)).astype(np.float32)
    r = (np.abs(v).astype(np.float64) * ratio).astype(np.float32)
    lo = np.floor(r)
    level = lo + (uniform24(seed, np.arange(v.size)) < (r - lo))
    level = np.minimum(level, levels)
    return np.where(v < 0, -level, level).astype(np.int8)


def chunk_norms(c, chunk):
    v = c.astype(np.float32).astype(np.float64)
    return np.array([np.sqrt(np.sum(v[s:t] ** 2)) for s, t in chunks(v.size, chunk)])


# ---- 1-bit -----------------------------------------------------------------

def onebit_signs(c):
    neg = (c.astype(np.float32) < 0).astype(np.uint8)
    stream = np.packbits(neg, bitorder="little")
    return np.concatenate([stream, np.zeros(4 * ceil_div(c.size, 32) - stream.size, np.uint8)])


def onebit_scales(c, chunk, kind):
    v = c.astype(np.float32).astype(np.float64)
    out = []
    for s, t in chunks(v.size, chunk):
        seg = v[s:t]
        out.append(np.sqrt(np.mean(seg ** 2)) if kind == "l2" else np.mean(np.abs(seg)))
    return np.array(out)


# ---- top-k -----------------------------------------------------------------

def topk_indices(c, k):
    """The k largest float32 magnitudes, ties to the lower index, ascending indices."""
    key = np.abs(c.astype(np.float32)).view(np.uint32).astype(np.int64)
    order = np.lexsort((np.arange(c.size), -key))[:k]
    return np.sort(order)


def randk_indices(n, k, seed):
    """Stratified random-k: stratum j = [j n // k, (j + 1) n // k) keeps lo + (h * size >> 32)."""
    j = np.arange(k, dtype=np.int64)
    lo, hi = j * n // k, (j + 1) * n // k
    h = mix_stream(rng_key(seed), j) >> np.uint64(32)
    return lo + ((h * (hi - lo).astype(np.uint64)) >> np.uint64(32)).astype(np.int64)
