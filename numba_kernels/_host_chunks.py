"""How the CPU twins of the chunked formats (min-max, QSGD, 1-bit) walk a tensor.

Each encoder runs one chunk per parallel iteration and starts it the same
way: find the chunk's bounds and the view it reads, c = x + e formed in e's
view under error feedback (the encoder then writes the residual over it; one
array read and written, so the loops vectorise without aliasing checks).  The
GPU's counterpart is ``_cuda/common.load_c``, which forms c per element.

``size`` is the length the chunks cover: x's own, or for the row forms the
partition length, which x's last partitions may end short of (a scatter-reduce
of a tensor whose length n does not divide).  Elements past x's end read as
zeros, so such a partition encodes exactly as the zero-padded copy it replaces.
"""
import numpy as np
from numba import njit


@njit(nogil=True)
def add_into(e, x):
    """e += x for views (c = x + e, kept in e until the residual is written)."""
    for i in range(x.size):
        e[i] = x[i] + e[i]


@njit(nogil=True)
def add_zero(e):
    """e = 0 + e: a zero-padded x's sum, bit for bit (it turns -0.0 into +0.0)."""
    for i in range(e.size):
        e[i] = e[i] + np.float32(0.0)


@njit(nogil=True, inline="always")
def chunk_source(x, e, has_res, ci, chunk, size):
    """(start, stop, c) of chunk ci of ``size`` elements: c is e[start:stop] holding x + e with
    has_res, else x's (a zero-padded copy where the chunk runs past x's end)."""
    s = ci * chunk
    t = min(size, s + chunk)
    have = max(0, min(t, x.size) - s)      # elements of the chunk that x holds
    if has_res:
        add_into(e[s:s + have], x[s:s + have])
        add_zero(e[s + have:t])
        return s, t, e[s:t]
    if have == t - s:
        return s, t, x[s:t]
    # An element loop, not a slice assignment: Numba compiled the assignment's shape check with
    # its error message's string formatting, 8-10 s more where a process compiled an encoder
    src = np.zeros(t - s, x.dtype)
    for i in range(have):
        src[i] = x[s + i]
    return s, t, src
