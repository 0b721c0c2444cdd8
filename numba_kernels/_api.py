"""Argument handling shared by the public compress/decompress functions.

Every public compressor does the same things before its kernel runs: find
where ``x`` lives, view it flat, check the residual and the output buffer
against it, and pick the stream.  Doing it here keeps the compressor modules
about their algorithms.
"""
import numpy as np

from ._device import FLOATS, as_array, empty, flat, same_place, stream_of
from .errors import DeviceMismatchError, LayoutError
from .wire import Payload, check_buffer


def prepare(x, residual, out, make_format, stream):
    """Validate a compress call; return (x, e, on_device, format, buffer, stream).

    ``e`` is the flat residual or None.  ``buffer`` is ``out`` viewed flat, or a
    new uint8 buffer of ``format.nbytes`` where ``out`` is None.
    """
    xa, dev = flat(x, "x")
    fmt = make_format(xa.size)
    ea = None
    if residual is not None:
        ea, edev = flat(residual, "residual")
        same_place(dev, residual=(ea, edev))
        if ea.dtype != xa.dtype or ea.size != xa.size:
            raise LayoutError(f"residual must match x: x is {xa.dtype}[{xa.size}], "
                              f"residual is {ea.dtype}[{ea.size}]")
    st = stream_of(stream) if dev else 0
    buf = output_buffer(out, fmt.nbytes, dev, st)
    return xa, ea, dev, fmt, buf, st


def encode_payload(x, residual, out, stream, make_format, on_device, on_host):
    """The body every dense compressor shares around its kernels.

    Validate (``prepare``); when there is data, run ``on_device(x, e, fmt, views, buf,
    stream)`` or ``on_host(x, c, has_res, fmt, views)`` on the payload's section views
    (``c`` is where the kernel reads x + e and writes the new residual: the residual itself,
    or x when there is none); zero the host payload's padding; return the Payload.
    """
    xa, ea, dev, fmt, buf, st = prepare(x, residual, out, make_format, stream)
    if fmt.n:
        views = fmt.views(buf)
        if dev:
            on_device(xa, ea, fmt, views, buf, st)
        else:
            on_host(xa, xa if ea is None else ea, ea is not None, fmt, views)
    if not dev:
        buf[fmt.used_nbytes:] = 0
    return Payload(fmt, buf)


def output_buffer(out, nbytes, dev, stream, rows=None):
    """``out`` as a flat uint8 array of nbytes (or (rows, nbytes)); allocated if None."""
    shape = (nbytes,) if rows is None else (rows, nbytes)
    if out is None:
        return empty(shape, np.uint8, dev, stream)
    arr, odev = as_array(out, "out")
    same_place(dev, out=(arr, odev))
    check_buffer(arr, nbytes, "out", rows)
    return arr


def payload_stack(buffers, fmt):
    """``buffers`` as a (P, nbytes) uint8 array (accepts P*nbytes flat); return (array, dev)."""
    arr, dev = as_array(buffers, "buffers")
    nbytes = fmt.nbytes
    if arr.ndim == 1 and nbytes and arr.size % nbytes == 0:
        arr = arr.reshape(arr.size // nbytes, nbytes)
    rows = arr.shape[0] if arr.ndim == 2 else -1
    check_buffer(arr, nbytes, "buffers", rows)
    return arr, dev


def decode_target(out, n, dev, stream, accumulate):
    """The float array that decompression writes: ``out`` flat, or a new float32 array."""
    if out is None:
        if accumulate:
            raise LayoutError("accumulate=True needs an out array to accumulate into")
        return empty(n, np.float32, dev, stream)
    arr, odev = flat(out, "out", FLOATS)
    same_place(dev, out=(arr, odev))
    if arr.size != n:
        raise LayoutError(f"out has {arr.size} elements, the payload decodes to {n}")
    return arr


def require_same(dev_a, dev_b, what):
    if dev_a != dev_b:
        raise DeviceMismatchError(f"{what}: one argument is on the host, the other on a device")
