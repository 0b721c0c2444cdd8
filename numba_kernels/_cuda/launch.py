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
from dataclasses import dataclass

import numpy as np

from .. import _counters
from .._scalar import SEGMENT
from .geometry import ILP, ILP_SPAN, THREADS, blocks_for
from .scratch import scratch

# Grid-stride kernels never need more blocks than this to keep a GPU busy.
GRID_LIMIT = 65536


def launch(kernel, blocks, threads, stream, *args):
    """Launch ``kernel[blocks, threads, stream](*args)`` and count it."""
    kernel[blocks, threads, stream](*args)
    _counters.count_launch()


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
      ``chunks_per_block`` chunks (a block per chunk, or a team of threads per
      chunk) reduces each, computes its parameters and encodes it;
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
    chunks_per_block: int = 1   # chunks that one block of the fused kernel encodes

    def __call__(self, x, e, fmt, buf, stream, enc, red=(), comb=()):
        """Encode x (+ e, updated in place) into ``buf``: 1 launch, 3 when fmt.chunk > SEGMENT."""
        ee, has_res = (x, False) if e is None else (e, True)
        tail = (buf, fmt.used_nbytes, fmt.nbytes)
        if fmt.chunk <= SEGMENT:
            launch(self.fused, blocks_for(fmt.nchunks, self.chunks_per_block), THREADS, stream, x,
                   ee, has_res, fmt.chunk, *enc, *tail)
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

    * ``fused(x, e, has_res, part, chunk, *enc, mat, col, used, nbytes)``, grid
      (chunks / chunks_per_block, rows);
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
            launch(self.fused, (blocks_for(fmt.nchunks, self.chunks_per_block), rows), THREADS,
                   stream, *head, *enc, *tail)
            return
        spc = -(-fmt.chunk // SEGMENT)
        nblk = fmt.nchunks * spc
        part = scratch("chunked.partials", (rows, nblk) + self.part_shape, np.float32,
                       stream)
        launch(self.reduce, (nblk, rows), THREADS, stream, *head, spc, *red, part)
        launch(self.combine, (fmt.nchunks, rows), THREADS, stream, part, spc, fmt.chunk, fmt.n,
               *comb)
        launch(self.encode, (nblk, rows), THREADS, stream, *head, spc, *enc, *tail)


def decode_stack(kernel, fmt, stack, col, sections, params, out, accumulate, factor, stream,
                 per_thread=ILP):
    """1 launch: ``kernel(view, col, ..., *params, out, accumulate, factor)`` over the output,
    each thread taking ``per_thread`` elements per pass (ILP, ``common.ilp_index``; the
    min-max decoders' groups, ``common.group_load``) and storing its sums times
    ``factor`` (a float32; times 1 leaves every float as it is).

    ``sections`` names the payload sections the kernel reads; each is passed as
    its 2-D view of the (P, width) stack, whose rows hold the payloads at byte
    column ``col`` (0 for a (P, nbytes) stack), and the column it starts at.
    """
    columns = row_sections(fmt.views2d(stack, col), sections)
    launch_over(kernel, -(-out.size // per_thread), stream, *columns, *params, out,
                accumulate, np.float32(factor))


def row_sections(views, sections):
    """The (typed 2-D view, first column) pairs of ``sections``, flattened, of ``views2d``."""
    return [item for name in sections for item in views[name]]


def decode_rows(kernel, fmt, columns, params, rows, out, stream, per_block=ILP_SPAN):
    """1 launch: ``kernel(*columns, *params, part, out)`` on a (blocks, rows) grid, block
    (b, k) striding over partition k of out, ``per_block`` elements a pass (ILP a thread, or
    the min-max decoders' groups), at most GRID_LIMIT blocks in all."""
    blocks = min(blocks_for(fmt.n, per_block), max(1, GRID_LIMIT // rows))
    launch(kernel, (blocks, rows), THREADS, stream, *columns, *params, fmt.n, out)
