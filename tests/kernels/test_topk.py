"""Top-k and random-k: exact selection, ties, the approximate method, feedback, decoding."""
import numpy as np
import pytest

import numba_kernels as nk
from numba_kernels import _select, topk
from conftest import data
from kernel_refs import DTYPES, SIZES, randk_indices, topk_indices


def check_payload(p, c, idx):
    v = p.views()
    np.testing.assert_array_equal(v["indices"], idx)
    np.testing.assert_array_equal(v["values"], c[idx].astype(np.float32))
    np.testing.assert_array_equal(p.buffer[p.format.used_nbytes:], 0)


@pytest.mark.parametrize("method", ["exact", "approx"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_topk_matches_numpy(method, dtype, n, rng):
    x = data(rng, n, dtype)
    k = max(1, n // 100) if n else 0
    p = nk.compress_topk(x, k, method=method)
    check_payload(p, x, topk_indices(x, k))


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("k", [0, 1, 31, 32, 33, 500, 1000])
def test_every_k(index_dtype, k, rng):
    x = data(rng, 1000, np.float32)
    p = nk.compress_topk(x, k, index_dtype=index_dtype, method="exact")
    assert p.views()["indices"].dtype == np.dtype(index_dtype)
    check_payload(p, x, topk_indices(x, k))


def test_ties_go_to_lower_index():
    # magnitudes 3 at 2, 5, 7 (either sign), 1 elsewhere: k = 2 keeps 2 and 5
    x = np.ones(10, np.float32)
    x[[2, 5, 7]] = [-3.0, 3.0, -3.0]
    assert nk.compress_topk(x, 2).views()["indices"].tolist() == [2, 5]
    # all equal: the first k indices
    assert nk.compress_topk(np.full(50, -2.0, np.float32), 5).views()["indices"].tolist() == \
        [0, 1, 2, 3, 4]


def kth_key_oracle(x, k):
    """(T, r) by sorting: the k-th largest float32 magnitude's bits, and how many of the keys
    equal to it the top k take."""
    keys = np.abs(x.astype(np.float32)).view(np.uint32)
    t = np.sort(keys)[keys.size - k]
    return int(t), int(k - (keys > t).sum())


@pytest.mark.parametrize("kind", ["normal", "ties", "constant", "specials"])
@pytest.mark.parametrize("m", [1, 2, 1000, _select.PARTITION_MAX, _select.PARTITION_MAX + 1,
                               3 * _select.PARTITION_MAX])
def test_kth_key_both_methods(m, kind, rng):
    """Both ways of finding the k-th key (a partition up to PARTITION_MAX keys, radix select
    above) against a sort, every k class: first, a tie run, a middle one, last."""
    x = {"normal": lambda: data(rng, m, np.float32),
         "ties": lambda: rng.integers(-4, 5, m).astype(np.float32),
         "constant": lambda: np.full(m, -0.5, np.float32),
         "specials": lambda: rng.choice(np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45,
                                                  2.0], np.float32), m)}[kind]()
    for k in sorted({1, max(1, m // 7), max(1, m // 2), m}):
        t, r = _select.kth_key(x, m, k)
        assert (int(t), int(r)) == kth_key_oracle(x, k), (m, kind, k)
    k = max(1, m // 7)
    p = nk.compress_topk(x, k, method="exact")
    np.testing.assert_array_equal(p.views()["indices"], topk_indices(x, k))


@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "constant"])
def test_approx_equals_exact_on_large_inputs(kind, rng):
    n, k = 10**6, 1000
    x = {"normal": lambda: data(rng, n, np.float32),
         "ties": lambda: rng.integers(-4, 5, n).astype(np.float32),
         "sparse": lambda: np.where(rng.random(n) < 1e-4, 1.0, 0.0).astype(np.float32),
         "constant": lambda: np.full(n, 0.5, np.float32)}[kind]()
    p = nk.compress_topk(x, k, method="approx")
    check_payload(p, x, topk_indices(x, k))
    np.testing.assert_array_equal(p.buffer, nk.compress_topk(x, k, method="exact").buffer)


def run_approx(x, k):
    m, ks, cap = topk.sample_plan(x.size, k)
    idx = np.empty(k, np.int64)
    val = np.empty(k, np.float32)
    attempts = topk.select_approx(x, x.size, k, m, ks, cap, topk.rng_key(1), idx, val, x, False)
    return attempts, idx


def test_approx_refinement_paths(rng):
    x = data(rng, 10**6, np.float32)
    attempts, idx = run_approx(x, 1000)
    assert attempts == 1                       # the sampled threshold suffices
    np.testing.assert_array_equal(idx, topk_indices(x, 1000))
    # far more ties at the threshold than the candidate buffer holds: every
    # refinement overflows, then the exact fallback runs
    sparse = np.where(rng.random(10**6) < 1e-3, 2.0, 1.0).astype(np.float32)
    attempts, idx = run_approx(sparse, 5000)
    assert attempts == topk.REFINEMENTS + 2
    np.testing.assert_array_equal(idx, topk_indices(sparse, 5000))


@pytest.mark.parametrize("method", ["exact", "approx"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_keeps_unselected(method, dtype, rng):
    n, k = 10**6, 1000
    x = data(rng, n, dtype)
    e_old = data(rng, n, dtype, scale=0.3)
    e = e_old.copy()
    p = nk.compress_topk(x, k, method=method, residual=e)
    c = x + e_old
    idx = topk_indices(c, k)
    check_payload(p, c, idx)
    expect = c.copy()
    expect[idx] = c[idx] - c[idx].astype(np.float32)   # zero for float32
    np.testing.assert_array_equal(e, expect)
    np.testing.assert_array_equal(nk.decompress(p, out=np.zeros(n, dtype)) + e, c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_randk_matches_numpy(dtype, n, rng):
    x = data(rng, n, dtype)
    k = n // 3
    p = nk.compress_randk(x, k, seed=42)
    check_payload(p, x, randk_indices(n, k, 42))


@pytest.mark.parametrize("n, strata", [(2**33, 2**32 - 1), (3_100_000_000, 3_000_000_000),
                                       (2**40 + 3, 7), (1000, 3)])
def test_stratum_bounds_of_sizes_past_int64_products(n, strata):
    """A stratum's bounds are floor(j n / strata) for every j, also where j n passes int64's
    range (random-k of 3e9 elements keeping almost all of them): against Python's integers,
    the offsets h = 0 (the first index) and the largest h (the last)."""
    from numba_kernels._sparse_rules import stratum_position
    for j in (0, 1, strata // 2, strata - 2, strata - 1):
        lo, hi = j * n // strata, (j + 1) * n // strata
        assert stratum_position(0, j, n, strata) == lo, (j, n, strata)
        last = stratum_position(2**32 - 1, j, n, strata)
        assert lo <= last < hi and last == lo + ((2**32 - 1) * (hi - lo) >> 32), (j, n, strata)


def test_randk_refuses_2_32_entries():
    with pytest.raises(nk.KernelParameterError,
                       match="fewer than 2\\^32 entries, got k=4294967296"):
        nk.compress_randk(np.zeros(4, np.float32), 2**32)


def test_randk_is_uniform_stratified_and_seeded():
    """One index per stratum of n/k = 8, each kept with probability k/n: over
    3000 seeds the count per index is Binomial(3000, 1/8), sd about 18; all 64
    stay within 5 sd."""
    n, k, seeds = 64, 8, 3000
    x = np.arange(1, n + 1, dtype=np.float32)
    counts = np.zeros(n)
    for s in range(seeds):
        idx = nk.compress_randk(x, k, seed=s).views()["indices"]
        np.testing.assert_array_equal(idx // 8, np.arange(k))
        counts[idx] += 1
    expected = seeds * k / n
    sd = np.sqrt(seeds * (k / n) * (1 - k / n))
    assert np.abs(counts - expected).max() < 5 * sd
    a = nk.compress_randk(x, k, seed=1).buffer
    np.testing.assert_array_equal(a, nk.compress_randk(x, k, seed=1).buffer)


def test_decode_scatter_and_accumulate(rng):
    x = data(rng, 1000, np.float32)
    p = nk.compress_topk(x, 10)
    idx = p.views()["indices"]
    dense = nk.decompress(p)
    assert (dense[np.setdiff1d(np.arange(1000), idx)] == 0).all()
    np.testing.assert_array_equal(dense[idx], x[idx])
    out = np.ones(1000, np.float64)
    nk.decompress(p, out=out, accumulate=True)
    np.testing.assert_array_equal(out, 1.0 + dense.astype(np.float64))
