"""Decompression for every format, on the host or the device.

``decompress`` decodes one payload; ``decompress_many`` decodes a stack of
payloads of one format (an all-gather's receive buffer) and sums them into
one output in row order, in a single pass over the output for the dense
formats.  The format object picks the codec (``registry``); where the buffer
lives picks the CPU twin or the CUDA kernel.
"""
from ._api import decode_target, payload_stack
from ._device import stream_of
from .errors import PayloadError
from .registry import codec_for
from .wire import Payload


def decompress_many(buffers, format, out=None, accumulate=False, stream=None):
    """out (+)= decode(row 0) + decode(row 1) + ... for a (P, nbytes) stack of payloads.

    ``buffers`` may also be flat (P * nbytes bytes).  Without ``accumulate``
    the output is overwritten (a new float32 array when ``out`` is None).
    Rows are added in order, so the result is deterministic.  Returns out.
    Device launches: those of the format's ``decode_device`` (see ``registry``);
    1 to zero ``out`` for a stack of no rows, none for an empty tensor.
    """
    stack, dev = payload_stack(buffers, format)
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
            codec.decode_device(format, stack, target, accumulate, st)
        else:
            codec.decode_host(format, stack, target, accumulate)
    return target if out is None else out


def decompress(payload, out=None, accumulate=False, stream=None):
    """Decode one Payload into ``out`` (overwrite, or add with ``accumulate``)."""
    if not isinstance(payload, Payload):
        raise PayloadError(f"expected a Payload, got {type(payload).__name__}; wrap a raw "
                           "buffer with Payload(format, buffer)")
    return decompress_many(payload.buffer.reshape(1, payload.nbytes), payload.format,
                           out=out, accumulate=accumulate, stream=stream)
