"""Argument handling shared by the public compress/decompress functions.

Every public compressor does the same things before its kernel runs: find
where ``x`` lives, view it flat, check the residual and the output buffer
against it, and pick the stream.  Doing it here keeps the compressor modules
about their algorithms.
"""
import numpy as np

from ._device import FLOATS, as_array, empty, flat, same_place, stream_of
from .errors import DeviceMismatchError, KernelParameterError, LayoutError, PayloadError
from .wire import ALIGN, Payload, check_aligned, check_buffer

# The row forms put the partition index on the grid's y axis, whose limit is 65535 blocks.
MAX_ROWS = 65535
# Checked layouts kept per segment form (``functools.lru_cache``), kilobytes each: room for
# every bucket's layouts of a large model (a bucket takes two to four), since an evicted
# layout's device table is copied again at its next use, a copy from ordinary host memory that
# makes the host wait for the device
LAYOUTS_KEPT = 1024


def prepare(x, residual, out, make_format, stream):
    """Validate a compress call; return (x, e, on_device, format, buffer, stream).

    ``e`` is the flat residual or None.  ``buffer`` is ``out`` viewed flat, or a
    new uint8 buffer of ``format.nbytes`` where ``out`` is None.
    """
    xa, dev = flat(x, "x")
    fmt = make_format(xa.size)
    ea = _residual(residual, xa, dev)
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


def payload_matrix(out, name="out"):
    """``out`` as a C-contiguous (rows, width) uint8 array, width a multiple of ALIGN (so that
    every section of a payload at an aligned column has a typed view); return (array, dev)."""
    arr, dev = as_array(out, name)
    shape = tuple(getattr(arr, "shape", ()))
    if np.dtype(arr.dtype) != np.uint8 or len(shape) != 2 or shape[0] < 1:
        raise PayloadError(f"{name} must be a (rows, width) uint8 array with rows >= 1, got "
                           f"{arr.dtype} of shape {shape}")
    if shape[1] % ALIGN:
        raise PayloadError(f"{name}: the row width {shape[1]} is not a multiple of {ALIGN}")
    contiguous = arr.is_c_contiguous() if dev else arr.flags.c_contiguous
    if not contiguous:
        raise PayloadError(f"{name} must be C-contiguous")
    if shape[1]:
        check_aligned(arr, name)
    if dev and shape[0] > MAX_ROWS:
        raise KernelParameterError(f"{name}: at most {MAX_ROWS} rows on a device, got {shape[0]}")
    return arr, dev


def check_column(col, fmt, width, name="out"):
    """The payload of ``fmt`` at byte column ``col`` must be aligned and inside the row."""
    if isinstance(col, bool) or not isinstance(col, (int, np.integer)):
        raise KernelParameterError(f"col must be an integer, got {col!r}")
    if col < 0 or col % ALIGN or col + fmt.nbytes > width:
        raise PayloadError(f"{name}: a payload of {fmt.nbytes} bytes at column {col} must start "
                           f"at a multiple of {ALIGN} inside rows of {width} bytes")
    return int(col)


def prepare_rows(x, residual, out, col, make_format, stream):
    """Validate a row-form compress call (partition k of x into row k of ``out``); return
    (x, e, on_device, format, matrix, col, stream), ``format`` that of one partition.

    The partitions have P = ceil(len(x) / rows) elements; x may end short of rows x P (its
    missing tail reads as zeros) and the residual, if any, covers all rows x P."""
    xa, dev = flat(x, "x")
    mat, mdev = payload_matrix(out)
    same_place(dev, out=(mat, mdev))
    rows = mat.shape[0]
    part = -(-xa.size // rows) if rows else 0
    fmt = make_format(part)
    col = check_column(col, fmt, mat.shape[1])
    ea = _residual(residual, xa, dev, rows * part)
    st = stream_of(stream) if dev else 0
    return xa, ea, dev, fmt, mat, col, st


def encode_rows(x, residual, out, col, stream, make_format, on_device, on_host):
    """The body of every row-form compressor (``compress_*_rows``), as ``encode_payload``.

    Validate (``prepare_rows``); when there is data, run ``on_device(x, e, fmt, views, mat,
    col, stream)`` or ``on_host(x, c, has_res, fmt, views)`` on the sections' views of the
    matrix (``fmt.views2d(mat, col)``); zero every host row's padding; return the format of
    one partition."""
    xa, ea, dev, fmt, mat, col, st = prepare_rows(x, residual, out, col, make_format, stream)
    if fmt.n:
        views = fmt.views2d(mat, col)
        if dev:
            on_device(xa, ea, fmt, views, mat, col, st)
        else:
            on_host(xa, xa if ea is None else ea, ea is not None, fmt, views)
    if not dev and fmt.nbytes > fmt.used_nbytes:
        mat[:, col + fmt.used_nbytes:col + fmt.nbytes] = 0
    return fmt


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


def decode_target(out, n, dev, stream, accumulate, short_by=0):
    """The float array that decompression writes: ``out`` flat, or a new float32 array of n.
    ``out`` may end short of n by at most ``short_by`` elements (a zero-padded tail)."""
    if out is None:
        if accumulate:
            raise LayoutError("accumulate=True needs an out array to accumulate into")
        return empty(n, np.float32, dev, stream)
    arr, odev = flat(out, "out", FLOATS)
    same_place(dev, out=(arr, odev))
    if not n - short_by <= arr.size <= n:
        raise LayoutError(f"out has {arr.size} elements, the payload decodes to {n}"
                          + (f" (out may end short of that by up to {short_by})"
                             if short_by else ""))
    return arr


def require_same(dev_a, dev_b, what):
    if dev_a != dev_b:
        raise DeviceMismatchError(f"{what}: one argument is on the host, the other on a device")


def _residual(residual, xa, dev, size=None):
    """The flat residual beside ``xa`` (same dtype and place; ``size`` elements, x's own by
    default), or None."""
    if residual is None:
        return None
    ea, edev = flat(residual, "residual")
    same_place(dev, residual=(ea, edev))
    size = xa.size if size is None else size
    if ea.dtype != xa.dtype or ea.size != size:
        raise LayoutError(f"residual must match x: x is {xa.dtype}[{xa.size}], so the residual "
                          f"must be {xa.dtype}[{size}], got {ea.dtype}[{ea.size}]")
    return ea


def payload_rows(buffers, fmt, col):
    """(rows, col, dev): a (P, nbytes) stack (or P * nbytes flat) at column 0, else the
    (P, width) matrix whose payloads sit at the checked column ``col``."""
    shape = tuple(getattr(buffers, "shape", ()))
    at_zero = isinstance(col, (int, np.integer)) and not isinstance(col, bool) and col == 0
    if at_zero and (len(shape) != 2 or shape[1] == fmt.nbytes):
        stack, dev = payload_stack(buffers, fmt)
        return stack, 0, dev
    mat, dev = payload_matrix(buffers, "buffers")
    return mat, check_column(col, fmt, mat.shape[1], "buffers"), dev


def refuse_overlaps(regions):
    """Raise LayoutError if two segments of a segmented call would write one place:
    ``regions`` is [(what, starts, lengths)], arrays with an entry per segment."""
    for what, starts, lengths in regions:
        order = np.argsort(starts, kind="stable")
        ends = (starts + lengths)[order]
        if (starts[order][1:] < ends[:-1]).any():
            raise LayoutError(f"segments overlap in their {what}: each would write the "
                              "other's")
