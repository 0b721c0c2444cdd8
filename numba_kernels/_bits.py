"""Dense bit packing shared by the CPU twins and the CUDA kernels.

Code i of width ``bits`` occupies bits [i*bits, (i+1)*bits) of a little-endian
stream of uint32 words: it starts at bit ``off = (i*bits) % 32`` of word
``(i*bits) // 32`` and spills into the next word when ``off + bits > 32``.
``extract_py`` is plain integer code compiled for both targets; ``read_code`` is the CPU twins'
reader (the kernels read codes with ``word_decode.group_field``).
"""
import numpy as np
from numba import njit

_U64 = np.uint64
_S32 = _U64(32)


def extract_py(w0, w1, off, bits):
    """The code starting at bit ``off`` of word w0 (continuing into w1)."""
    both = _U64(w0) | (_U64(w1) << _S32)
    return np.uint32((both >> _U64(off)) & ((_U64(1) << _U64(bits)) - _U64(1)))


extract = njit(nogil=True, inline="always")(extract_py)


@njit(nogil=True, inline="always")
def read_code(words, i, bits):
    """Code i of the stream held in the 1-D ``words`` view."""
    pos = i * bits
    w = pos >> 5
    off = pos & 31
    w1 = words[w + 1] if off + bits > 32 else np.uint32(0)
    return extract(words[w], w1, off, bits)
