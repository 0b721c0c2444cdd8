"""Every kernel launch of numba_kernels goes through this module.

``launch`` is the only place a kernel is started, so ``numba_kernels.launch_count()``
sees them all.  No function of the package reads device memory on the host, so
the host never waits for the device here (the simulator tests count copies to the
host and synchronisations: none).  On top of ``launch`` sit the launch shapes that
several formats share:

* ``launch_over``: THREADS-thread blocks enough to cover n items;
* ``ChunkedEncoder``: min-max, QSGD and 1-bit encode chunk by chunk, in one
  fused kernel, or in three when a chunk is longer than one block's SEGMENT;
  ``RowEncoder`` does the same for the n partitions of a tensor at once, on
  grids whose y axis is the partition (the row of the payload matrix);
* ``decode_stack``: every dense decoder sums all rows of a payload stack in
  one grid-stride pass over the output; ``decode_rows`` decodes each row of a
  payload matrix into its own partition of the output, in one launch too.
"""
import warnings
from dataclasses import dataclass

import numpy as np

from .. import _counters
from .._scalar import SEGMENT
from .geometry import ILP, ILP_SPAN, THREADS, blocks_for
from .scratch import _stream_key, scratch

# Grid-stride kernels never need more blocks than this to keep a GPU busy.
GRID_LIMIT = 65536


def launch(kernel, blocks, threads, stream, *args):
    """Launch ``kernel[blocks, threads, stream](*args)`` and count it.

    The first launch of a kernel with arguments of given types goes through Numba's
    dispatcher, which types every argument, compiles if needed and launches.  Later ones
    with arguments of the same kinds start the compiled kernel that launch picked
    directly: Numba's dispatch costs the host about 50 us a launch (H100 machine,
    ``benchmarks/launch_overhead.py``), a large part of a small bucket's host time, and
    typing the arguments again is most of it.
    """
    key = _launch_key(kernel, args)
    compiled = _COMPILED.get(key) if key is not None else False
    if compiled:
        compiled.launch(args, _dims(blocks), _dims(threads), _numba_stream(kernel, stream), 0)
    else:
        kernel[blocks, threads, stream](*args)
        if compiled is None:
            _COMPILED[key] = _compiled_for(kernel, args)
    _counters.count_launch()


# (kernel, argument kinds) -> the compiled kernel Numba launched for such arguments, or
# False where the direct path does not apply (the simulator, launch-configuration
# sensitive kernels, a Numba without the attributes it relies on)
_COMPILED: dict = {}
# stream handle -> the stream as compiled kernels take it (kept with the stream given, so
# that the handle stays valid while it is cached)
_STREAMS: dict = {}


def _launch_key(kernel, args):
    """What decides the compiled kernel Numba picks for ``args``: each argument's type, and
    for arrays their dtype, rank and contiguity (Numba's array layout).  None where an
    argument is of another kind (then every launch goes through the dispatcher)."""
    kinds = [kernel]
    for a in args:
        t = type(a)
        if t in _SCALARS:
            kinds.append(t)
        elif getattr(a, "__cuda_ndarray__", False) and hasattr(a, "flags"):
            flags = a.flags
            kinds.append((t, a.dtype, a.ndim, flags["C_CONTIGUOUS"], flags["F_CONTIGUOUS"]))
        else:
            return None
    return tuple(kinds)


_SCALARS = frozenset({int, float, bool, np.float32, np.float64, np.int32, np.int64,
                      np.uint32, np.uint64, np.bool_})


def _compiled_for(kernel, args):
    """The compiled kernel that ``kernel[...](*args)`` just launched, when it can be launched
    directly; else False."""
    try:
        if getattr(kernel, "_launch_config_sensitive", False) or kernel.specialized:
            return False
        compiled = kernel.overloads.get(tuple(kernel.typeof_pyval(a) for a in args))
    except AttributeError:          # the simulator's kernels, or a Numba without them
        return False
    if compiled is None or getattr(compiled, "launch_config_sensitive", False) \
            or getattr(compiled, "cooperative", False) or getattr(compiled, "debug", False):
        return False
    return compiled


def _numba_stream(kernel, stream):
    """``stream`` as Numba's compiled kernels take it.  Numba converts it when it configures
    a launch; the conversion is made once per stream handle."""
    key = _stream_key(stream)
    held = _STREAMS.get(key)
    if held is None:
        with warnings.catch_warnings():     # a 1-block configuration, never launched
            warnings.simplefilter("ignore")
            held = (stream, kernel[1, 1, stream].stream)
        _STREAMS[key] = held
    return held[1]


def _dims(d):
    """A grid or block size as the (x, y, z) triple a compiled kernel's launch takes."""
    if isinstance(d, (int, np.integer)):
        return (int(d), 1, 1)
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


def launch_over(kernel, n, stream, *args, max_blocks=GRID_LIMIT):
    """Launch ``kernel`` on THREADS-thread blocks covering n items.

    At most ``max_blocks`` blocks (grid-stride kernels loop over the rest);
    ``max_blocks=None`` for kernels that handle one item per thread.
    """
    blocks = blocks_for(n, THREADS)
    if max_blocks is not None:
        blocks = min(blocks, max_blocks)
    launch(kernel, blocks, THREADS, stream, *args)


@dataclass(frozen=True)
class ChunkedEncoder:
    """The kernels of a chunked format's encoder, and how it launches them.

    Argument conventions (``enc``, ``red``, ``comb``: the format's own arguments):

    * ``fused(x, e, has_res, chunk, *enc, buf, used, nbytes)``: one block per
      chunk reduces it, computes its parameters and encodes it;
    * for chunks longer than SEGMENT, ``spc`` = segments per chunk:
      ``reduce(x, e, has_res, chunk, spc, *red, part)``, one block per segment,
      writes the segment's partial result to ``part[g]``;
      ``combine(part, spc, chunk, n, *comb)``, one block per chunk, turns the
      partials into the chunk's parameters;
      ``encode(x, e, has_res, chunk, spc, *enc, buf, used, nbytes)``, one block
      per segment, encodes with them.

    Every encoding kernel's block 0 zeroes the payload's padding
    ``buf[used:nbytes]``, so padding costs no launch of its own.
    """
    fused: object
    reduce: object
    combine: object
    encode: object
    part_shape: tuple = ()      # shape of one segment's partial: () a sum, (2,) a (min, max)

    def __call__(self, x, e, fmt, buf, stream, enc, red=(), comb=()):
        """Encode x (+ e, updated in place) into ``buf``: 1 launch, 3 when fmt.chunk > SEGMENT."""
        ee, has_res = (x, False) if e is None else (e, True)
        tail = (buf, fmt.used_nbytes, fmt.nbytes)
        if fmt.chunk <= SEGMENT:
            launch(self.fused, fmt.nchunks, THREADS, stream, x, ee, has_res, fmt.chunk, *enc, *tail)
            return
        spc = -(-fmt.chunk // SEGMENT)
        nblk = fmt.nchunks * spc
        part = scratch("chunked.partials", (nblk,) + self.part_shape, np.float32, stream)
        launch(self.reduce, nblk, THREADS, stream, x, ee, has_res, fmt.chunk, spc, *red, part)
        launch(self.combine, fmt.nchunks, THREADS, stream, part, spc, fmt.chunk, x.size, *comb)
        launch(self.encode, nblk, THREADS, stream, x, ee, has_res, fmt.chunk, spc, *enc, *tail)


@dataclass(frozen=True)
class RowEncoder(ChunkedEncoder):
    """``ChunkedEncoder``'s kernels in their row form: every grid gets a y axis of one block
    row per partition, so the rows' encodes cost the launches of one.

    Argument conventions (``enc``, ``red``, ``comb``: the format's own row-form arguments;
    ``part`` = fmt.n, the partition length; block (b, k) works on partition k):

    * ``fused(x, e, has_res, part, chunk, *enc, mat, col, used, nbytes)``, grid (chunks, rows);
    * ``reduce(x, e, has_res, part, chunk, spc, *red, partial)``, grid (segments, rows),
      ``partial`` of shape (rows, segments) + part_shape;
      ``combine(partial, spc, chunk, part, *comb)``, grid (chunks, rows);
      ``encode(x, e, has_res, part, chunk, spc, *enc, mat, col, used, nbytes)``,
      grid (segments, rows).

    Block (0, k) of every encoding kernel zeroes row k's padding
    ``mat[k, col + used:col + nbytes]``.
    """

    def __call__(self, x, e, rows, fmt, mat, col, stream, enc, red=(), comb=()):
        """Encode partition k of x (+ e, updated in place) into row k of ``mat`` at column
        ``col``, every k: 1 launch, 3 when fmt.chunk > SEGMENT."""
        ee, has_res = (x, False) if e is None else (e, True)
        head = (x, ee, has_res, fmt.n, fmt.chunk)
        tail = (mat, col, fmt.used_nbytes, fmt.nbytes)
        if fmt.chunk <= SEGMENT:
            launch(self.fused, (fmt.nchunks, rows), THREADS, stream, *head, *enc, *tail)
            return
        spc = -(-fmt.chunk // SEGMENT)
        nblk = fmt.nchunks * spc
        part = scratch("chunked.partials", (rows, nblk) + self.part_shape, np.float32,
                       stream)
        launch(self.reduce, (nblk, rows), THREADS, stream, *head, spc, *red, part)
        launch(self.combine, (fmt.nchunks, rows), THREADS, stream, part, spc, fmt.chunk, fmt.n,
               *comb)
        launch(self.encode, (nblk, rows), THREADS, stream, *head, spc, *enc, *tail)


def decode_stack(kernel, fmt, stack, col, sections, params, out, accumulate, stream):
    """1 launch: ``kernel(view, col, ..., *params, out, accumulate)`` over the output, each
    thread taking ILP elements per pass (``common.ilp_index``).

    ``sections`` names the payload sections the kernel reads; each is passed as
    its 2-D view of the (P, width) stack, whose rows hold the payloads at byte
    column ``col`` (0 for a (P, nbytes) stack), and the column it starts at.
    """
    columns = row_sections(fmt.views2d(stack, col), sections)
    launch_over(kernel, -(-out.size // ILP), stream, *columns, *params, out, accumulate)


def row_sections(views, sections):
    """The (typed 2-D view, first column) pairs of ``sections``, flattened, of ``views2d``."""
    return [item for name in sections for item in views[name]]


def decode_rows(kernel, fmt, columns, params, rows, out, stream):
    """1 launch: ``kernel(*columns, *params, part, out)`` on a (blocks, rows) grid, block
    (b, k) striding over partition k of out, ILP elements per thread and pass (at most
    GRID_LIMIT blocks in all)."""
    blocks = min(blocks_for(fmt.n, ILP_SPAN), max(1, GRID_LIMIT // rows))
    launch(kernel, (blocks, rows), THREADS, stream, *columns, *params, fmt.n, out)
