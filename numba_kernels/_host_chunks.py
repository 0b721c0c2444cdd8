"""How the CPU twins of the chunked formats (min-max, QSGD, 1-bit) walk a tensor.

Each encoder runs one chunk per parallel iteration and starts it the same
way: find the chunk's bounds and the view it reads, c = x + e formed in e's
view under error feedback (the encoder then writes the residual over it; one
array read and written, so the loops vectorise without aliasing checks).  The
GPU's counterpart is ``_cuda/common.load_c``, which forms c per element.
"""
from numba import njit


@njit(nogil=True)
def add_into(e, x):
    """e += x for views (c = x + e, kept in e until the residual is written)."""
    for i in range(x.size):
        e[i] = x[i] + e[i]


@njit(nogil=True, inline="always")
def chunk_source(x, e, has_res, ci, chunk):
    """(start, stop, c) of chunk ci: c is e[start:stop] holding x + e with has_res, else x's."""
    s = ci * chunk
    t = min(x.size, s + chunk)
    if has_res:
        add_into(e[s:t], x[s:t])
        return s, t, e[s:t]
    return s, t, x[s:t]
