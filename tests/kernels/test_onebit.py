"""1-bit compression: CPU twin against NumPy, payload size, sign agreement, feedback."""
import numpy as np
import pytest

import numba_kernels as nk
from conftest import assert_ef_identity, data
from kernel_refs import DTYPES, SIZES, ceil_div, onebit_scales, onebit_signs


@pytest.mark.parametrize("scale", ["l2", "mean_abs"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_numpy(scale, dtype, n, rng):
    x = data(rng, n, dtype)
    p = nk.compress_onebit(x, chunk=1024, scale=scale)
    nc = ceil_div(n, 1024)
    assert p.nbytes == -(-(4 * nc + 4 * ceil_div(n, 32)) // 8) * 8
    v = p.views()
    np.testing.assert_array_equal(v["signs"].view(np.uint8), onebit_signs(x))
    np.testing.assert_allclose(v["scales"], onebit_scales(x, 1024, scale), rtol=2e-6)
    np.testing.assert_array_equal(p.buffer[p.format.used_nbytes:], 0)
    xhat = nk.decompress(p)
    expect = np.where(x.astype(np.float32) < 0, -1, 1) * np.repeat(v["scales"], 1024)[:n]
    np.testing.assert_array_equal(xhat, expect.astype(np.float32))


def test_signs_agree_and_size(rng):
    x = data(rng, 10**5, np.float32)
    x[::7] = 0.0
    p = nk.compress_onebit(x, chunk=4096)
    xhat = nk.decompress(p)
    nz = x != 0
    assert (np.sign(xhat[nz]) == np.sign(x[nz])).all()
    assert (xhat[~nz] > 0).all()          # zero counts as non-negative
    # 32 signs per word plus one float32 scale per chunk
    assert p.nbytes == 4 * 25 + 4 * 3125
    assert p.format.ratio == pytest.approx(4 * 10**5 / p.nbytes)


def test_whole_tensor_scale_is_one_bit_adam(rng):
    x = data(rng, 10000, np.float32)
    p = nk.compress_onebit(x, chunk=10016)      # one chunk: ||x||_2 / sqrt(n)
    scale = p.views()["scales"]
    assert scale.size == 1
    expect = np.linalg.norm(x.astype(np.float64)) / np.sqrt(x.size)
    np.testing.assert_allclose(scale[0], expect, rtol=2e-6)


@pytest.mark.parametrize("scale", ["l2", "mean_abs"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 1025, 10**6])
def test_error_feedback_identity(scale, dtype, n, rng):
    x = data(rng, n, dtype)
    e_old = data(rng, n, dtype, scale=0.5)
    e = e_old.copy()
    p = nk.compress_onebit(x, chunk=512, scale=scale, residual=e)
    assert_ef_identity(x, e_old, nk.decompress(p), e)
    np.testing.assert_array_equal(p.buffer,
                                  nk.compress_onebit(x + e_old, chunk=512, scale=scale).buffer)


def test_bad_scale_name():
    with pytest.raises(nk.KernelParameterError, match="scale"):
        nk.compress_onebit(np.ones(4, np.float32), scale="max")
