"""The row forms on the host (CPU twins): ``compress_*_rows`` and ``decompress_rows`` against
the per-partition calls that C_LP_S made before them, byte for byte.

The same checks on the device, in Numba's CUDA simulator, are ``sim_kernels.py``'s
``test_row_forms_*`` (``device_checks.check_rows``); their launch counts are in
``sim_launches.py``.
"""
import zlib

import numpy as np
import pytest

import numba_kernels as nk
from numba_kernels.errors import LayoutError, PayloadError

from row_refs import (COL, JUNK, ROW_FORMS, loop_decode, partition_loop, row_form, row_format,
                      row_matrix)

CODECS = [("minmax", {"bits": 8, "chunk": 64}), ("minmax", {"bits": 3, "chunk": 96}),
          ("minmax", {"bits": 1, "chunk": 32}), ("qsgd", {"levels": 127, "chunk": 100}),
          ("qsgd", {"levels": 5, "chunk": 33}), ("onebit", {"chunk": 64, "scale": "l2"}),
          ("onebit", {"chunk": 96, "scale": "mean_abs"})]
# partition lengths: none a multiple of any chunk above but 1's own, and a chunk-aligned one
PARTS = [1, 31, 250, 1001, 3 * 64 * 96]


def _case(name, kw, rows, part, res, dtype=np.float32):
    rng = np.random.default_rng([rows, part, len(name)])
    x = rng.standard_normal(rows * part).astype(dtype)
    e = (rng.standard_normal(rows * part) * 0.1).astype(dtype) if res else None
    return x, e


def _both(name, kw, rows, part, res, dtype=np.float32):
    """Per-partition loop and row form on copies of the same data: (loop, rows) results."""
    x, e = _case(name, kw, rows, part, res, dtype)
    results = []
    for encode in (partition_loop, row_form):
        xc, ec = x.copy(), None if e is None else e.copy()
        fmt = row_format(name, kw, part)
        mat = row_matrix(rows, fmt)
        got = encode(name, kw, xc, ec, mat)
        assert got == fmt
        results.append((xc, ec, mat, fmt))
    return results


@pytest.mark.parametrize("name, kw", CODECS, ids=[f"{n}-{kw}" for n, kw in CODECS])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("res", [False, True], ids=["plain", "error-feedback"])
def test_row_form_writes_the_per_partition_payloads_and_residuals(name, kw, rows, res):
    for part in PARTS:
        (lx, le, lmat, fmt), (rx, re_, rmat, _) = _both(name, kw, rows, part, res)
        assert np.array_equal(lmat, rmat), (name, kw, rows, part)
        assert np.array_equal(lx, rx)
        if res:
            assert np.array_equal(le, re_), (name, kw, rows, part)
        # the other columns of each row (another segment's bytes) are left alone
        assert (rmat[:, :COL] == JUNK).all() and (rmat[:, COL + fmt.nbytes:] == JUNK).all()
        # and the decode of every row into its partition is the per-row decode
        want = loop_decode(fmt, lmat)
        assert np.array_equal(nk.decompress_rows(rmat, fmt, col=COL), want)
        out = np.full(rows * part, np.nan, np.float32)
        assert nk.decompress_rows(rmat, fmt, out=out, col=COL) is out
        assert np.array_equal(out, want)


@pytest.mark.parametrize("name, kw", [("minmax", {"bits": 4, "chunk": 4160}),
                                      ("qsgd", {"levels": 31, "chunk": 4100}),
                                      ("onebit", {"chunk": 8192, "scale": "l2"})],
                         ids=["minmax", "qsgd", "onebit"])
@pytest.mark.parametrize("rows", [1, 3])
def test_row_form_of_chunks_longer_than_a_segment(name, kw, rows):
    (_, le, lmat, fmt), (_, re_, rmat, _) = _both(name, kw, rows, 9000, True)
    assert np.array_equal(lmat, rmat) and np.array_equal(le, re_)
    assert np.array_equal(nk.decompress_rows(rmat, fmt, col=COL), loop_decode(fmt, lmat))


@pytest.mark.parametrize("name", sorted(ROW_FORMS))
def test_row_form_of_float64_data(name):
    kw = {"chunk": 64}
    (lx, le, lmat, _), (rx, re_, rmat, _) = _both(name, kw, 3, 100, True, np.float64)
    assert np.array_equal(lmat, rmat) and np.array_equal(le, re_)


def test_row_form_at_column_zero_of_a_matrix_of_exactly_the_payloads():
    x = np.random.default_rng(3).standard_normal(4 * 77).astype(np.float32)
    fmt = nk.QSGDFormat(77)
    mat = np.empty((4, fmt.nbytes), np.uint8)
    nk.compress_qsgd_rows(x, mat, row_seeds=(5, 0, 1))
    for k in range(4):
        p = nk.compress_qsgd(x[k * 77:(k + 1) * 77], seed=nk.row_seed(5, 0, k, 1))
        assert np.array_equal(p.buffer, mat[k])
    assert np.array_equal(nk.decompress_rows(mat, fmt), loop_decode(fmt, mat, col=0))


def test_empty_partitions_write_nothing():
    mat = np.full((3, 8), JUNK, np.uint8)
    assert nk.compress_minmax_rows(np.zeros(0, np.float32), mat).nbytes == 0
    assert (mat == JUNK).all()
    assert nk.decompress_rows(mat, nk.MinMaxFormat(0)).size == 0


def test_row_seed_is_the_crc_of_the_int64_words():
    rng = np.random.default_rng(0)
    for base, rank, row, phase in [(0, 0, 0, 0), (-1, 3, 7, 2), (2**63 - 1, 65535, 65534, 1)] + \
            [tuple(int(v) for v in rng.integers(-2**40, 2**40, 4)) for _ in range(50)]:
        words = np.asarray([base, rank, row, phase], np.int64).tobytes()
        assert nk.row_seed(base, rank, row, phase) == zlib.crc32(words) & 0x7FFFFFFF


def test_qsgd_rows_draw_with_each_rows_seed():
    """Two rows of equal data get different draws (their seeds differ), each row's the
    per-partition call's with row_seed(base, rank, k, phase); another phase changes them."""
    part = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    x = np.concatenate([part, part])
    fmt = nk.QSGDFormat(500, 3)
    a = np.zeros((2, fmt.nbytes), np.uint8)
    b = np.zeros_like(a)
    nk.compress_qsgd_rows(x, a, levels=3, row_seeds=(9, 1, 1))
    nk.compress_qsgd_rows(x, b, levels=3, row_seeds=(9, 1, 2))
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a, b)
    for k in range(2):
        p = nk.compress_qsgd(part, levels=3, seed=nk.row_seed(9, 1, k, 2))
        assert np.array_equal(p.buffer, b[k])


@pytest.mark.parametrize("name, kw", CODECS, ids=[f"{n}-{kw}" for n, kw in CODECS])
@pytest.mark.parametrize("rows", [2, 3, 4])
@pytest.mark.parametrize("res", [False, True], ids=["plain", "error-feedback"])
def test_row_form_of_a_tensor_the_rows_do_not_divide(name, kw, rows, res):
    """x short of rows equal partitions (P = ceil(len / rows)) by 1 to rows - 1 elements,
    down to partitions wholly past its end: the bytes and residuals of the per-partition calls
    on x zero-padded, and the decode up to x's end (nothing written past it)."""
    for part in (1, 2, 250, 1001):
        for short in range(1, rows):
            length = rows * part - short
            if -(-length // rows) != part:       # that length has shorter partitions
                continue
            x, e = _case(name, kw, rows, part, res)
            x[length:] = 0
            fmt = row_format(name, kw, part)
            lmat, rmat = row_matrix(rows, fmt), row_matrix(rows, fmt)
            le, re_ = (None, None) if e is None else (e.copy(), e.copy())
            partition_loop(name, kw, x.copy(), le, lmat)
            assert row_form(name, kw, x[:length].copy(), re_, rmat) == fmt
            what = (name, kw, rows, length)
            assert np.array_equal(lmat, rmat), what
            if res:
                assert np.array_equal(le, re_), what
            out = np.full(length + 1, np.nan, np.float32)
            assert nk.decompress_rows(rmat, fmt, out=out[:length], col=COL).size == length
            assert np.array_equal(out[:length], loop_decode(fmt, lmat)[:length]), what
            assert np.isnan(out[length]), what


def test_row_form_arguments_are_checked():
    x = np.zeros(12, np.float32)
    with pytest.raises(LayoutError, match=r"residual must be float32\[15\]"):
        # 12 elements over 5 rows: partitions of 3, so the residual covers 15
        nk.compress_minmax_rows(x, np.zeros((5, 64), np.uint8), residual=np.zeros(12, np.float32))
    with pytest.raises(LayoutError, match="short of that by up to 4"):
        # rows of 3 elements decode to 15, and out may end at most 4 short (a 12-element x)
        nk.decompress_rows(np.zeros((5, 64), np.uint8), nk.MinMaxFormat(3),
                           out=np.zeros(10, np.float32))
    with pytest.raises(PayloadError, match="multiple of 8"):
        nk.compress_minmax_rows(x, np.zeros((3, 60), np.uint8))
    with pytest.raises(PayloadError, match="column"):
        nk.compress_minmax_rows(x, np.zeros((3, 64), np.uint8), col=4)
    with pytest.raises(PayloadError, match="column"):
        nk.compress_minmax_rows(x, np.zeros((3, 16), np.uint8), col=8)   # 16 bytes don't fit
    with pytest.raises(PayloadError, match="rows, width"):
        nk.compress_minmax_rows(x, np.zeros(64, np.uint8))
    with pytest.raises(PayloadError, match="C-contiguous"):
        nk.compress_minmax_rows(x, np.zeros((3, 128), np.uint8)[:, ::2])
    with pytest.raises(LayoutError, match="residual"):
        nk.compress_onebit_rows(x, np.zeros((3, 64), np.uint8), residual=np.zeros(6, np.float32))
    with pytest.raises(PayloadError, match="no row form"):
        nk.decompress_rows(np.zeros((2, 8), np.uint8), nk.CastFormat(2))
    with pytest.raises(LayoutError, match="decodes to"):
        nk.decompress_rows(np.zeros((2, 16), np.uint8), nk.OneBitFormat(5),
                           out=np.zeros(5, np.float32))
