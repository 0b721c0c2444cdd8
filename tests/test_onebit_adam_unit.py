"""1-bit Adam's compressed-stage update on its own: the same bits as the plain expression."""
import pytest
import torch

from bagua_mpi.algorithms import onebit_adam
from bagua_mpi.algorithms.onebit_adam import _frozen_variance_update_
from bagua_mpi.buffers import HOST_PIECE


def plain_update(p, m, v, lr, eps):
    return p.add(m / (v.sqrt() + eps), alpha=-lr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [1000, HOST_PIECE, 2 * HOST_PIECE + 12345])
def test_update_in_pieces_matches_the_expression(numel, dtype):
    """Below, at and above one piece (a last piece shorter than the others), with v holding
    +inf (an element frozen without gradient) and 0: equal bit for bit, twice in a row."""
    g = torch.Generator().manual_seed(numel)
    p = torch.randn(numel, generator=g, dtype=dtype)
    m = torch.randn(numel, generator=g, dtype=dtype)
    v = torch.rand(numel, generator=g, dtype=dtype) * 1e-3
    v[::97] = float("inf")
    v[5::101] = 0.0
    want = plain_update(p, m, v, 3e-3, 1e-8)
    _frozen_variance_update_(p, m, v, 3e-3, 1e-8)
    torch.testing.assert_close(p, want, rtol=0, atol=0)
    _frozen_variance_update_(p, m, v, 3e-3, 1e-8)
    torch.testing.assert_close(p, plain_update(want, m, v, 3e-3, 1e-8), rtol=0, atol=0)


def test_update_of_a_channels_last_parameter(monkeypatch):
    """A parameter (and its slices of m and v) in channels_last order takes the one-piece
    path, element by element the same as the expression."""
    monkeypatch.setattr(onebit_adam, "HOST_PIECE", 64)   # so that it would take pieces
    g = torch.Generator().manual_seed(1)
    shape = (8, 6, 5, 5)

    def make(values):
        return values.contiguous(memory_format=torch.channels_last)

    p = make(torch.randn(shape, generator=g))
    m = make(torch.randn(shape, generator=g))
    v = make(torch.rand(shape, generator=g))
    want = plain_update(p, m, v, 0.1, 1e-8)
    _frozen_variance_update_(p, m, v, 0.1, 1e-8)
    torch.testing.assert_close(p, want, rtol=0, atol=0)
    assert p.is_contiguous(memory_format=torch.channels_last)
