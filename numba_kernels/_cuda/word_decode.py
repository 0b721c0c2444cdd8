"""Stack and row decoders for the formats whose codes pack densely into uint32 words and whose
chunks are multiples of GROUP elements: min-max (1 to 8 bits) and 1-bit (chunks of 32k), and
QSGD (8-bit codes) where its chunk is a multiple of GROUP.

Each thread takes groups of GROUP consecutive elements, GROUPS groups per pass.  A group lies
in one chunk and its codes in one word (in two at 3, 5, 6 or 7 bits), so one word load and one
load of the chunk's parameters serve GROUP elements, where an element at a time took one of
each per element.  A format supplies two device functions: ``chunk_params(params, pcol, p, ci,
arg)``, the (a, b) of chunk ci of row p from its float32 parameter section (``arg``: a value of
the format's, passed to the kernel, such as QSGD's levels), and ``code_value(q, a, b)``, the
float32 of an element whose code is q.  ``word_decoders`` compiles the pair of kernels for
them, named in the format's module (the simulator suite's launch record and the PTX compile
find a kernel by module and name).
"""
import numpy as np
from numba import cuda

from .. import _segment_table as T
from .._bits import extract_py
from .common import (add_or_replace, at, group_load, group_store, group_store_times,
                     ilp_chunks, lesser, specialized)
from .geometry import GROUP, GROUP_ILP, GROUP_SPAN, GROUPS, THREADS

extract = cuda.jit(device=True)(extract_py)


@cuda.jit(device=True)
def group_field(words, wcol, p, g, bits, one_word, last):
    """The GROUP codes of element group g of row p as one integer, code j at bit j * bits.
    At 1, 2, 4 or 8 bits (``one_word``) they lie in one word; at 3, 5, 6 or 7 the next word
    (at an index kept inside the row, ``last``) is read too, whether they spill into it or
    not, so no load waits on a branch."""
    pos = g * (GROUP * bits)
    w = wcol + (pos >> 5)
    if one_word:
        return np.uint32(words[at(p), at(w)] >> np.uint32(pos & 31))
    w1 = words[at(p), at(lesser(w + 1, last))]
    return extract(words[at(p), at(w)], w1, pos & 31, GROUP * bits)


@cuda.jit(device=True)
def group_code(field, j, bits, mask):
    """Code j of a group's field (uint32: a 64-bit integer converts to float more slowly)."""
    return np.uint32((field >> np.uint32(j * bits)) & mask)


def word_decoders(chunk_params, code_value, module, suffix="", segmented=False):
    """(stack decoder, row decoder) of a format (see the module docstring), as kernels named
    ``_decode`` and ``_decode_rows`` (+ ``suffix``) of ``module``.  Launch them with ``launch.decode_stack``
    (``per_thread=PER_THREAD``) and ``launch.decode_rows`` (``per_block=PER_BLOCK``).

    With ``segmented``, also their segmented forms ``_decode_segments`` and
    ``_decode_rows_segments``: one grid for many payloads side by side in each row, block
    (b, k, s) working on segment s (row s of a ``numba_kernels._segment_table`` table, which
    gives its columns, code width, length and place in out), each segment's bytes those of the
    plain kernel on that segment alone."""

    @cuda.jit(device=True)
    def sum_rows(params, pcol, words, wcol, bits, chunk, arg, out, accumulate, factor):
        """The block strides over out: every row decoded and summed in row order, times
        ``factor``."""
        n = out.size
        groups = (n + GROUP - 1) // GROUP
        last = words.shape[1] - 1
        mask = np.uint32((1 << bits) - 1)
        one_word = (bits & (bits - 1)) == 0     # a power of two divides 32: no division here
        acc = cuda.local.array(GROUP_ILP, out.dtype)
        gix = cuda.local.array(GROUPS, np.int64)
        cix = cuda.local.array(GROUPS, np.int32)
        base = cuda.blockIdx.x * GROUP_SPAN + cuda.threadIdx.x
        while base < groups:
            group_load(out, acc, base, n, accumulate)
            ilp_chunks(base, groups, chunk // GROUP, gix, cix, GROUPS)     # once for every row
            for p in range(params.shape[0]):
                fold = accumulate or p > 0
                for u in range(GROUPS):
                    a, b = chunk_params(params, pcol, p, cix[u], arg)
                    field = group_field(words, wcol, p, gix[u], bits, one_word, last)
                    for j in range(GROUP):
                        k = u * GROUP + j
                        value = code_value(group_code(field, j, bits, mask), a, b)
                        acc[k] = add_or_replace(acc[k], value, fold)
            group_store_times(out, acc, base, n, factor)
            base += cuda.gridDim.x * GROUP_SPAN

    @cuda.jit(device=True)
    def row_into_partition(params, pcol, words, wcol, bits, chunk, arg, part, out):
        """Block (b, k) strides over partition k: out[k * part + i] = x_hat of row k's element
        i (up to out's end)."""
        k = cuda.blockIdx.y
        stop = lesser(part, out.size - k * part)
        mine = out[k * part:]
        groups = (stop + GROUP - 1) // GROUP
        last = words.shape[1] - 1
        mask = np.uint32((1 << bits) - 1)
        one_word = (bits & (bits - 1)) == 0
        vals = cuda.local.array(GROUP_ILP, out.dtype)
        gix = cuda.local.array(GROUPS, np.int64)
        cix = cuda.local.array(GROUPS, np.int32)
        base = cuda.blockIdx.x * GROUP_SPAN + cuda.threadIdx.x
        while base < groups:
            ilp_chunks(base, groups, chunk // GROUP, gix, cix, GROUPS)
            for u in range(GROUPS):
                a, b = chunk_params(params, pcol, k, cix[u], arg)
                field = group_field(words, wcol, k, gix[u], bits, one_word, last)
                for j in range(GROUP):
                    vals[u * GROUP + j] = code_value(group_code(field, j, bits, mask), a, b)
            group_store(mine, vals, base, stop)
            base += cuda.gridDim.x * GROUP_SPAN

    @specialized(f"_decode{suffix}", module)
    def decode(params, pcol, words, wcol, bits, chunk, arg, out, accumulate, factor):
        """Every row decoded and summed into out in row order, times ``factor``."""
        sum_rows(params, pcol, words, wcol, bits, chunk, arg, out, accumulate, factor)

    @specialized(f"_decode_rows{suffix}", module)
    def decode_rows(params, pcol, words, wcol, bits, chunk, arg, part, out):
        """Row k of the matrix into partition k of out, every k."""
        row_into_partition(params, pcol, words, wcol, bits, chunk, arg, part, out)

    if not segmented:
        return decode, decode_rows

    @specialized(f"_decode_segments{suffix}", module)
    def decode_segments(params, words, table, chunk, arg, out, factor):
        """Segment s's payloads in every row, summed into its place in out, times factor."""
        s = cuda.blockIdx.z
        start = table[s, T.X_OFF]
        sum_rows(params, table[s, T.PCOL], words, table[s, T.WCOL], table[s, T.BITS], chunk,
                 arg, out[start:start + table[s, T.X_LEN]], False, factor)

    @specialized(f"_decode_rows_segments{suffix}", module)
    def decode_rows_segments(params, words, table, chunk, arg, out):
        """Row k of segment s's payloads into partition k of its place in out."""
        s = cuda.blockIdx.z
        start = table[s, T.X_OFF]
        row_into_partition(params, table[s, T.PCOL], words, table[s, T.WCOL], table[s, T.BITS],
                           chunk, arg, table[s, T.PART], out[start:start + table[s, T.X_LEN]])

    return decode, decode_rows, decode_segments, decode_rows_segments


PER_THREAD = GROUP_ILP              # elements a thread covers per pass
PER_BLOCK = GROUP_ILP * THREADS     # elements a block of the row decoder covers per pass
