"""The codecs: for each payload format, the public functions that make and read it.

``dispatch`` picks a format's decoder here, and the tests enumerate the
formats from here, so adding a format means one entry below (and its class in
``wire.FORMATS``).  Each ``decode_device`` reaches its CUDA twin the way every
host function does (see ``numba_kernels._cuda``): a function-level
``from ._cuda import <name>``, so this table imports no numba.cuda.

Every compressor and ``decode_device`` documents its CUDA kernel launches in a
``Device launches: N ...`` line of its docstring (N for the plain call; what
changes it follows); ``numba_kernels.launch_count()`` counts them.
"""
from dataclasses import dataclass
from typing import Callable, Tuple

from . import casts, minmax, onebit, qsgd, topk
from .errors import PayloadError
from .wire import CastFormat, MinMaxFormat, OneBitFormat, QSGDFormat, TopKFormat


@dataclass(frozen=True)
class Codec:
    """One payload format's code.

    ``compressors``: the public functions whose payloads have this format;
    ``decode_host(fmt, stack, out, accumulate)`` and
    ``decode_device(fmt, stack, out, accumulate, stream)`` sum a (P, nbytes)
    stack of payloads into ``out`` (add to it with ``accumulate``).
    """
    format: type
    compressors: Tuple[Callable, ...]
    decode_host: Callable
    decode_device: Callable


CODECS = (
    Codec(CastFormat, (casts.compress_cast,), casts.decode_cpu, casts.decode_device),
    Codec(MinMaxFormat, (minmax.compress_minmax,), minmax.decode_cpu, minmax.decode_device),
    Codec(QSGDFormat, (qsgd.compress_qsgd,), qsgd.decode_cpu, qsgd.decode_device),
    Codec(OneBitFormat, (onebit.compress_onebit,), onebit.decode_cpu, onebit.decode_device),
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
