"""Top-k of many tensors side by side, and gTop-k's merge and decode of them: one launch for all
the small ones on a device, one parallel loop for all of them on the host.

A packed gTop-k exchange of a bucket whose layers each keep their own k (L-GreCo's top-k
family) selects, merges, restores, scales and decodes every layer on its own: five or six
launches per layer on a device, at some 50 us of host time each, and as many calls with their
checks on the host. Here the layers are segments of base arrays (the bucket's gradients, their
residuals laid end to end) and their payloads lie side by side in one message (a flat uint8
row), each ``TopKSegment`` giving where its values and residual lie, its k and its payload's
byte column. Each function does for every segment what its per-tensor functions do for one:

* ``compress_topk_segments``: ``compress_topk`` of each segment, the residual fused;
* ``merge_topk_segments``: ``merge_topk`` of each segment's payloads in two messages (one
  round of gTop-k's tree);
* ``decompress_topk_segments``: ``restore_unselected`` (with a residual and the message that
  was sent), then ``scale_topk_values`` and ``decompress`` of each segment's selected payload
  into its place.

On a device a block does a segment (``_cuda/topk_segments.py``): the selections and merges that
fit one block (``select.ONE_BLOCK_KEYS`` keys: 32,768 on a GPU) and the decodes of segments of
that length run in one launch for all of them, and larger segments take the per-tensor
functions, whose launches their size already amortises. The host runs every segment in one
parallel loop of the CPU twins' own functions, so both write the per-tensor calls' bytes.
Base arrays are float32, and indices int32 or int64 (``index_dtype``) as in ``TopKFormat``.
"""
import functools
from typing import NamedTuple

import numpy as np
from numba import prange

from . import _sparse_rules
from . import _topk_segment_table as T
from ._api import LAYOUTS_KEPT, refuse_overlaps
from ._device import as_array, flat, same_place, stream_of
from ._disk_cache import cached_njit
from ._scalar import rng_key
from ._select import select_exact
from .dispatch import decompress
from .errors import KernelParameterError, LayoutError, PayloadError
from .merge import (merge_topk, restore_cpu, restore_unselected, scale_topk_values,
                    union_cpu)
from .topk import add_inplace, compress_topk, select_approx
from .wire import ALIGN, Payload, TopKFormat, check_aligned


class TopKSegment(NamedTuple):
    """One tensor of a segmented call: elements [offset, offset + length) of the base array,
    ``k`` of them kept, its payload (``TopKFormat(length, k, index_dtype)``) at byte column
    ``col`` of the message (a multiple of 8), and its residual at [residual_offset,
    residual_offset + length) of the residual base."""

    offset: int
    length: int
    k: int
    col: int
    residual_offset: int = 0


def compress_topk_segments(x, segments, out, index_dtype="int32", residual=None, stream=None):
    """``compress_topk(x[s.offset:s.offset + s.length], s.k, index_dtype,
    residual=residual[s.residual_offset:...], out=out[s.col:s.col + nbytes])`` for every
    segment s; ``out`` is the message, a flat uint8 array.

    Device launches: 1 for all the segments of at most 32,768 elements (4,096 under the
    simulator) together; a larger one takes ``compress_topk``'s."""
    xa, dev = flat(x, "x", (np.float32,))
    msg = _message(out, "out", dev)
    ea = None
    if residual is not None:
        ea, edev = flat(residual, "residual", (np.float32,))
        same_place(dev, residual=(ea, edev))
    layout = _layout(tuple(segments), msg.size, xa.size, None if ea is None else ea.size,
                     index_dtype, _sparse_rules.APPROX_MIN_N)
    if not layout.rows:
        return
    ints, floats = _typed(msg, index_dtype)
    if not dev:
        _compress_segments_cpu(xa, xa if ea is None else ea, ea is not None, layout.table,
                               ints, floats, msg, rng_key(_sparse_rules.SAMPLE_SEED))
        return
    from ._cuda import topk_segments as kern
    st = stream_of(stream)
    together, apart, _ = layout.on_device("compress")
    if together is not None:
        kern.compress(xa, ea, together, ints, floats, msg, st)
    for s in apart:
        fmt = TopKFormat(s.length, s.k, index_dtype)
        compress_topk(xa[s.offset:s.offset + s.length], s.k, index_dtype=index_dtype,
                      residual=None if ea is None else
                      ea[s.residual_offset:s.residual_offset + s.length],
                      out=msg[s.col:s.col + fmt.nbytes], stream=st)


def merge_topk_segments(a, b, segments, out, index_dtype="int32", stream=None):
    """``merge_topk`` of every segment's payloads in the messages a and b (a first), into its
    columns of the message ``out``: one round of gTop-k's tree for all of them.

    Device launches: 1 for all the segments whose union (2 k entries) is at most 32,768
    (4,096 under the simulator) together; a larger one takes ``merge_topk``'s."""
    ma, dev = _message_of(a, "a")
    mb = _message(b, "b", dev)
    mo = _message(out, "out", dev)
    if not ma.size == mb.size == mo.size:
        raise PayloadError(f"the messages differ in size: a {ma.size}, b {mb.size}, out "
                           f"{mo.size} bytes")
    layout = _layout(tuple(segments), ma.size, None, None, index_dtype,
                     _sparse_rules.APPROX_MIN_N)
    if not layout.rows:
        return
    typed = (*_typed(ma, index_dtype), *_typed(mb, index_dtype), *_typed(mo, index_dtype))
    if not dev:
        _merge_segments_cpu(*typed, mo, layout.table)
        return
    from ._cuda import topk_segments as kern
    st = stream_of(stream)
    together, apart, union_size = layout.on_device("merge")
    if together is not None:
        kern.merge(*typed, mo, together, union_size, st)
    for s in apart:
        fmt = TopKFormat(s.length, s.k, index_dtype)
        cols = slice(s.col, s.col + fmt.nbytes)
        merge_topk(Payload(fmt, ma[cols]), Payload(fmt, mb[cols]), s.k, out=mo[cols], stream=st)


def decompress_topk_segments(selected, segments, out, index_dtype="int32", factor=1.0,
                             residual=None, sent=None, stream=None):
    """For every segment s: with ``residual`` and ``sent`` (the message this rank sent),
    ``restore_unselected`` of its residual; then its selected payload's values times
    ``factor`` (in place in ``selected``, as ``scale_topk_values``) decoded into
    out[s.offset:s.offset + s.length] (zeros where nothing was selected).

    Device launches: 1 for all the segments of at most 32,768 elements (4,096 under the
    simulator) together; a larger one takes the per-tensor functions' (2: zero and scatter;
    +1 restoring with a residual, +1 scaling when factor != 1)."""
    msel, dev = _message_of(selected, "selected")
    oa, odev = flat(out, "out", (np.float32,))
    same_place(dev, out=(oa, odev))
    if (residual is None) != (sent is None):
        raise KernelParameterError("restoring what the selection dropped takes both residual "
                                   "and sent, or neither")
    ea = msent = None
    if residual is not None:
        ea, edev = flat(residual, "residual", (np.float32,))
        same_place(dev, residual=(ea, edev))
        msent = _message(sent, "sent", dev)
        if msent.size != msel.size:
            raise PayloadError(f"sent has {msent.size} bytes, selected {msel.size}")
    layout = _layout(tuple(segments), msel.size, oa.size, None if ea is None else ea.size,
                     index_dtype, _sparse_rules.APPROX_MIN_N)
    if not layout.rows:
        return
    isel, fsel = _typed(msel, index_dtype)
    isent, fsent = (isel, fsel) if msent is None else _typed(msent, index_dtype)
    if not dev:
        _decompress_segments_cpu(isel, fsel, isent, fsent, oa, oa if ea is None else ea,
                                 ea is not None, layout.table, np.float32(factor))
        return
    from ._cuda import topk_segments as kern
    st = stream_of(stream)
    together, apart, _ = layout.on_device("decompress")
    if together is not None:
        kern.decompress(isel, fsel, isent, fsent, oa, ea, together, np.float32(factor), st)
    for s in apart:
        fmt = TopKFormat(s.length, s.k, index_dtype)
        cols = slice(s.col, s.col + fmt.nbytes)
        chosen = Payload(fmt, msel[cols])
        if ea is not None:
            restore_unselected(ea[s.residual_offset:s.residual_offset + s.length],
                               Payload(fmt, msent[cols]), chosen, stream=st)
        if factor != 1.0:
            scale_topk_values(chosen, factor, stream=st)
        decompress(chosen, out=oa[s.offset:s.offset + s.length], stream=st)


def _message_of(buf, name):
    """(``buf`` as a message, whether it is on a device)."""
    arr, dev = as_array(buf, name)
    return _checked_message(arr, name), dev


def _message(buf, name, dev):
    """``buf`` as a message, where ``dev`` says the call's other arrays are."""
    arr, adev = as_array(buf, name)
    same_place(dev, **{name: (arr, adev)})
    return _checked_message(arr, name)


def _checked_message(arr, name):
    """``arr`` if it is a flat uint8 array of a whole number of ALIGN-byte words, starting at
    a multiple of ALIGN bytes."""
    shape = tuple(getattr(arr, "shape", ()))
    if np.dtype(arr.dtype) != np.uint8 or len(shape) != 1 or shape[0] % ALIGN:
        raise PayloadError(f"{name} must be a flat uint8 message of a multiple of {ALIGN} "
                           f"bytes, got {arr.dtype} of shape {shape}")
    if shape[0]:
        check_aligned(arr, name)
    return arr


def _typed(msg, index_dtype):
    """The message seen as its indices' type and as float32 (every column is 8-aligned)."""
    return msg.view(np.dtype(index_dtype)), msg.view(np.float32)


class _Layout:
    """The checked places of one call's segments: ``table``, a (segments, COLUMNS) int64 array
    of the non-empty ones (None when none has elements), and, once a device call needs them,
    per kind of call the table of the segments one block can do (on each device a process
    uses) and the list of those it cannot."""

    def __init__(self, segments, table):
        self.segments, self.table = segments, table
        self._on = {}   # (device id, kind, limit) -> what on_device returns

    @property
    def rows(self):
        return 0 if self.table is None else len(self.table)

    def _fits_a_block(self, kind):
        from ._cuda.select import one_block
        keys = 2 * self.table[:, T.K] if kind == "merge" else self.table[:, T.X_LEN]
        return np.array([one_block(int(m)) for m in keys], dtype=bool)

    def on_device(self, kind):
        """(the table of the segments one block can do, on the current device, or None; the
        segments it cannot; the entries of a merge's scratch the first need), made on first
        use on each device."""
        from ._cuda import select
        from ._device import cuda, current_device_id
        device = current_device_id()
        key = (device, kind, select.ONE_BLOCK_KEYS)   # the tests patch the limit
        made = self._on.get(key)
        if made is None:
            fits = self._fits_a_block(kind)
            together = self.table[fits].copy()
            unions = np.cumsum(2 * together[:, T.K])
            together[:, T.U_OFF] = unions - 2 * together[:, T.K]
            apart = [s for s, fit in zip(self.segments, fits) if not fit]
            made = self._on[key] = (cuda().to_device(together) if len(together) else None,
                                    apart, int(unions[-1]) if len(unions) else 0)
        return made


@functools.lru_cache(maxsize=LAYOUTS_KEPT)   # an exchange's layout recurs every step: checked once
def _layout(segments, width, size, residual_size, index_dtype, approx_min_n):
    """The ``_Layout`` of ``segments`` (a tuple): checks that every segment lies inside the
    base array (of ``size`` elements; None: a merge, which reads messages only) and its
    residual inside the residual base (of ``residual_size``, or None), that its payload lies
    inside the message (of ``width`` bytes) at an aligned column, and that no two segments
    write the same place. ``approx_min_n`` (``_sparse_rules.APPROX_MIN_N``) is part of the
    key since the host's method for a segment depends on it."""
    table, kept = [], []
    for s in segments:
        if not isinstance(s, TopKSegment):
            raise KernelParameterError(f"segments must be TopKSegment, got {s!r}")
        if s.length < 0 or s.offset < 0 or (size is not None and s.offset + s.length > size):
            raise LayoutError(f"{s} lies outside the base array of {size} elements")
        if s.length == 0:
            continue
        fmt = TopKFormat(s.length, s.k, index_dtype)
        if s.col < 0 or s.col % ALIGN or s.col + fmt.nbytes > width:
            raise LayoutError(f"{s}: a payload of {fmt.nbytes} bytes at column {s.col} must "
                              f"start at a multiple of {ALIGN} inside a message of {width} "
                              "bytes")
        if residual_size is not None and (s.residual_offset < 0 or
                                          s.residual_offset + s.length > residual_size):
            raise LayoutError(f"{s}: its residual lies outside the residual base of "
                              f"{residual_size} elements")
        sample = (0, 0, 0)
        if _sparse_rules.uses_approx("approx", s.length) and s.k:
            sample = _sparse_rules.sample_plan(s.length, s.k)
        table.append([s.offset, s.length, s.residual_offset, s.k, s.col // fmt.itemsize,
                      (s.col + s.k * fmt.itemsize) // 4, s.col, fmt.used_nbytes, fmt.nbytes, 0,
                      *sample])
        kept.append(s)
    table = np.asarray(table, dtype=np.int64).reshape(-1, T.COLUMNS) if table else None
    if table is not None:
        _check_disjoint(table, size is not None, residual_size is not None)
    return _Layout(tuple(kept), table)


def _check_disjoint(table, places, residual):
    """What one segment writes must not be another's: its payload's columns, its place in the
    base array and its residual."""
    regions = [("payload columns", table[:, T.COL], table[:, T.NBYTES])]
    if places:
        regions.append(("places in the base array", table[:, T.X_OFF], table[:, T.X_LEN]))
    if residual:
        regions.append(("residuals", table[:, T.R_OFF], table[:, T.X_LEN]))
    refuse_overlaps(regions)


# The CPU twins: one parallel loop over the segments, each running the per-tensor CPU twin's
# own functions on its slices, so the bytes are the per-tensor calls' bytes. Padding is zeroed
# by loops, not slice assignments, which Numba would make parallel loops of their own
# (tests/kernels/test_parallel_regions.py).

@cached_njit(nogil=True, parallel=True)
def _compress_segments_cpu(x, e, has_res, table, ints, floats, msg, sample_key):
    """``compress_topk`` of every segment (the residual added first, the padding zeroed)."""
    for s in prange(table.shape[0]):
        start, n, k = table[s, T.X_OFF], table[s, T.X_LEN], table[s, T.K]
        col = table[s, T.COL]
        for c in range(col + table[s, T.USED], col + table[s, T.NBYTES]):
            msg[c] = 0
        arr = x[start:start + n]
        if has_res:
            arr = e[table[s, T.R_OFF]:table[s, T.R_OFF] + n]
            add_inplace(arr, x[start:start + n])
        if k == 0:
            continue
        out_idx = ints[table[s, T.ICOL]:table[s, T.ICOL] + k]
        out_val = floats[table[s, T.VCOL]:table[s, T.VCOL] + k]
        if table[s, T.SAMPLE]:
            select_approx(arr, n, k, table[s, T.SAMPLE], table[s, T.SAMPLE_RANK],
                          table[s, T.CAPACITY], sample_key, out_idx, out_val, arr, has_res)
        else:
            select_exact(arr, n, k, out_idx, out_val, arr, has_res, np.empty(1, np.int64),
                         False)


@cached_njit(nogil=True, parallel=True)
def _merge_segments_cpu(ia, fa, ib, fb, io, fo, mo, table):
    """``merge_topk`` of every segment: the union of its two lists, then its exact top-k."""
    for s in prange(table.shape[0]):
        k, icol, vcol, col = table[s, T.K], table[s, T.ICOL], table[s, T.VCOL], table[s, T.COL]
        for c in range(col + table[s, T.USED], col + table[s, T.NBYTES]):
            mo[c] = 0
        if k == 0:
            continue
        uidx = np.empty(2 * k, np.int64)
        uval = np.empty(2 * k, np.float32)
        m = union_cpu(ia[icol:icol + k], fa[vcol:vcol + k], ib[icol:icol + k],
                      fb[vcol:vcol + k], uidx, uval)
        select_exact(uval, m, k, io[icol:icol + k], fo[vcol:vcol + k], uval, False, uidx, True)


@cached_njit(nogil=True, parallel=True)
def _decompress_segments_cpu(isel, fsel, isent, fsent, out, e, has_res, table, factor):
    """Every segment: restore what its selection dropped (``restore_cpu``), scale the selected
    values, and scatter them into its zeroed place (``decode_cpu_kernel`` of one row)."""
    for s in prange(table.shape[0]):
        k, icol, vcol = table[s, T.K], table[s, T.ICOL], table[s, T.VCOL]
        start, n = table[s, T.X_OFF], table[s, T.X_LEN]
        if has_res:
            restore_cpu(e[table[s, T.R_OFF]:table[s, T.R_OFF] + n], isent[icol:icol + k],
                        fsent[vcol:vcol + k], isel[icol:icol + k])
        mine = out[start:start + n]
        mine[:] = 0
        for j in range(k):
            if factor != 1:
                fsel[vcol + j] *= factor
            mine[isel[icol + j]] = fsel[vcol + j]
