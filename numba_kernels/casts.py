"""fp16 and bf16 casts: float32 (or float64) -> 16-bit payload -> float32.

Both roundings are done on the bit patterns with integer arithmetic, so the
CPU twin and the CUDA kernel run literally the same code (the ``*_py`` functions
of ``_half_bits``, compiled for both targets) and agree bit for bit; widening
back is exact on both.

fp16 (IEEE binary16), from the float32 bits ``u`` with ``a = u & 0x7fffffff``:
  1. NaN -> quiet NaN keeping the top mantissa bits; ``a >= 0x477ff000``
     (|x| >= 65520, which rounds past 65504) -> infinity;
  2. normal range (|x| >= 2**-14): rebias the exponent and round the 13
     dropped mantissa bits to nearest, ties to even;
  3. subnormal range: shift the full significand right by ``126 - exponent``
     and round to nearest even; |x| <= 2**-25 becomes zero.
  Decoding rebiases the exponent and widens the mantissa (a subnormal,
  m * 2**-24, is computed as 2**-14 * (1 + m/1024) - 2**-14), which is exact.
bf16: the top 16 bits of the float32 after adding ``0x7fff + lsb`` (round to
nearest, ties to even); NaN -> quiet NaN.  float64 input is first rounded to
float32.  With error feedback, ``e <- c - decode(encode(c))`` in c's dtype.
"""
import numpy as np
from numba import njit, prange

from ._api import encode_payload
from ._disk_cache import cached_njit
from ._half_bits import bf16_from_f32bits, half_from_f32bits
from ._scalar import add_or_replace, bits_f32, f32_bits
from .errors import KernelTypeError, LayoutError
from .wire import CastFormat

U = np.uint32
_U13, _U16 = U(13), U(16)
_EXP_SHIFT = U(112 << 23)     # float32's exponent bias over binary16's, at the exponent's place
_HALF_EXP = U(0x1F << 23)     # binary16's exponent field, moved to float32's place
_EXP_ONE = U(1 << 23)         # one more in float32's exponent field
_TWO_M14 = U(113 << 23)       # the bits of 2**-14, binary16's smallest normal


@njit(nogil=True, inline="always")
def f32_from_half(h):
    """float32 value of the binary16 bits h (exact), with normal float32 operands only.

    The exponent and mantissa move to float32's places and the exponent is rebiased; an
    infinity or NaN gets float32's all-ones exponent (the NaN payload kept). A subnormal
    m * 2**-24 first becomes the normal 2**-14 * (1 + m / 1024), and 2**-14 is subtracted:
    exact, and no float32 subnormal is ever an operand, which on x86 would cost a microcode
    assist for every small gradient (the device kernel multiplies by 2**112 instead).
    """
    sign = (h & U(0x8000)) << _U16
    o = (h & U(0x7FFF)) << _U13
    e = o & _HALF_EXP
    o += _EXP_SHIFT
    if e == _HALF_EXP:
        o += _EXP_SHIFT
    elif e == U(0):
        o = f32_bits(bits_f32(o + _EXP_ONE) - bits_f32(_TWO_M14))
    return bits_f32(o | sign)


@njit(nogil=True, inline="always")
def _encode_one(x, e, i, has_res, bf16, half):
    """half[i] = cast(c_i), c_i = x[i] (+ e[i]); with has_res, e[i] = c_i - decoded."""
    c = x[i] + e[i] if has_res else x[i]
    u = f32_bits(np.float32(c))
    if bf16:
        h = bf16_from_f32bits(u)
        back = bits_f32(h << _U16)
    else:
        h = half_from_f32bits(u)
        back = f32_from_half(h)
    half[i] = np.uint16(h)
    if has_res:
        e[i] = c - back


@cached_njit(nogil=True, parallel=True)
def encode_cpu(x, e, has_res, bf16, half):
    """CPU twin: half[i] = cast(c_i); with has_res, e[i] = c_i - decoded.

    One loop for each case, its flags constants: without a residual ``e`` is ``x`` itself, and
    a loop that might store to ``e`` must check at run time that it does not overlap ``x``,
    then runs element by element where it does (fp16 without a residual took 34 ms for 1e7
    floats here against 11 ms with the store gone)."""
    if has_res and bf16:
        for i in prange(x.size):
            _encode_one(x, e, i, True, True, half)
    elif has_res:
        for i in prange(x.size):
            _encode_one(x, e, i, True, False, half)
    elif bf16:
        for i in prange(x.size):
            _encode_one(x, e, i, False, True, half)
    else:
        for i in prange(x.size):
            _encode_one(x, e, i, False, False, half)


# elements a decode folds every row into before it moves on: out's block stays in the
# first-level cache while the rows pass (one pass over out, not one a row)
_DECODE_BLOCK = 4096


@njit(nogil=True, inline="always")
def _decode_row(row, bf16, out, add):
    """out (+)= decode(row), element by element (a loop the compiler vectorises)."""
    for i in range(out.size):
        h = U(row[i])
        out[i] = add_or_replace(out[i], bits_f32(h << _U16) if bf16 else f32_from_half(h), add)


@cached_njit(nogil=True, parallel=True)
def decode_cpu_kernel(halves, col, bf16, out, accumulate):
    """out[i] (+)= sum over rows p of decode(halves[p, col + i]), rows in order."""
    for b in prange((out.size + _DECODE_BLOCK - 1) // _DECODE_BLOCK):
        s = b * _DECODE_BLOCK
        t = min(out.size, s + _DECODE_BLOCK)
        for p in range(halves.shape[0]):
            _decode_row(halves[p, col + s:col + t], bf16, out[s:t], accumulate or p > 0)


def compress_cast(x, kind="fp16", residual=None, out=None, stream=None):
    """Cast x to fp16 or bf16 (``kind``) into a CastFormat payload.

    Example: ``p = compress_cast(grad, "bf16"); decompress(p, out=grad)``.
    Device launches: 1 (cast, update the residual and zero the padding in one
    kernel); none for an empty tensor.
    """
    bf16 = kind == "bf16"

    def on_device(xa, ea, fmt, v, buf, st):
        from ._cuda import casts as kern
        kern.encode(xa, ea, bf16, v["half"], buf, fmt, st)

    def on_host(xa, c, has_res, fmt, v):
        encode_cpu(xa, c, has_res, bf16, v["half"])

    return encode_payload(x, residual, out, stream, lambda n: CastFormat(n, kind),
                          on_device, on_host)


def decode_cpu(fmt, stack, col, out, accumulate):
    """Sum the payloads at byte column ``col`` of the rows of ``stack`` into out (see
    ``registry.Codec``)."""
    halves, hcol = fmt.views2d(stack, col)["half"]
    decode_cpu_kernel(halves, hcol, fmt.kind == "bf16", out, accumulate)


def decode_device(fmt, stack, col, out, accumulate, factor, stream):
    """The CUDA twin of ``decode_cpu`` (see ``registry.Codec``).

    Device launches: 1 (every row decoded and summed in one pass over out).
    """
    from ._cuda import casts as kern
    kern.decode(fmt, stack, col, out, accumulate, factor, stream)


# -- raw 16-bit words on the host (no payload framing) ----------------------------------------
# For exchanges that lay several casts out back to back in one MPI buffer (the cast
# scatter-reduce of bagua_mpi's 16-bit wire), where each piece cannot carry a payload's
# alignment padding. (Encoding there is torch's: its hardware conversion, 4 ms for 21M floats
# here against 85 ms for encode_cpu's portable bit arithmetic, rounds alike.)

def _check_host(name, arr, dtypes):
    if not isinstance(arr, np.ndarray) or arr.ndim not in (1, 2) or \
            not arr.flags.c_contiguous or arr.dtype not in dtypes:
        raise KernelTypeError(f"{name} must be a C-contiguous host array of "
                              f"{'/'.join(str(d) for d in dtypes)}, got "
                              f"{getattr(arr, 'dtype', type(arr).__name__)} of shape "
                              f"{getattr(arr, 'shape', None)}")


def sum_halves(rows, out, kind="fp16"):
    """out[i] = sum over rows p of decode(rows[p, i]), rows added in order, on the host.

    ``rows``: (P, n) uint16 array of fp16/bf16 bits; ``out``: 1-D float32/float64 array of
    n (exact decoding, sums in ``out``'s dtype, as every decode here and on the device)."""
    _check_host("rows", rows, (np.dtype(np.uint16),))
    _check_host("out", out, (np.dtype(np.float32), np.dtype(np.float64)))
    rows = rows.reshape(-1, out.size) if rows.ndim == 1 else rows
    if rows.shape[1] != out.size:
        raise LayoutError(f"rows of {rows.shape[1]} values for an output of {out.size}")
    decode_cpu_kernel(rows, 0, kind == "bf16", out, False)
    return out
