"""Payload formats: sizes, offsets, alignment, parameter validation."""
import numpy as np
import pytest

import numba_kernels as nk
from numba_kernels.wire import Section


@pytest.mark.parametrize("fmt, nbytes, sections", [
    (nk.CastFormat(5, "fp16"), 16, [("half", 0, 5)]),
    (nk.MinMaxFormat(1025, 8, 1024), 16 + 1028 + 4, [("params", 0, 4), ("codes", 16, 257)]),
    (nk.MinMaxFormat(1025, 3, 32), 8 * 33 + 4 * 97 + 4, [("params", 0, 66), ("codes", 264, 97)]),
    (nk.QSGDFormat(33, 127, 32), 8 + 33 + 7, [("norms", 0, 2), ("codes", 8, 33)]),
    (nk.OneBitFormat(33, 32), 8 + 8, [("scales", 0, 2), ("signs", 8, 2)]),
    (nk.TopKFormat(1000, 3, "int32"), 24, [("indices", 0, 3), ("values", 12, 3)]),
    (nk.TopKFormat(1000, 3, "int64"), 40, [("indices", 0, 3), ("values", 24, 3)]),
])
def test_layout(fmt, nbytes, sections):
    assert fmt.nbytes == nbytes
    assert [(s.name, s.offset, s.count) for s in fmt.sections()] == sections
    for s in fmt.sections():
        assert s.offset % np.dtype(s.dtype).itemsize == 0
    assert fmt.nbytes % nk.ALIGN == 0
    assert fmt.used_nbytes <= fmt.nbytes


@pytest.mark.parametrize("fmt", [nk.CastFormat(0), nk.MinMaxFormat(0), nk.QSGDFormat(0),
                                 nk.OneBitFormat(0), nk.TopKFormat(0, 0)])
def test_empty_formats_have_no_bytes(fmt):
    assert fmt.nbytes == 0


def test_compression_ratios():
    n = 10**7
    assert nk.CastFormat(n).ratio == pytest.approx(2.0)
    assert nk.MinMaxFormat(n, 8, 1024).ratio == pytest.approx(4 / (1 + 8 / 1024), rel=1e-4)
    assert nk.MinMaxFormat(n, 4, 1024).ratio == pytest.approx(8 / (1 + 16 / 1024), rel=1e-4)
    assert nk.OneBitFormat(n, 4096).ratio == pytest.approx(32 / (1 + 32 / 4096), rel=1e-4)
    assert nk.TopKFormat(n, n // 1000, "int32").ratio == pytest.approx(500.0)


@pytest.mark.parametrize("make, message", [
    (lambda: nk.MinMaxFormat(10, 0), "bits"),
    (lambda: nk.MinMaxFormat(10, 9), "bits"),
    (lambda: nk.MinMaxFormat(10, 8, 48), "multiple of 32"),
    (lambda: nk.MinMaxFormat(10, 8, 0), "chunk"),
    (lambda: nk.QSGDFormat(10, 0), "levels"),
    (lambda: nk.QSGDFormat(10, 128), "levels"),
    (lambda: nk.QSGDFormat(2**31, 127, 1), "2147483648 chunks, more than 2147483647; "
                                            "use a chunk of at least 2"),
    (lambda: nk.OneBitFormat(10, 100), "multiple of 32"),
    (lambda: nk.TopKFormat(10, 11), "k must be"),
    (lambda: nk.TopKFormat(2**31, 1, "int32"), "int64"),
    (lambda: nk.TopKFormat(10, 1, "int16"), "index_dtype"),
    (lambda: nk.CastFormat(10, "fp8"), "kind"),
    (lambda: nk.MinMaxFormat(-1), "n must be"),
    (lambda: nk.MinMaxFormat(10, 8.0), "integer"),
])
def test_bad_parameters_name_the_value(make, message):
    with pytest.raises(nk.KernelParameterError, match=message):
        make()


def test_payload_checks_its_buffer():
    fmt = nk.MinMaxFormat(100, 8, 64)
    nk.Payload(fmt, np.zeros(fmt.nbytes, np.uint8))
    with pytest.raises(nk.PayloadError, match="shape"):
        nk.Payload(fmt, np.zeros(fmt.nbytes + 8, np.uint8))
    with pytest.raises(nk.PayloadError, match="uint8"):
        nk.Payload(fmt, np.zeros(fmt.nbytes // 4, np.float32))
    with pytest.raises(nk.PayloadError, match="format"):
        nk.Payload("minmax", np.zeros(8, np.uint8))


def test_views_cover_the_sections():
    fmt = nk.OneBitFormat(100, 64)
    buf = np.arange(fmt.nbytes, dtype=np.uint8)
    v = fmt.views(buf)
    assert v["scales"].dtype == np.float32 and v["scales"].size == 2
    assert v["signs"].dtype == np.uint32 and v["signs"].size == 4
    assert np.shares_memory(v["signs"], buf)
    assert Section("a", 0, np.dtype(np.uint32), 3).nbytes == 12
