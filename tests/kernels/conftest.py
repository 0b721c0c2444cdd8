"""Shared fixtures of the kernel tests."""
import numpy as np
import pytest


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
