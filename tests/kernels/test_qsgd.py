"""QSGD: CPU twin against the NumPy reference, reproducibility, unbiasedness."""
import numpy as np
import pytest

import numba_kernels as nk
from conftest import assert_ef_identity, data
from kernel_refs import DTYPES, SIZES, chunk_norms, pad8, qsgd_codes


def decode_ref(norms, codes, levels, chunk):
    step = (np.repeat(norms, chunk)[: codes.size] / np.float32(levels)).astype(np.float32)
    return (codes.astype(np.float64) * step).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_numpy(n, dtype, rng):
    x = data(rng, n, dtype)
    p = nk.compress_qsgd(x, levels=127, chunk=1024, seed=11)
    v = p.views()
    # the norm is a float32 sum in a fixed order: equal to the float64 norm to float32 precision
    np.testing.assert_allclose(v["norms"], chunk_norms(x, 1024), rtol=2e-6)
    # given the norms, codes follow exactly from the documented rounding and RNG
    codes = qsgd_codes(x, v["norms"], 127, 1024, 11)
    np.testing.assert_array_equal(v["codes"], codes)
    np.testing.assert_array_equal(p.buffer[p.format.used_nbytes:], 0)
    np.testing.assert_array_equal(nk.decompress(p), decode_ref(v["norms"], codes, 127, 1024))


@pytest.mark.parametrize("levels", [1, 2, 15, 127])
def test_levels_bound_codes(levels, rng):
    x = data(rng, 5000, np.float32)
    codes = nk.compress_qsgd(x, levels=levels, chunk=100, seed=1).views()["codes"]
    assert np.abs(codes.astype(int)).max() <= levels
    assert (np.sign(codes) * np.sign(x) >= 0).all()


def test_long_chunks_match_numpy(rng):
    x = data(rng, 20000, np.float32)
    v = nk.compress_qsgd(x, chunk=9000, seed=2).views()
    np.testing.assert_allclose(v["norms"], chunk_norms(x, 9000), rtol=2e-6)
    np.testing.assert_array_equal(v["codes"], qsgd_codes(x, v["norms"], 127, 9000, 2))


def test_seed_reproducible_and_distinct(rng):
    x = data(rng, 4096, np.float32)
    a = nk.compress_qsgd(x, levels=3, seed=5).buffer
    np.testing.assert_array_equal(a, nk.compress_qsgd(x, levels=3, seed=5).buffer)
    assert not np.array_equal(a, nk.compress_qsgd(x, levels=3, seed=6).buffer)


def z_scores(mean, x, step, trials):
    """Standardised deviation of the empirical mean from x for a two-point quantizer."""
    r = np.abs(x) / step
    p = r - np.floor(r)
    sd = step * np.sqrt(p * (1 - p) / trials)
    keep = p * (1 - p) > 0.01
    return (mean[keep] - x[keep]) / sd[keep]


def test_unbiased():
    """E[Q(x)] = x, as a statistical test.

    T = 4000 independent quantizations of a fixed 512-element vector (4000 copies
    in one tensor, one chunk per copy, so each copy has the same norm and draws
    its own random numbers).  For element i, Q(x_i) takes two values a step apart
    with the rounding probability p_i, so the mean of T draws has standard
    deviation step * sqrt(p_i (1 - p_i) / T) and, T being large, the z-score of
    (mean - x_i) is standard normal if the quantizer is unbiased.  We require
    max |z| < 5.5 (Bonferroni over 512 elements: false alarm rate about 2e-5)
    and |mean z| < 5 / sqrt(count), which detects a systematic bias of about
    0.002 of a step.  Data and seeds are fixed, so the test is deterministic;
    ``test_unbiased_check_rejects_nearest_rounding`` shows it has power.
    """
    n, trials, levels = 512, 4000, 4
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    p = nk.compress_qsgd(np.tile(x, trials), levels=levels, chunk=n, seed=99)
    q = nk.decompress(p).reshape(trials, n).astype(np.float64)
    step = np.float64(p.views()["norms"][0]) / levels
    z = z_scores(q.mean(axis=0), x.astype(np.float64), step, trials)
    assert np.abs(z).max() < 5.5
    assert abs(z.mean()) < 5 / np.sqrt(z.size)


def test_unbiased_check_rejects_nearest_rounding():
    n, trials, levels = 512, 4000, 4
    x = np.random.default_rng(3).standard_normal(n)
    step = np.linalg.norm(x) / levels
    nearest = np.round(x / step) * step          # deterministic, hence biased, rounding
    z = z_scores(nearest, x, step, trials)
    assert np.abs(z).max() > 5.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 1025, 10**6])
def test_error_feedback_identity(dtype, n, rng):
    x = data(rng, n, dtype)
    e_old = data(rng, n, dtype, scale=0.1)
    e = e_old.copy()
    p = nk.compress_qsgd(x, levels=7, chunk=256, seed=4, residual=e)
    assert_ef_identity(x, e_old, nk.decompress(p), e)
    np.testing.assert_array_equal(p.buffer, nk.compress_qsgd(x + e_old, levels=7, chunk=256,
                                                             seed=4).buffer)


def test_zero_chunk_encodes_zero():
    p = nk.compress_qsgd(np.zeros(100, np.float32), chunk=64)
    assert (p.views()["codes"] == 0).all() and (p.views()["norms"] == 0).all()
    np.testing.assert_array_equal(p.buffer, pad8(np.zeros(p.format.used_nbytes, np.uint8)))
    assert (nk.decompress(p) == 0).all()


def level_ref(v, r, u, levels):
    """The level rule in float64 with NumPy's floor: NaN r gives 0, r above levels gives it."""
    with np.errstate(invalid="ignore"):
        lo = np.floor(r.astype(np.float64))
        level = np.where(u < r.astype(np.float64) - lo, lo + 1, lo)
        level = np.where(np.isnan(r), 0.0, np.minimum(level, levels))
    return np.where(v < 0, -level, level)


@pytest.mark.parametrize("compiled", [True, False], ids=["njit", "python"])
def test_level_rule_against_float64(compiled, rng):
    """The float32 floor (add and subtract 2**23) gives the float64 floor's levels for every r
    the encoder can meet: integers and their float32 neighbours, fractions, r past the cap, and
    NaN. The plain-Python rule is what the CUDA simulator runs."""
    from numba_kernels._chunk_rules import qsgd_level, qsgd_level_py
    rule = qsgd_level if compiled else qsgd_level_py
    whole = np.arange(0, 130, dtype=np.float32)
    r = np.concatenate([whole, np.nextafter(whole, np.float32(-1)), np.nextafter(whole, 1e9),
                        rng.uniform(0, 128, 2000).astype(np.float32),
                        np.float32([2.0 ** 23 - 0.5, 2.0 ** 23, 3e9, np.inf, np.nan])])
    r = np.abs(r).astype(np.float32)
    u = rng.uniform(0, 1, r.size).astype(np.float32)
    u[:whole.size] = 0.0   # an integer r must never step up, even for u = 0
    v = np.where(rng.uniform(0, 1, r.size) < 0.5, -1.0, 1.0).astype(np.float32)
    for levels in (1, 7, 127):
        with np.errstate(invalid="ignore"):   # inf - inf in the plain-Python rule's NumPy math
            got = np.array([rule(v[i], r[i], u[i], levels) for i in range(r.size)], np.float64)
        np.testing.assert_array_equal(got, level_ref(v, r, u, levels), err_msg=f"{levels=}")


def test_inf_and_nan_elements_give_zero_codes_for_their_chunk():
    """A chunk holding inf or NaN has an inf or NaN norm, so every r in it is NaN: level 0
    (the old int64 floor gave 0 there too, by way of a NaN conversion)."""
    x = np.ones(64, np.float32)
    x[3], x[40] = np.inf, np.nan
    assert (nk.compress_qsgd(x, chunk=32, seed=1).views()["codes"] == 0).all()
