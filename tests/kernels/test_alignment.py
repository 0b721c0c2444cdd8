"""Payload buffers start at a multiple of ALIGN (8) bytes, or the call raises PayloadError.

A payload's sections are read as float32 and 32- and 64-bit words. NumPy reads unaligned words,
so on the host a buffer sliced at an odd byte offset used to work; a GPU stops the process's
CUDA context at such a load. Both now refuse it with the same error, so a program tried on CPUs
does not first fail on a GPU. Every compressor and format comes from the registry; offset 4
keeps float32 alignment and still breaks the 64-bit words.
"""
import numpy as np
import pytest
import torch

import numba_kernels as nk
from numba_kernels.registry import CODECS
from row_refs import registry_cases

N = 300
MISALIGNED = (1, 4)


def slice_at(nbytes, offset, rows=None):
    """A uint8 buffer of nbytes (or rows x nbytes) whose first byte sits ``offset`` bytes past
    an 8-byte boundary (NumPy allocates at 16 at least)."""
    size = nbytes if rows is None else rows * nbytes
    raw = np.zeros(size + 16, np.uint8)
    start = (-raw.ctypes.data) % 8 + offset
    buf = raw[start:start + size]
    assert buf.ctypes.data % 8 == offset
    return buf if rows is None else buf.reshape(rows, nbytes)


def data(seed=0):
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


CASES = registry_cases()


@pytest.mark.parametrize("name, compress, kw", CASES, ids=[c[0] for c in CASES])
def test_every_compressor_refuses_a_misaligned_out(name, compress, kw):
    want = compress(data(), **kw)
    for offset in MISALIGNED:
        with pytest.raises(nk.PayloadError, match=f"{offset} bytes past a multiple of 8"):
            compress(data(), **kw, out=slice_at(want.nbytes, offset))
        with pytest.raises(nk.PayloadError, match="multiple of 8"):   # a torch tensor too
            compress(data(), **kw, out=torch.from_numpy(slice_at(want.nbytes, offset)))
        with pytest.raises(nk.PayloadError, match="payload buffer starts at address"):
            nk.Payload(want.format, slice_at(want.nbytes, offset))
    got = compress(data(), **kw, out=slice_at(want.nbytes, 0))   # aligned: the same bytes
    np.testing.assert_array_equal(got.buffer, want.buffer)


ROW_CODECS = [c for c in CODECS if c.compress_rows is not None]
ROW_CALLS = {   # name: (call on a (rows, width) matrix, the argument's name in the error)
    "compress_rows": (lambda codec, fmt, matrix: codec.compress_rows(data(), matrix), "out"),
    "decompress_rows": (lambda codec, fmt, matrix: nk.decompress_rows(matrix, fmt), "matrix"),
    "decompress_many": (lambda codec, fmt, matrix: nk.decompress_many(matrix, fmt), "buffers"),
}


@pytest.mark.parametrize("call", ROW_CALLS)
@pytest.mark.parametrize("codec", ROW_CODECS, ids=[c.format.__name__ for c in ROW_CODECS])
def test_payload_matrices_refuse_a_misaligned_start(codec, call):
    rows = 2
    fmt = codec.compressors[0](data()[:-(-N // rows)]).format   # one partition's payload
    run, argument = ROW_CALLS[call]
    for offset in MISALIGNED:
        with pytest.raises(nk.PayloadError,
                           match=f"{argument} starts at address .* {offset} bytes past"):
            run(codec, fmt, slice_at(fmt.nbytes, offset, rows))
    run(codec, fmt, slice_at(fmt.nbytes, 0, rows))


def test_topk_segment_messages_refuse_a_misaligned_start():
    segments = [nk.TopKSegment(offset=0, length=N, k=7, col=0)]
    want = nk.compress_topk(data(), 7)
    nbytes = want.nbytes
    for offset in MISALIGNED:
        msg = slice_at(nbytes, offset)
        with pytest.raises(nk.PayloadError, match=f"out starts at address .* {offset} bytes"):
            nk.compress_topk_segments(data(), segments, msg)
        with pytest.raises(nk.PayloadError, match=f"selected starts at address .* {offset} "):
            nk.decompress_topk_segments(msg, segments, np.zeros(N, np.float32))
    aligned = slice_at(nbytes, 0)
    nk.compress_topk_segments(data(), segments, aligned)
    np.testing.assert_array_equal(aligned, want.buffer)


def test_an_empty_buffer_has_no_alignment_to_keep():
    fmt = nk.TopKFormat(0, 0)
    assert fmt.nbytes == 0
    nk.Payload(fmt, np.zeros(9, np.uint8)[1:1])
