"""L-GreCo's DP against brute force, and the compressor families' measurements."""
import itertools

import numpy as np
import pytest

import numba_kernels as nk
from bagua_mpi.lgreco import MinMaxBits, TopKDensity, solve
from bagua_mpi.primitives.sparse import topk_count


def brute_force(err, cost, e_max, steps):
    """Cheapest assignment whose *discretized* error fits, the DP's exact problem."""
    unit = e_max / steps
    units = np.ceil(err / unit - 1e-9)
    best = None
    for choice in itertools.product(range(err.shape[1]), repeat=err.shape[0]):
        rows = np.arange(err.shape[0])
        if units[rows, choice].sum() <= steps:
            c = cost[rows, choice].sum()
            if best is None or c < best[0] - 1e-12:
                best = (c, choice)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_dp_matches_brute_force_and_respects_budget_and_default(seed):
    rng = np.random.default_rng(seed)
    layers, cands = rng.integers(2, 6), rng.integers(2, 5)
    # more error <-> fewer bytes, as for real compressors; scales differ between layers
    scale = rng.uniform(0.1, 10, size=(layers, 1))
    err = np.sort(rng.uniform(0, 1, size=(layers, cands)), axis=1)[:, ::-1] * scale
    cost = np.sort(rng.integers(1, 1000, size=(layers, cands)), axis=1).astype(float)
    default = int(rng.integers(0, cands))
    e_max = float(err[:, default].sum())
    steps = 200  # small so that brute force over the same discretization is cheap
    sol = solve(err, cost, e_max, default=[default] * layers, steps=steps)
    rows = np.arange(layers)
    assert sol.error <= e_max * (1 + 1e-12)  # never over the uniform default's error
    assert sol.cost <= cost[rows, default].sum()  # never more bytes than the default
    bf = brute_force(err, cost, e_max, steps)
    if sol.from_dp:
        assert bf is not None and abs(sol.cost - bf[0]) < 1e-9, (sol, bf)
    else:  # the default won: nothing in the discrete problem is cheaper
        assert bf is None or bf[0] >= sol.cost - 1e-9


def test_dp_uses_the_budget_where_it_is_cheapest():
    # layer 0 is very sensitive, layer 1 is not: spend precision on layer 0, save on layer 1
    err = np.array([[100.0, 10.0, 1.0], [1.0, 0.5, 0.1]])
    cost = np.array([[1.0, 2.0, 4.0], [10.0, 20.0, 40.0]])
    sol = solve(err, cost, e_max=err[:, 1].sum(), default=[1, 1])
    assert sol.choice == (2, 0) and sol.cost == 14.0 and sol.from_dp


def test_dp_rejects_bad_input():
    with pytest.raises(ValueError, match="one shape"):
        solve(np.zeros((2, 3)), np.zeros((3, 2)), 1.0)
    with pytest.raises(ValueError, match="no assignment"):
        solve(np.full((1, 2), 5.0), np.ones((1, 2)), e_max=1.0)


def test_families_measure_error_and_size():
    g = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    mm = MinMaxBits(default=4)
    assert mm.candidates() == [2, 3, 4, 5, 6, 7, 8]
    errors = [mm.error(g, b) for b in mm.candidates()]
    sizes = [mm.size(g.size, b) for b in mm.candidates()]
    assert all(a > b for a, b in zip(errors, errors[1:]))  # more bits, less error
    assert all(a < b for a, b in zip(sizes, sizes[1:]))  # more bits, more bytes
    tk = TopKDensity(default=0.01)
    cands = tk.candidates()
    assert cands[0] == pytest.approx(0.001) and cands[-1] == pytest.approx(0.1)
    assert len(cands) == 100
    e1, e2 = tk.error(g, 0.01), tk.error(g, 0.05)
    assert e2 < e1 < float(np.sum(g.astype(np.float64) ** 2))
    k = 50  # density 0.01 of 5000
    np.testing.assert_allclose(e1, np.sort(g.astype(np.float64) ** 2)[:-k].sum())


@pytest.mark.parametrize("n", [1, 31, 5000, 70001])
def test_error_tables_equal_one_level_at_a_time(n):
    """The one-pass error tables equal compressing/sorting for each candidate on its own."""
    rng = np.random.default_rng(n)
    g = (rng.standard_t(2, n) * rng.exponential(1.0, n)).astype(np.float32)
    mm = MinMaxBits(default=4, chunk=256)
    for bits, got in zip(mm.candidates(), mm.errors(g, mm.candidates())):
        payload = nk.compress_minmax(g, bits=bits, chunk=256)
        want = float(np.sum((g - nk.decompress(payload)).astype(np.float64) ** 2))
        assert got == pytest.approx(want, rel=1e-12, abs=1e-30), bits
    tk = TopKDensity(default=0.01)
    squares = np.sort(g.astype(np.float64) ** 2)
    for density, got in zip(tk.candidates(), tk.errors(g, tk.candidates())):
        k = topk_count(n, density)
        assert got == pytest.approx(squares[:n - k].sum(), rel=1e-12, abs=1e-30), density


@pytest.mark.parametrize("shape", [(40, 30), (7, 3, 5), (64, 2), (50,)])
def test_powersgd_family_errors_are_one_power_iteration(shape):
    """error(r) equals compressing at rank r alone: one power iteration from the seeded Q,
    ||G - P^ P^^T G||^2; layers that cannot gain are dense (zero error, dense size)."""
    from bagua_mpi.lgreco.families import PowerSGDRank, matrix_shape
    from bagua_mpi.primitives.lowrank import initial_q, orthonormalize

    family = PowerSGDRank(default=4, seed=3)
    assert family.candidates() == [2, 3, 4, 5, 6, 7, 8]
    g = np.random.default_rng(1).standard_normal(int(np.prod(shape))).astype(np.float32)
    rows, cols = matrix_shape(shape)
    m = g.astype(np.float64).reshape(rows, cols)
    got = family.errors(g, family.candidates(), shape)
    top = max([r for r in family.candidates() if family.compressed(shape, r)], default=0)
    for r, err in zip(family.candidates(), got):
        size = family.size(shape, r)
        if not family.compressed(shape, r):
            assert err == 0.0 and size == 4 * rows * cols
            continue
        q0 = initial_q(cols, top, 3).numpy().astype(np.float64)[:, :r]  # the start's prefix
        basis = orthonormalize(m @ q0)
        want = np.square(m - basis @ (basis.T @ m)).sum()
        assert err == pytest.approx(want, rel=1e-9), r
        assert size == 4 * (rows + cols) * r
    compressible = [e for r, e in zip(family.candidates(), got) if family.compressed(shape, r)]
    assert all(a >= b for a, b in zip(compressible, compressible[1:]))  # more rank, less error
    if shape == (50,):
        assert not compressible


def test_lgreco_defaults_are_checked_and_integral_levels_coerced():
    from bagua_mpi.lgreco import LGreCo

    assert LGreCo(family="minmax", default=4.0).default == 4
    assert isinstance(LGreCo(family="powersgd", default=2.0).default, int)
    assert LGreCo(family="topk", default=0.01).default == 0.01
    for family, bad in (("minmax", 9), ("minmax", 2.5), ("powersgd", 0), ("topk", 2.0),
                        ("topk", 0), ("minmax", True)):
        with pytest.raises(ValueError, match=f"the {family} family's default"):
            LGreCo(family=family, default=bad)


def test_topk_family_takes_int64_indices_only_for_a_layer_past_int32(monkeypatch):
    """A layer of 2^31 elements or more (an embedding table on a large GPU) gets int64 payload
    indices, which L-GreCo has no option to ask for; smaller buckets keep int32. The plan's
    arguments are recorded (no 2^31-element tensor is made)."""
    from types import SimpleNamespace

    from bagua_mpi.lgreco import families
    from bagua_mpi.primitives.sparse import index_dtype_for
    assert index_dtype_for([]) == index_dtype_for([5, 2**31 - 1]) == "int32"
    assert index_dtype_for([5, 2**31]) == "int64"
    made = []
    monkeypatch.setattr(families, "GTopKExchange", lambda segments, index_dtype:
                        made.append((len(segments), index_dtype)))
    monkeypatch.setattr(TopKDensity, "residual", lambda self, impl, name: None)
    layer = SimpleNamespace(numel=lambda: 2**31)
    small = SimpleNamespace(numel=lambda: 10)
    impl = SimpleNamespace(assignment={"a": 0.01, "b": 0.01})
    for grads in ([small, small], [small, layer]):
        TopKDensity().plan(impl, SimpleNamespace(names=["a", "b"]), grads)
    assert made == [(2, "int32"), (2, "int64")]
