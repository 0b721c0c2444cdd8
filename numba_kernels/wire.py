"""Payload layouts: every compressed tensor is ONE flat, contiguous uint8 buffer.

A format object (a frozen dataclass) knows everything needed to allocate,
split and decode a payload from ``(n, params)`` alone, so a receiver can size
its buffer before the data arrives.  All multi-byte fields are little-endian
(every supported CPU and every CUDA GPU is).  Sections start at offsets that
are multiples of their element size; the total size is rounded up to a
multiple of ``ALIGN`` = 8 bytes so that payloads concatenated by an all-gather
stay aligned.  Bytes past the last meaningful byte (``used_nbytes``) are zero.

Byte layouts (``nc`` = ceil(n / chunk), ``ceil8`` = round up to 8):

====================  ============================================================
format                sections, in order
====================  ============================================================
CastFormat            ``half``: n x uint16 (IEEE binary16, or bfloat16 = top half
                      of a float32)                        total ceil8(2n)
MinMaxFormat          ``params``: nc x (min, scale) float32 pairs, at 0;
                      ``codes``: ceil(n*bits/32) uint32 words at 8*nc; code i
                      sits in bits [i*bits, (i+1)*bits) of the little-endian bit
                      stream (for bits=8: byte i)      total ceil8(8nc + 4*words)
QSGDFormat            ``norms``: nc float32 at 0; ``codes``: n int8 at 4*nc,
                      code = sign * level, |level| <= levels  total ceil8(4nc + n)
OneBitFormat          ``scales``: nc float32 at 0; ``signs``: ceil(n/32) uint32
                      words at 4*nc; bit i%32 of word i//32 is 1 iff x_i < 0
                                                      total ceil8(4nc + 4*words)
TopKFormat            ``indices``: k int32 or int64, ascending, at 0;
                      ``values``: k float32 at k*itemsize   total ceil8(k*(isz+4))
====================  ============================================================

Decoding (x_hat) is part of the format, computed in float32:
min-max ``fma(code, scale, min)``; QSGD ``code * (norm / levels)``; 1-bit
``-scale if bit else +scale``; top-k ``values`` scattered at ``indices``, zero
elsewhere; casts are exact.
"""
from dataclasses import dataclass

import numpy as np

from ._device import is_device
from .errors import KernelParameterError, PayloadError

ALIGN = 8


def _ceil_div(a, b):
    return -(-a // b)


def _round_up(a, b):
    return _ceil_div(a, b) * b


@dataclass(frozen=True)
class Section:
    """A typed field of a payload: ``count`` items of ``dtype`` at byte ``offset``."""
    name: str
    offset: int
    dtype: np.dtype
    count: int

    @property
    def nbytes(self):
        return self.count * np.dtype(self.dtype).itemsize


class _Format:
    """Shared behaviour of the formats: sizes and views of a buffer.

    A format is immutable, so its layout is worked out once per instance: the primitives ask
    for sections, sizes and views several times per call on every step, and on a GPU that
    host time adds to every bucket's."""

    def _layout(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def sections(self):
        """The payload's sections, in order (computed on first use, then kept)."""
        kept = self.__dict__.get("_sections")
        if kept is None:
            kept = self._layout()
            object.__setattr__(self, "_sections", kept)  # not a field: eq and hash ignore it
        return kept

    @property
    def used_nbytes(self):  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def nbytes(self):
        """Size of the whole payload in bytes (a multiple of ALIGN)."""
        kept = self.__dict__.get("_nbytes")
        if kept is None:
            last = self.sections()[-1]
            kept = _round_up(last.offset + last.nbytes, ALIGN)
            object.__setattr__(self, "_nbytes", kept)
        return kept

    @property
    def ratio(self):
        """Compression ratio against the float32 tensor (4n bytes)."""
        return 4.0 * self.n / self.nbytes if self.nbytes else float("nan")

    def section(self, name):
        for sec in self.sections():
            if sec.name == name:
                return sec
        raise KeyError(name)

    def views(self, buffer):
        """Typed 1-D views of each section of one payload buffer (host or device)."""
        return {s.name: buffer[s.offset:s.offset + s.nbytes].view(s.dtype) for s in self.sections()}

    def views2d(self, buffers, col=0):
        """For a (P, nbytes) stack of payloads: name -> (typed 2-D view, first column).

        Each view covers whole rows reinterpreted as the section's dtype; the
        section starts at that column in every row.  ``col``: the payloads sit
        at that byte column of wider rows (a (P, width) payload matrix; col and
        width multiples of ALIGN).
        """
        out = {}
        for s in self.sections():
            size = np.dtype(s.dtype).itemsize
            out[s.name] = (buffers.view(s.dtype), (col + s.offset) // size)
        return out


_INT32_MAX = int(np.iinfo(np.int32).max)


def _check_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise KernelParameterError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise KernelParameterError(f"{name} must be {bounds}, got {value}")
    return int(value)


def _check_chunk(chunk, multiple):
    chunk = _check_int("chunk", chunk, multiple)
    if chunk % multiple:
        raise KernelParameterError(f"chunk must be a multiple of {multiple} (codes of one chunk "
                                   f"fill whole 32-bit words), got {chunk}")
    return chunk


@dataclass(frozen=True)
class CastFormat(_Format):
    """n values as 16-bit floats; ``kind`` is 'fp16' or 'bf16'."""
    n: int
    kind: str = "fp16"

    def __post_init__(self):
        object.__setattr__(self, "n", _check_int("n", self.n, 0))
        if self.kind not in ("fp16", "bf16"):
            raise KernelParameterError(f"kind must be 'fp16' or 'bf16', got {self.kind!r}")

    def _layout(self):
        return (Section("half", 0, np.dtype(np.uint16), self.n),)

    @property
    def used_nbytes(self):
        return 2 * self.n


@dataclass(frozen=True)
class MinMaxFormat(_Format):
    """Per-chunk min-max quantization to ``bits`` in 1..8, densely packed."""
    n: int
    bits: int = 8
    chunk: int = 1024

    def __post_init__(self):
        object.__setattr__(self, "n", _check_int("n", self.n, 0))
        object.__setattr__(self, "bits", _check_int("bits", self.bits, 1, 8))
        object.__setattr__(self, "chunk", _check_chunk(self.chunk, 32))

    @property
    def nchunks(self):
        return _ceil_div(self.n, self.chunk)

    @property
    def nwords(self):
        return _ceil_div(self.n * self.bits, 32)

    def _layout(self):
        nc = self.nchunks
        return (Section("params", 0, np.dtype(np.float32), 2 * nc),
                Section("codes", 8 * nc, np.dtype(np.uint32), self.nwords))

    @property
    def used_nbytes(self):
        return 8 * self.nchunks + _ceil_div(self.n * self.bits, 8)


@dataclass(frozen=True)
class QSGDFormat(_Format):
    """QSGD with ``levels`` (s) in 1..127 per sign, norm per chunk, int8 codes."""
    n: int
    levels: int = 127
    chunk: int = 1024

    def __post_init__(self):
        object.__setattr__(self, "n", _check_int("n", self.n, 0))
        object.__setattr__(self, "levels", _check_int("levels", self.levels, 1, 127))
        object.__setattr__(self, "chunk", _check_int("chunk", self.chunk, 1))
        if self.nchunks > _INT32_MAX:   # the device decoders index chunks in int32
            raise KernelParameterError(
                f"QSGD of n = {self.n} in chunks of {self.chunk} makes {self.nchunks} chunks, "
                f"more than {_INT32_MAX}; use a chunk of at least {_ceil_div(self.n, _INT32_MAX)}")

    @property
    def nchunks(self):
        return _ceil_div(self.n, self.chunk)

    def _layout(self):
        nc = self.nchunks
        return (Section("norms", 0, np.dtype(np.float32), nc),
                Section("codes", 4 * nc, np.dtype(np.int8), self.n))

    @property
    def used_nbytes(self):
        return 4 * self.nchunks + self.n


@dataclass(frozen=True)
class OneBitFormat(_Format):
    """Signs packed 32 per uint32 word plus one float32 scale per chunk."""
    n: int
    chunk: int = 4096

    def __post_init__(self):
        object.__setattr__(self, "n", _check_int("n", self.n, 0))
        object.__setattr__(self, "chunk", _check_chunk(self.chunk, 32))

    @property
    def nchunks(self):
        return _ceil_div(self.n, self.chunk)

    @property
    def nwords(self):
        return _ceil_div(self.n, 32)

    def _layout(self):
        nc = self.nchunks
        return (Section("scales", 0, np.dtype(np.float32), nc),
                Section("signs", 4 * nc, np.dtype(np.uint32), self.nwords))

    @property
    def used_nbytes(self):
        return 4 * self.nchunks + _ceil_div(self.n, 8)


@dataclass(frozen=True)
class TopKFormat(_Format):
    """k (index, value) pairs of an n-element tensor, indices ascending."""
    n: int
    k: int
    index_dtype: str = "int32"

    def __post_init__(self):
        object.__setattr__(self, "n", _check_int("n", self.n, 0))
        object.__setattr__(self, "k", _check_int("k", self.k, 0, self.n))
        if self.index_dtype not in ("int32", "int64"):
            raise KernelParameterError(f"index_dtype must be 'int32' or 'int64', "
                                       f"got {self.index_dtype!r}")
        if self.index_dtype == "int32" and self.n > _INT32_MAX:
            raise KernelParameterError(f"n = {self.n} does not fit int32 indices; "
                                       "use index_dtype='int64'")

    @property
    def itemsize(self):
        return np.dtype(self.index_dtype).itemsize

    def _layout(self):
        return (Section("indices", 0, np.dtype(self.index_dtype), self.k),
                Section("values", self.k * self.itemsize, np.dtype(np.float32), self.k))

    @property
    def used_nbytes(self):
        return self.k * (self.itemsize + 4)


FORMATS = (CastFormat, MinMaxFormat, QSGDFormat, OneBitFormat, TopKFormat)


@dataclass(frozen=True)
class Payload:
    """A compressed tensor: its format and its flat uint8 buffer (host or device)."""
    format: _Format
    buffer: object

    def __post_init__(self):
        if not isinstance(self.format, FORMATS):
            raise PayloadError(f"format must be one of {[f.__name__ for f in FORMATS]}, "
                               f"got {type(self.format).__name__}")
        check_buffer(self.buffer, self.format.nbytes, "payload buffer")

    @property
    def on_device(self):
        return is_device(self.buffer)

    @property
    def nbytes(self):
        return self.format.nbytes

    def views(self):
        return self.format.views(self.buffer)


def check_buffer(buffer, nbytes, name, rows=None):
    """Raise PayloadError unless ``buffer`` is contiguous uint8 of the expected shape."""
    shape = (nbytes,) if rows is None else (rows, nbytes)
    dtype = getattr(buffer, "dtype", None)
    if dtype is None or np.dtype(dtype) != np.uint8 or tuple(getattr(buffer, "shape", ())) != shape:
        raise PayloadError(f"{name} must be a uint8 array of shape {shape}, got "
                           f"{getattr(buffer, 'dtype', type(buffer).__name__)} of shape "
                           f"{tuple(getattr(buffer, 'shape', ()))}")
    # Numba device arrays answer is_c_contiguous(); their ``flags`` is a plain dict.
    contiguous = (buffer.is_c_contiguous() if hasattr(buffer, "is_c_contiguous")
                  else buffer.flags.c_contiguous)
    if nbytes and not contiguous:
        raise PayloadError(f"{name} must be C-contiguous")
    if nbytes:
        check_aligned(buffer, name)


def data_address(array):
    """The address of ``array``'s first byte, on the host or a device (torch tensors, NumPy
    arrays, CUDA arrays); None where the object does not tell."""
    data_ptr = getattr(array, "data_ptr", None)
    if callable(data_ptr):   # torch: cheaper than its interface dicts, and no grad check
        return data_ptr()
    for interface in ("__cuda_array_interface__", "__array_interface__"):
        info = getattr(array, interface, None)
        if info is not None:
            return info["data"][0]
    return None


def check_aligned(buffer, name):
    """Raise PayloadError unless ``buffer`` starts at a multiple of ALIGN bytes.

    A payload's sections are read as float32 and 32- and 64-bit words at offsets that are
    multiples of their size from the buffer's start. A host array may start anywhere (NumPy
    reads unaligned words), but a GPU stops the process's CUDA context at a misaligned load,
    so both refuse what only one could run: a program tried on CPUs then fails no differently
    on a GPU. A new allocation is aligned; a slice at a byte offset may not be."""
    address = data_address(buffer)
    if address is not None and address % ALIGN:
        raise PayloadError(f"{name} starts at address {address:#x}, {address % ALIGN} bytes past "
                           f"a multiple of {ALIGN}: payload sections are read as 32- and 64-bit "
                           f"words, which a GPU cannot load there; pass a buffer that starts at "
                           f"a multiple of {ALIGN} bytes (a new allocation does)")
