"""Decompression for every format, on the host or the device.

``decompress`` decodes one payload; ``decompress_many`` decodes a stack of
payloads of one format (an all-gather's receive buffer, or payloads at one
byte column of wider rows, read in place) and sums them into one output in
row order, in a single pass over the output for the dense formats;
``decompress_rows`` decodes each row of a payload matrix into its own
partition of the output (the formats with a row form), in one pass.  The
format object picks the codec (``registry``); where the buffer lives picks the
CPU twin or the CUDA kernel.
"""

import numpy as np

from ._api import check_column, decode_target, payload_matrix, payload_rows
from ._device import stream_of
from .errors import KernelParameterError, PayloadError
from .registry import codec_for
from .wire import Payload


def decompress_many(buffers, format, out=None, accumulate=False, stream=None, col=0, factor=1.0):
    """out (+)= decode(row 0) + decode(row 1) + ... for a (P, nbytes) stack of payloads.

    ``buffers`` may also be flat (P * nbytes bytes).  With ``col`` (or rows wider
    than nbytes), ``buffers`` is a (P, width) payload matrix whose row p holds
    payload p at byte columns [col, col + nbytes), checked as ``decompress_rows``
    checks its matrix and column (P >= 1, C-contiguous, col and width multiples
    of ALIGN): the payloads are read where they sit (an alltoall's message rows,
    several segments side by side), no copy, with the bytes of decoding the
    (P, nbytes) stack of those columns.
    Without ``accumulate`` the output is overwritten (a new float32 array when
    ``out`` is None).  Rows are added in order, so the result is deterministic.
    ``factor`` (not with ``accumulate``): out = factor x the sum, one rounded
    float32 multiply after it, the bytes of scaling the decoded sum in a pass of
    its own; the dense formats' decoders apply it as they store, at no launch.
    Returns out.
    Device launches: those of the format's ``decode_device`` (see ``registry``);
    1 to zero ``out`` for a stack of no rows, none for an empty tensor.
    """
    if factor != 1.0 and accumulate:
        raise KernelParameterError(f"factor={factor} scales a sum that replaces out; it does "
                                   "not combine with accumulate=True")
    stack, col, dev = payload_rows(buffers, format, col)
    st = stream_of(stream) if dev else 0
    target = decode_target(out, format.n, dev, st, accumulate)
    if format.n == 0:
        return target if out is None else out
    codec = codec_for(format)
    if stack.shape[0] == 0 and not accumulate:
        if dev:
            from ._cuda.common import fill
            fill(target, 0, st)
        else:
            target[:] = 0
    elif stack.shape[0]:
        if dev:
            codec.decode_device(format, stack, col, target, accumulate, factor, st)
        else:
            codec.decode_host(format, stack, col, target, accumulate)
            if factor != 1.0:
                target *= np.float32(factor)
    return target if out is None else out


def decompress(payload, out=None, accumulate=False, stream=None):
    """Decode one Payload into ``out`` (overwrite, or add with ``accumulate``)."""
    if not isinstance(payload, Payload):
        raise PayloadError(f"expected a Payload, got {type(payload).__name__}; wrap a raw "
                           "buffer with Payload(format, buffer)")
    return decompress_many(payload.buffer.reshape(1, payload.nbytes), payload.format,
                           out=out, accumulate=accumulate, stream=stream)


def decompress_rows(matrix, format, out=None, col=0, stream=None):
    """out[k * n:(k + 1) * n] = decode(row k) for every row of a (rows, width) payload matrix.

    Each row holds a payload of ``format`` (n = format.n elements) at byte column ``col``
    (a multiple of ALIGN, as the width); rows are decoded each on its own, not summed: the
    bytes of ``decompress`` of each row into its slice of out (a new float32 array of
    rows * n when None).  ``out`` may end short of rows * n by fewer than ``rows`` elements
    (a tensor of a length the rows do not divide, which the row-form compressors take
    without its zero padding): the decode stops at its end.
    Formats with a row form only (min-max, QSGD, 1-bit).  Returns out.
    Device launches: those of the format's ``decode_rows_device`` (see ``registry``); none
    for an empty tensor.
    """
    mat, dev = payload_matrix(matrix, "matrix")
    col = check_column(col, format, mat.shape[1], "matrix")
    st = stream_of(stream) if dev else 0
    rows = mat.shape[0]
    target = decode_target(out, rows * format.n, dev, st, False,
                           short_by=rows - 1 if format.n else 0)
    codec = codec_for(format)
    if codec.decode_rows_host is None:
        raise PayloadError(f"{type(format).__name__} has no row form; decode each payload "
                           "with decompress")
    if format.n:
        if dev:
            codec.decode_rows_device(format, mat, col, target, st)
        else:
            codec.decode_rows_host(format, mat, col, target)
    return target if out is None else out
