"""Min-max compression of many tensors side by side: one launch for all of them on a device.

A packed scatter-reduce of a bucket whose layers each have their own code width (L-GreCo's
min-max family) encodes, decodes and re-encodes every layer on its own: four launches per layer
on a device, at some 50 us of host time each. Here the layers are segments of base arrays (the
bucket's gradients, their error memories laid end to end, a server's merged partitions), each
``MinMaxSegment`` giving where its values lie, its width and its payload's byte column in a
payload matrix's rows. Each function does for every segment what its per-tensor function does
for one, in one launch on a device (the grid's z axis is the segment; a table of the segments'
places, made once per layout and kept on the device, tells each block where to work); the
host runs the per-tensor kernels' work items, every segment's in one parallel loop, so both
write the same bytes.

* ``compress_minmax_rows_segments``: ``compress_minmax_rows`` of each segment;
* ``decompress_minmax_segments``: ``decompress_many`` of each segment's payloads in a stack's
  rows, summed and scaled into its place;
* ``decompress_minmax_rows_segments``: ``decompress_rows`` of each segment.

The encoder's chunks longer than 4096 elements take three kernels per tensor, and float64
arrays have no segmented kernels: such segments run one by one, on the device too.
"""
import functools
from typing import NamedTuple

import numpy as np

from numba import njit, prange

from . import _segment_table as T
from ._api import LAYOUTS_KEPT, payload_matrix, refuse_overlaps
from ._device import flat, same_place, stream_of
from ._disk_cache import cached_njit
from ._scalar import SEGMENT
from .dispatch import decompress_many, decompress_rows
from .errors import KernelParameterError, LayoutError
from .minmax import (compress_minmax_rows, decode_rows_item, decode_sum_item,
                     encode_rows_item)
from .wire import ALIGN, MinMaxFormat


class MinMaxSegment(NamedTuple):
    """One tensor of a segmented call: elements [offset, offset + length) of the base array,
    coded at ``bits``, its payload at byte column ``col`` of every row (a multiple of 8), and
    with error feedback its error memory at [error_offset, error_offset + rows x P) of the
    residual base (P = ceil(length / rows), as ``compress_minmax_rows`` takes it)."""

    offset: int
    length: int
    bits: int
    col: int
    error_offset: int = 0


def compress_minmax_rows_segments(x, segments, out, chunk=1024, residual=None, stream=None):
    """``compress_minmax_rows(x[s.offset:s.offset + s.length], out, s.col, s.bits, chunk,
    residual[s.error_offset:s.error_offset + rows x P])`` for every segment s.

    Device launches: 1 for all the segments (3 a segment when chunk > 4096; float64 arrays:
    the per-tensor call's, segment by segment)."""
    xa, dev = flat(x, "x")
    mat, mdev = payload_matrix(out)
    same_place(dev, out=(mat, mdev))
    ea = None
    if residual is not None:
        ea, edev = flat(residual, "residual")
        same_place(dev, residual=(ea, edev))
        if ea.dtype != xa.dtype:
            raise LayoutError(f"residual must be {xa.dtype} as x is, got {ea.dtype}")
    rows = mat.shape[0]
    layout = _layout(tuple(segments), rows, chunk, mat.shape[1], "encode", xa.size,
                     None if ea is None else ea.size)
    if xa.dtype == np.float32 and (chunk <= SEGMENT or not dev):
        if not layout.rows:
            return
        if dev:
            from ._cuda import minmax as kern
            kern.encode_segments(xa, ea, *layout.on_device(), chunk, mat, stream_of(stream))
        else:
            _encode_rows_segments_cpu(xa, xa if ea is None else ea, ea is not None,
                                      layout.table, layout.starts, chunk,
                                      mat.view(np.float32), mat.view(np.uint32), mat)
        return
    for s in segments:
        part = -(-s.length // rows)
        compress_minmax_rows(xa[s.offset:s.offset + s.length], mat, s.col, bits=s.bits,
                             chunk=chunk, stream=stream,
                             residual=None if ea is None else
                             ea[s.error_offset:s.error_offset + rows * part])


def decompress_minmax_segments(stack, segments, out, chunk=1024, factor=1.0, stream=None):
    """``decompress_many(stack, MinMaxFormat(s.length, s.bits, chunk), out[s.offset:s.offset +
    s.length], col=s.col, factor=factor)`` for every segment s: its payloads in every row of
    the (rows, width) ``stack``, summed in row order and scaled into its place in out.

    Device launches: 1 for all the segments (float64 arrays: the per-tensor call's, segment
    by segment)."""
    mat, dev = payload_matrix(stack, "stack")
    oa, odev = flat(out, "out")
    same_place(dev, out=(oa, odev))
    layout = _layout(tuple(segments), 1, chunk, mat.shape[1], "sum", oa.size, None)
    if oa.dtype == np.float32:
        if not layout.rows:
            return
        if dev:
            from ._cuda import minmax as kern
            kern.decode_segments(mat, *layout.on_device(), chunk, oa, factor, stream_of(stream))
        else:
            _decode_segments_cpu(mat.view(np.float32), mat.view(np.uint32), mat, layout.table,
                                 layout.starts, chunk, oa, np.float32(factor))
        return
    for s in segments:
        decompress_many(mat, MinMaxFormat(s.length, s.bits, chunk), stream=stream,
                        out=oa[s.offset:s.offset + s.length], col=s.col, factor=factor)


def decompress_minmax_rows_segments(matrix, segments, out, chunk=1024, stream=None):
    """``decompress_rows(matrix, MinMaxFormat(P, s.bits, chunk), out[s.offset:s.offset +
    s.length], col=s.col)`` for every segment s (P = ceil(s.length / rows)).

    Device launches: 1 for all the segments (float64 arrays: the per-tensor call's, segment
    by segment)."""
    mat, dev = payload_matrix(matrix, "matrix")
    oa, odev = flat(out, "out")
    same_place(dev, out=(oa, odev))
    rows = mat.shape[0]
    layout = _layout(tuple(segments), rows, chunk, mat.shape[1], "decode", oa.size, None)
    if oa.dtype == np.float32:
        if not layout.rows:
            return
        if dev:
            from ._cuda import minmax as kern
            kern.decode_rows_segments(mat, *layout.on_device(), chunk, oa, stream_of(stream))
        else:
            _decode_rows_segments_cpu(mat.view(np.float32), mat.view(np.uint32), mat,
                                      layout.table, layout.starts, chunk, oa)
        return
    for s in segments:
        decompress_rows(mat, MinMaxFormat(-(-s.length // rows), s.bits, chunk), stream=stream,
                        out=oa[s.offset:s.offset + s.length], col=s.col)


class _Layout:
    """The checked places of one call's segments: ``table``, a (segments, COLUMNS) int64 array
    of the non-empty ones (None when none has elements), and, once a device call needs them,
    that table on the device (on each device a process uses) and the grid's x extent."""

    def __init__(self, kind, payload_rows, chunk, table):
        self.kind, self.payload_rows, self.chunk, self.table = kind, payload_rows, chunk, table
        self._on = {}   # device id -> (table there, blocks)
        # the CPU twins' work items: chunks (of every row but for a sum) of each segment, the
        # first of segment s at starts[s], their number at starts[-1]
        if table is not None:
            chunks = -(-table[:, T.PART] // chunk) * (1 if kind == "sum" else payload_rows)
            self.starts = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)

    @property
    def rows(self):
        return 0 if self.table is None else len(self.table)

    def on_device(self):
        """(the table on the current device, blocks on the grid's x axis), made on first use
        on each device."""
        from ._device import cuda, current_device_id
        device = current_device_id()
        made = self._on.get(device)
        if made is None:
            made = self._on[device] = (cuda().to_device(self.table), self._blocks())
        return made

    def _blocks(self) -> int:
        from ._cuda.geometry import TEAMS, THREADS, blocks_for
        from ._cuda.launch import GRID_LIMIT
        from ._cuda.word_decode import PER_BLOCK, PER_THREAD
        part = [int(p) for p in self.table[:, T.PART]]
        if self.kind == "encode":   # a team per chunk, every chunk: no cap
            return max(blocks_for(-(-p // self.chunk), TEAMS) for p in part)
        # the decoders stride over their segment: a capped grid
        blocks = max(blocks_for(p, PER_BLOCK) if self.kind == "decode"
                     else blocks_for(-(-p // PER_THREAD), THREADS) for p in part)
        return max(1, min(blocks, GRID_LIMIT // (len(part) * self.payload_rows)))


@functools.lru_cache(maxsize=LAYOUTS_KEPT)   # an exchange's layout recurs every step: checked once
def _layout(segments, rows, chunk, width, kind, size, error_size):
    """The ``_Layout`` of ``segments`` (a tuple) for a call of ``kind``: "encode" and "decode"
    (a tensor of ``length`` cut into ``rows`` partitions), or "sum" (a payload of ``length``
    elements in every row). Checks that every segment lies inside the base array (of ``size``
    elements), its payload inside the rows (of ``width`` bytes) at an aligned column, its
    error memory inside the residual (of ``error_size``, or None), and that no two segments
    write the same place."""
    table = []
    for s in segments:
        if not isinstance(s, MinMaxSegment):
            raise KernelParameterError(f"segments must be MinMaxSegment, got {s!r}")
        if s.length < 0 or s.offset < 0 or s.offset + s.length > size:
            raise LayoutError(f"{s} lies outside the base array of {size} elements")
        if s.length == 0:
            continue
        part = s.length if kind == "sum" else -(-s.length // rows)
        fmt = MinMaxFormat(part, s.bits, chunk)
        if s.col < 0 or s.col % ALIGN or s.col + fmt.nbytes > width:
            raise LayoutError(f"{s}: a payload of {fmt.nbytes} bytes at column {s.col} must "
                              f"start at a multiple of {ALIGN} inside rows of {width} bytes")
        if error_size is not None and (s.error_offset < 0
                                       or s.error_offset + rows * part > error_size):
            raise LayoutError(f"{s}: its error memory of {rows * part} elements lies outside "
                              f"the residual of {error_size}")
        params, codes = fmt.section("params"), fmt.section("codes")
        table.append([s.offset, s.length, s.error_offset, part, s.bits,
                      (s.col + params.offset) // 4, (s.col + codes.offset) // 4, codes.offset,
                      s.col, fmt.used_nbytes, fmt.nbytes])
    if len(table) > 65535:   # the grid's z axis
        raise KernelParameterError(f"at most 65535 segments in one call, got {len(table)}")
    table = np.asarray(table, dtype=np.int64).reshape(-1, T.COLUMNS) if table else None
    if table is not None:
        _check_disjoint(table, rows, kind, error_size is not None)
    return _Layout(kind, rows, chunk, table)


def _check_disjoint(table, rows, kind, residual):
    """What one segment writes must not be another's: its place in out (decoders), its
    payload's columns and its error memory (encoder)."""
    if kind == "encode":
        regions = [("payload columns", table[:, T.COL], table[:, T.NBYTES])]
        if residual:
            regions.append(("error memory", table[:, T.E_OFF], rows * table[:, T.PART]))
    else:
        regions = [("places in out", table[:, T.X_OFF], table[:, T.X_LEN])]
    refuse_overlaps(regions)


# The CPU twins: one parallel loop over every segment's work items (a chunk, of one row but for
# the sum), each the per-tensor kernel's item on that segment, so the bytes are its bytes.
# They write no array expression or slice assignment: in a parallel function Numba makes each
# one a parallel region of its own (a slice of zeros in the loop over segments started one a
# segment and call), and tests/kernels/test_parallel_regions.py holds every CPU twin to its
# prange loops.

@njit(nogil=True, inline="always")
def _segment_of(starts, j):
    """The segment whose work items hold item j."""
    return np.searchsorted(starts, j, side="right") - 1


@cached_njit(nogil=True, parallel=True)
def _encode_rows_segments_cpu(x, e, has_res, table, starts, chunk, params, words, mat):
    """``encode_rows_cpu`` of every segment, then each payload's padding zeroed."""
    rows = mat.shape[0]
    for j in prange(starts[-1]):
        s = _segment_of(starts, j)
        start, part = table[s, T.X_OFF], table[s, T.PART]
        err = table[s, T.E_OFF] if has_res else start
        encode_rows_item(x[start:start + table[s, T.X_LEN]], e[err:err + rows * part], has_res,
                         part, chunk, table[s, T.BITS], params, table[s, T.PCOL], words,
                         table[s, T.WCOL], j - starts[s])
    for s in range(table.shape[0]):   # loops, not a slice assignment: see above
        col = table[s, T.COL]
        for r in range(rows):
            for c in range(col + table[s, T.USED], col + table[s, T.NBYTES]):
                mat[r, c] = 0


@cached_njit(nogil=True, parallel=True)
def _decode_segments_cpu(params, words, mat, table, starts, chunk, out, factor):
    """``decode_cpu_kernel`` of every segment into its place, then times ``factor`` (the
    float32 product ``decompress_many`` takes on the host)."""
    for j in prange(starts[-1]):
        s = _segment_of(starts, j)
        ci = j - starts[s]
        start, n = table[s, T.X_OFF], table[s, T.X_LEN]
        mine = out[start:start + n]
        decode_sum_item(params, table[s, T.PCOL], words, table[s, T.WCOL], mat,
                        table[s, T.COL] + table[s, T.BOFF], table[s, T.BITS], chunk, mine,
                        False, ci)
        if factor != 1:
            for i in range(ci * chunk, min(n, (ci + 1) * chunk)):
                mine[i] *= factor


@cached_njit(nogil=True, parallel=True)
def _decode_rows_segments_cpu(params, words, mat, table, starts, chunk, out):
    """``decode_rows_cpu_kernel`` of every segment into its place."""
    for j in prange(starts[-1]):
        s = _segment_of(starts, j)
        start = table[s, T.X_OFF]
        decode_rows_item(params, table[s, T.PCOL], words, table[s, T.WCOL], mat,
                         table[s, T.COL] + table[s, T.BOFF], table[s, T.BITS], chunk,
                         table[s, T.PART], out[start:start + table[s, T.X_LEN]], j - starts[s])
