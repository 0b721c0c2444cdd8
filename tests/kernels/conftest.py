"""Shared fixtures of the kernel tests."""
import numpy as np
import pytest


@pytest.fixture
def grid_selection(monkeypatch):
    """Every top-k selection and merge on the grid path (7 and 10 launches), as above
    ONE_BLOCK_KEYS keys: with the limit at 0 the small tensors of the simulator tests take it.
    (Imported here only when used: the simulator must be on before numba.cuda is imported.)"""
    from numba_kernels._cuda import select
    monkeypatch.setattr(select, "ONE_BLOCK_KEYS", 0)


@pytest.fixture
def rng():
    return np.random.default_rng(20240601)


def data(rng, n, dtype, scale=1.0):
    """A reproducible float tensor with a mix of magnitudes and signs."""
    return (rng.standard_normal(n) * scale).astype(dtype)


def assert_ef_identity(x, e_old, xhat, e_new):
    """x + e_old == xhat + e_new up to float32 rounding of the values involved."""
    c = x.astype(np.float64) + e_old.astype(np.float64)
    got = xhat.astype(np.float64) + e_new.astype(np.float64)
    atol = 4 * np.finfo(np.float32).eps * (np.abs(c).max() if c.size else 0.0)
    np.testing.assert_allclose(got, c, rtol=0, atol=atol)
