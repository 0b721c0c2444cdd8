"""The codecs: for each payload format, the public functions that make and read it.

``dispatch`` picks a format's decoder here, and the tests enumerate the
formats from here, so adding a format means one entry below (and its class in
``wire.FORMATS``).  Each ``decode_device`` reaches its CUDA twin the way every
host function does (see ``numba_kernels._cuda``): a function-level
``from ._cuda import <name>``, so this table imports no numba.cuda.

The dense chunked formats (min-max, QSGD, 1-bit) also have a row form, which a
scatter-reduce uses: ``compress_rows`` encodes the n partitions of a tensor
(zero-padded to n equal ones without a copy: elements past its end read as
zeros) into the n rows of a payload matrix, and ``decode_rows_*`` decode each
row of such a matrix into its own partition (the last ones cut at the tensor's
end), each in one launch.

Every compressor, ``decode_device`` and ``decode_rows_device`` documents its
CUDA kernel launches in a ``Device launches: N ...`` line of its docstring (N
for the plain call; what changes it follows); ``numba_kernels.launch_count()``
counts them.
"""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from . import casts, minmax, onebit, qsgd, topk
from .errors import PayloadError
from .wire import CastFormat, MinMaxFormat, OneBitFormat, QSGDFormat, TopKFormat


@dataclass(frozen=True)
class Codec:
    """One payload format's code.

    ``compressors``: the public functions whose payloads have this format;
    ``decode_host(fmt, stack, col, out, accumulate)`` and
    ``decode_device(fmt, stack, col, out, accumulate, factor, stream)`` sum the P
    payloads of a (P, width) stack, each at byte column ``col`` of its row (0
    and width = fmt.nbytes for a plain stack), into ``out`` (add to it with
    ``accumulate``), reading them in place; the device decoder also multiplies
    the result by the float32 ``factor`` (the host's is scaled by
    ``dispatch.decompress_many`` afterwards, with the same bytes).
    Row forms (None for a format without them): ``compress_rows``, and
    ``decode_rows_host(fmt, matrix, col, out)`` / ``decode_rows_device(fmt,
    matrix, col, out, stream)``, which decode row k of a (rows, width) matrix
    (the payload at byte column ``col``) into out[k * fmt.n:(k + 1) * fmt.n].
    """
    format: type
    compressors: Tuple[Callable, ...]
    decode_host: Callable
    decode_device: Callable
    compress_rows: Optional[Callable] = None
    decode_rows_host: Optional[Callable] = None
    decode_rows_device: Optional[Callable] = None


CODECS = (
    Codec(CastFormat, (casts.compress_cast,), casts.decode_cpu, casts.decode_device),
    Codec(MinMaxFormat, (minmax.compress_minmax,), minmax.decode_cpu, minmax.decode_device,
          minmax.compress_minmax_rows, minmax.decode_rows_cpu, minmax.decode_rows_device),
    Codec(QSGDFormat, (qsgd.compress_qsgd,), qsgd.decode_cpu, qsgd.decode_device,
          qsgd.compress_qsgd_rows, qsgd.decode_rows_cpu, qsgd.decode_rows_device),
    Codec(OneBitFormat, (onebit.compress_onebit,), onebit.decode_cpu, onebit.decode_device,
          onebit.compress_onebit_rows, onebit.decode_rows_cpu, onebit.decode_rows_device),
    Codec(TopKFormat, (topk.compress_topk, topk.compress_randk), topk.decode_cpu,
          topk.decode_device),
)
_BY_FORMAT = {codec.format: codec for codec in CODECS}


def codec_for(fmt):
    """The Codec of the format object ``fmt``."""
    codec = _BY_FORMAT.get(type(fmt))
    if codec is None:
        raise PayloadError(f"no codec for format {type(fmt).__name__}")
    return codec
