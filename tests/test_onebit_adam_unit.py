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


@pytest.mark.parametrize("together", [1 << 24, 3000])  # one list, or several
def test_device_route_matches_the_expression(monkeypatch, together):
    """The route of device parameters (foreach operations over lists of about ``together``
    elements), taken here by host tensors: float32 and float64, under and over a host piece,
    one channels_last, an empty one, v holding +inf: each the same bits as the expression."""
    monkeypatch.setattr(onebit_adam, "_FOREACH_ELEMENTS", together)
    monkeypatch.setattr(onebit_adam, "_together", lambda p: True)
    lists = []
    real = onebit_adam._update_together
    monkeypatch.setattr(onebit_adam, "_update_together",
                        lambda batch, lr, eps: (lists.append(len(batch)), real(batch, lr, eps)))
    g = torch.Generator().manual_seed(7)
    shapes = [(1000,), (7, 3), (HOST_PIECE + 5,), (1,), (2500,), (8, 6, 5, 5), (0,)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32,
              torch.float32, torch.float32]
    slices, wants = [], []
    for shape, dtype in zip(shapes, dtypes):
        p, m = (torch.randn(shape, generator=g, dtype=dtype) for _ in range(2))
        v = torch.rand(shape, generator=g, dtype=dtype) * 1e-3
        v.view(-1)[::13] = float("inf")
        if len(shape) == 4:
            p, m, v = (t.contiguous(memory_format=torch.channels_last) for t in (p, m, v))
        wants.append(plain_update(p, m, v, 3e-3, 1e-8))
        slices.append((p, m, v))
    onebit_adam._frozen_variance_updates_(slices, 3e-3, 1e-8)
    for (p, _, _), want in zip(slices, wants):
        torch.testing.assert_close(p, want, rtol=0, atol=0)
    assert sum(lists) == len(shapes) and (len(lists) == 1) == (together > HOST_PIECE), lists


def test_host_parameters_keep_their_own_update(monkeypatch):
    """Host parameters are updated one at a time (one temporary, reused, in cache), not in
    lists."""
    monkeypatch.setattr(onebit_adam, "_update_together",
                        lambda *args: pytest.fail("host parameters were updated in a list"))
    slices = [(torch.ones(5), torch.ones(5), torch.ones(5)) for _ in range(3)]
    onebit_adam._frozen_variance_updates_(slices, 0.5, 0.0)
    assert all(torch.equal(p, torch.full((5,), 0.5)) for p, _, _ in slices)


@pytest.fixture
def one_rank():
    import bagua_mpi as bm

    bm.init(abort_on_exception=False)
    yield bm
    bm.shutdown()


def test_compressed_stage_launches_do_not_grow_with_the_parameters(one_rank, monkeypatch):
    """``step()`` in the compressed stage dispatches as many operations that compute or copy
    (each a kernel launch or more on a GPU) for 64 parameter tensors as for 4 of the same
    elements, AdamW's decay included: the update takes foreach operations, not four per
    parameter. (The device route, taken here by host tensors; world size 1: the exchange
    moves nothing.)"""
    from dispatch_count import DispatchCount

    monkeypatch.setattr(onebit_adam, "_together", lambda p: True)
    bm = one_rank
    counted = {}
    for tensors in (4, 64):
        params = [torch.nn.Parameter(torch.randn(4096 // tensors,
                                                 generator=torch.Generator().manual_seed(i)))
                  for i in range(tensors)]
        opt = bm.DistributedOptimizer(
            torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
            named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
            algorithm=bm.algorithms.OneBitAdam(warmup_steps=1))
        for _ in range(4):  # the warm-up step, then the compressed stage
            opt.zero_grad()
            sum((p * p).sum() for p in params).backward()
            with DispatchCount() as count:
                opt.step()
        counted[tensors] = (count.launches, count.names)
        opt.close()
    assert counted[64][0] == counted[4][0], (
        f"operations in step(): {counted[4][0]} for 4 tensors, {counted[64][0]} for 64 "
        f"({counted[64][1]})")
