"""PowerSGD: the primitive against a NumPy simulation of every rank, exact cases, training.

``python powersgd_suite.py [--check NAME]`` on every rank; each check reports its own line.

Each rank builds every rank's gradients from a seed, runs ``powersgd_allreduce_`` for real and
compares with a float64 NumPy simulation of all ranks (orthonormalization by ``np.linalg.qr``
with the signs fixed so that R has a positive diagonal, as Gram-Schmidt gives: an independent
check of the primitive's Gram-Schmidt).
"""
import functools
import sys

import numpy as np
import torch

import bagua_mpi as bm
from bagua_mpi.algorithms import PowerSGD
from bagua_mpi.primitives import LowRankSegment, initial_q, lowrank, powersgd_allreduce_
from bagua_mpi.primitives.lowrank import (orthonormalize, orthonormalize_packed_,
                                          orthonormalize_packed_host_)
from checks import run_suite
from dispatch_count import DispatchCount

# (rows, cols, rank, error feedback, r_max): r < min, r = min with rows < cols and with
# cols < rows, a 1-row matrix, and a segment without error feedback whose Q state is wider
# than its rank (only the first r columns may be used and replaced)
LAYOUT = [(20, 12, 3, True, 3), (7, 30, 7, True, 7), (16, 5, 5, True, 5), (1, 6, 1, True, 1),
          (9, 9, 2, False, 4)]

# Tolerances: torch and NumPy sum float32 matmuls in different orders, MPI sums ranks in its
# own order, and the simulation runs in float64, so the two agree to a few float32 ulps times
# the conditioning of P, compounded over the steps (warm start and error feedback carry it on);
# 1e-5 relative is ~80 ulps (the largest deviation seen at 1-4 ranks was ~1e-6, on Q of the
# full-rank 7 x 30 segment), while any wrong step (a missing scale, transposed Q, error
# after averaging, stale warm start, a 1e-4 error in Q) is far off.
RTOL = 1e-5


def close(got, expected, what):
    expected = np.asarray(expected, dtype=np.float64)
    atol = RTOL * max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), expected, rtol=RTOL,
                               atol=atol, err_msg=what)


def grads(step, j, size, rows, cols):
    return [np.random.default_rng([step, j, r, 41]).standard_normal((rows, cols))
            .astype(np.float32) for r in range(size)]


def orthonormal_reference(p):
    q, r = np.linalg.qr(p)
    return q * np.sign(np.diag(r))


def simulate(ms, q, scale):
    """One PowerSGD step on all ranks (float64); ms: every rank's M_i (gradient + error).
    Returns (result, new Q, every rank's new error)."""
    p_hat = orthonormal_reference(sum(m @ q for m in ms))
    q_own = [m.T @ p_hat for m in ms]
    q_avg = scale * sum(q_own)
    return p_hat @ q_avg.T, q_avg, [m - p_hat @ qi.T for m, qi in zip(ms, q_own)]


def check_against_simulation(rank, size):
    comm = bm.runtime.get().topo.comm
    scale = 1.0 / size
    qs = [initial_q(cols, r_max, 10 + j) for j, (_, cols, _, _, r_max) in enumerate(LAYOUT)]
    errors = [torch.zeros(rows * cols) if ef else None for rows, cols, _, ef, _ in LAYOUT]
    sim_q = [q.double().numpy().copy() for q in qs]
    sim_e = [[np.zeros((rows, cols)) for _ in range(size)] for rows, cols, _, _, _ in LAYOUT]
    checks = 0
    for step in range(4):
        gs = [grads(step, j, size, rows, cols) for j, (rows, cols, _, _, _) in enumerate(LAYOUT)]
        mine = [torch.from_numpy(g[rank].reshape(-1).copy()) for g in gs]
        powersgd_allreduce_([LowRankSegment(m, rows, r, q, e) for m, (rows, _, r, _, _), q, e
                             in zip(mine, LAYOUT, qs, errors)], comm, scale=scale)
        for j, (rows, cols, r, ef, r_max) in enumerate(LAYOUT):
            ms = [g.astype(np.float64) + (sim_e[j][i] if ef else 0) for i, g in enumerate(gs[j])]
            result, q_avg, errs = simulate(ms, sim_q[j][:, :r], scale)
            what = f"segment {j} ({rows}x{cols}, rank {r}, ef={ef}) step {step}"
            close(mine[j].numpy().reshape(rows, cols), result, what + " result")
            sim_q[j][:, :r] = q_avg
            close(qs[j].numpy(), sim_q[j], what + " q")
            if ef:
                sim_e[j] = errs
                close(errors[j].numpy().reshape(rows, cols), errs[rank], what + " error")
            checks += 1
    # columns beyond the rank are never touched
    assert torch.equal(qs[-1][:, 2:], initial_q(9, 4, 10 + len(LAYOUT) - 1)[:, 2:])
    return checks


def allreduce_sum(x: np.ndarray) -> np.ndarray:
    return bm.allreduce(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
                        bm.Sum).numpy()


def check_packed_form(form, p, expected, rank) -> int:
    """``form(*ps)`` (a packed Gram-Schmidt of the P's ``ps``, returning their P^'s) against
    ``orthonormalize``: the exact case ``p`` (``expected``), a nearly dependent column, one
    independent by 1e-6 only, and P's of other shapes packed together."""
    np.testing.assert_allclose(form(p)[0], expected, atol=1e-15)
    ill = np.random.default_rng(rank).standard_normal((40, 3))
    ill[:, 2] = ill[:, 0] - 1e-9 * ill[:, 1]  # nearly dependent: re-orthogonalization matters
    np.testing.assert_allclose(form(ill)[0], orthonormalize(ill), atol=1e-12)
    near = ill.copy()  # independent by 1e-6 only: one pass of Gram-Schmidt is not enough
    near[:, 2] = near[:, 0] + 1e-6 * np.random.default_rng([rank, 9]).standard_normal(40)
    got = form(near)[0]
    np.testing.assert_allclose(got.T @ got, np.eye(3), atol=1e-12)
    np.testing.assert_allclose(got, orthonormalize(near), atol=1e-12)
    others = [np.random.default_rng([rank, k]).standard_normal(shape)  # 63, 33: ill's batch
              for k, shape in enumerate([(7, 2), (1, 1), (25, 4), (63, 3), (33, 2)])]
    for got, x in zip(form(ill, p, *others), [ill, p, *others]):
        np.testing.assert_allclose(got, orthonormalize(x), atol=1e-12)
    return 4


def check_exact_cases(rank, size):
    comm = bm.runtime.get().topo.comm
    checks = 0
    # full rank r = min(n, m): P^ spans the summed matrices' column space, so the result is
    # the plain average. With n <= m, P^ is a basis of R^n and no rank loses anything to error
    # feedback; with n > m each rank's columns stick out of that m-dimensional span (its
    # error is not zero) but the errors sum to zero
    for rows, cols in ((6, 11), (13, 4), (5, 5)):
        r = min(rows, cols)
        gs = grads(7, rows, size, rows, cols)
        mine = torch.from_numpy(gs[rank].reshape(-1).copy())
        err = torch.zeros(rows * cols)
        powersgd_allreduce_([LowRankSegment(mine, rows, r, initial_q(cols, r, 3), err)], comm,
                            scale=1.0 / size)
        close(mine.numpy().reshape(rows, cols), np.mean(gs, axis=0), f"full rank {rows}x{cols}")
        if rows <= cols:
            close(err.numpy(), np.zeros(rows * cols), f"full rank {rows}x{cols}: error")
        else:
            close(allreduce_sum(err.numpy()), np.zeros(rows * cols),
                  f"full rank {rows}x{cols}: errors' sum")
            assert size == 1 or float(err.abs().max()) > 0.1, "a rank-m span of every rank?"
        checks += 1
    # rank-1 data: every rank's M_i = u_i v^T with the same v; rank 1 recovers the average
    # exactly after one step, while each rank's error (its u_i off the common direction) is
    # not zero but the errors sum to zero
    rows, cols = 12, 8
    v = np.random.default_rng(5).standard_normal(cols)
    us = [np.random.default_rng([6, i]).standard_normal(rows) for i in range(size)]
    ms = [np.outer(u, v).astype(np.float32) for u in us]
    mine = torch.from_numpy(ms[rank].reshape(-1).copy())
    q = initial_q(cols, 2, 4)
    err = torch.zeros(rows * cols)
    powersgd_allreduce_([LowRankSegment(mine, rows, 1, q, err)], comm, scale=1.0 / size)
    close(mine.numpy().reshape(rows, cols), np.mean(ms, axis=0), "rank-1 data")
    mean_u = np.mean(us, axis=0)
    np.testing.assert_allclose(np.abs(q[:, 0].numpy()) / np.linalg.norm(q[:, 0].numpy()),
                               np.abs(v) / np.linalg.norm(v), rtol=1e-5, atol=1e-6,
                               err_msg="rank-1 data: warm start Q is not along v")
    close(allreduce_sum(err.numpy()), np.zeros(rows * cols), "rank-1 data: errors' sum")
    off = np.outer(us[rank] - mean_u @ us[rank] / (mean_u @ mean_u) * mean_u, v)
    close(err.numpy().reshape(rows, cols), off, "rank-1 data: this rank's error")
    # ...and at rank 2, P's second column is float32 noise along the first: Gram-Schmidt
    # turns it into some direction orthogonal to the average's, which changes nothing
    mine = torch.from_numpy(ms[rank].reshape(-1).copy())
    q = initial_q(cols, 2, 4)
    powersgd_allreduce_([LowRankSegment(mine, rows, 2, q, None)], comm, scale=1.0 / size)
    close(mine.numpy().reshape(rows, cols), np.mean(ms, axis=0), "rank-1 data at rank 2")
    checks += 2
    # conservation with error feedback, any data: sum_i (M_i - e_i') = result / scale
    rows, cols, r = 10, 14, 3
    gs = grads(9, 0, size, rows, cols)
    e0 = grads(9, 1, size, rows, cols)[rank].reshape(-1)
    err = torch.from_numpy(e0.copy())
    mine = torch.from_numpy(gs[rank].reshape(-1).copy())
    powersgd_allreduce_([LowRankSegment(mine, rows, r, initial_q(cols, r, 8), err)], comm,
                        scale=0.5)
    kept = gs[rank].reshape(-1).astype(np.float64) + e0 - err.numpy()
    close(2.0 * mine.numpy(), allreduce_sum(kept), "error feedback conservation")
    checks += 1
    # zero gradients: zero result, no NaN, the warm start keeps its Q
    q = initial_q(7, 2, 1)
    before = q.clone()
    zero = torch.zeros(35)
    err = torch.zeros(35)
    powersgd_allreduce_([LowRankSegment(zero, 5, 2, q, err)], comm, scale=1.0 / size)
    assert torch.equal(zero, torch.zeros(35)) and torch.equal(err, torch.zeros(35))
    assert torch.equal(q, before), "zero gradient changed the warm start"
    # one zero column of P (Q's second column only sees matrix columns that are zero on
    # every rank): that column of Q is kept, the first one is replaced, the result is the
    # rank-1 projection onto the first column of P^
    gs = grads(4, 4, size, 4, 6)
    for g in gs:
        g[:, 3:] = 0.0
    q = initial_q(6, 2, 2)
    q[:, 1] = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    q0 = q[:, 0].double().numpy().copy()
    mine = torch.from_numpy(gs[rank].reshape(-1).copy())
    powersgd_allreduce_([LowRankSegment(mine, 4, 2, q, None)], comm, scale=1.0 / size)
    p1 = sum(g.astype(np.float64) @ q0 for g in gs)
    p1 /= np.linalg.norm(p1)
    mean = np.mean(gs, axis=0, dtype=np.float64)
    close(mine.numpy().reshape(4, 6), np.outer(p1, p1 @ mean), "zero P column: result")
    close(q[:, 0].numpy(), mean.T @ p1, "zero P column: live column of Q")
    assert torch.equal(q[:, 1], torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])), q
    # zero P columns in several segments of one exchange, at other positions, beside
    # segments without any (one with a Q wider than its rank): each keeps exactly its own
    # dead columns' Q, and takes Q_avg (against NumPy's Gram-Schmidt) in all its others
    layout = [(6, 8, 3, 3, 0), (5, 5, 2, 4, None), (7, 6, 3, 3, 2), (4, 9, 1, 1, 0),
              (3, 4, 2, 2, None)]  # rows, cols, rank, Q's width, the dead column
    segs, olds, expected = [], [], []
    for j, (rows, cols, r, width, dead) in enumerate(layout):
        gs = grads(6, 20 + j, size, rows, cols)
        q = initial_q(cols, width, 30 + j)
        if dead is not None:  # Q's dead column sees only matrix columns zero on every rank
            for g in gs:
                g[:, :2] = 0.0
            q[:, dead] = 0.0
            q[:2, dead] = torch.tensor([1.0, -2.0])
        old = q.clone()
        ms = [g.astype(np.float64) for g in gs]
        p_hat = orthonormalize(sum(m @ old[:, :r].double().numpy() for m in ms))
        q_avg = sum(m.T @ p_hat for m in ms) / size
        live = np.abs(p_hat).max(axis=0) > 0
        assert live.sum() == r - (dead is not None), (j, live)
        want = old.double().numpy().copy()
        want[:, :r] = np.where(live, q_avg, want[:, :r])
        segs.append(LowRankSegment(torch.from_numpy(gs[rank].reshape(-1).copy()), rows, r, q,
                                   torch.zeros(rows * cols) if j % 2 == 0 else None))
        olds.append(old)
        expected.append(want)
    powersgd_allreduce_(segs, comm, scale=1.0 / size)
    for j, (seg, old, want, (_, _, r, _, dead)) in enumerate(zip(segs, olds, expected, layout)):
        close(seg.q.numpy(), want, f"packed zero P columns: segment {j}'s Q")
        if dead is not None:
            assert torch.equal(seg.q[:, dead], old[:, dead]), (j, seg.q[:, dead], old[:, dead])
        assert torch.equal(seg.q[:, r:], old[:, r:]), j
        checks += 1
    # Gram-Schmidt: orthonormal columns in order; exactly dependent and zero columns -> 0
    p = np.array([[3.0, 6.0, 0.0, 1.0], [4.0, 8.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    got = orthonormalize(p)
    expected = np.zeros((3, 4))
    expected[:, 0] = [0.6, 0.8, 0.0]
    expected[:, 3] = np.array([0.64, -0.48, 2.0]) / np.linalg.norm([0.64, -0.48, 2.0])
    np.testing.assert_allclose(got, expected, atol=1e-15)
    assert np.array_equal(p[:, 1], [6.0, 8.0, 0.0])  # the input is not modified
    # the packed forms, many P's at once, give the same columns, alone or packed with others
    # of other shapes: the device form (torch float64, selects instead of branches) and the
    # host form (one compiled loop, float64); both only to roundoff, as their sums run in
    # another order than NumPy's
    def packed_form(orthonormalize_packed, *ps):
        packed = torch.cat([torch.from_numpy(x).reshape(-1) for x in ps])
        live = orthonormalize_packed(packed, tuple(x.shape for x in ps))
        assert live.dtype == torch.bool and live.shape == (sum(x.shape[1] for x in ps),)
        out, start, column = [], 0, 0
        for k, x in enumerate(ps):
            out.append(packed[start:start + x.size].reshape(x.shape).numpy())
            assert np.array_equal(live[column:column + x.shape[1]].numpy(),
                                  np.abs(out[-1]).max(axis=0) > 0), (k, live)
            start += x.size
            column += x.shape[1]
        return out
    for form in (orthonormalize_packed_, orthonormalize_packed_host_):
        checks += check_packed_form(functools.partial(packed_form, form), p, expected, rank)
    # many P's at once on the device route: as many operations that compute or copy (each a
    # kernel launch or more on a GPU) for 64 P's as for 8 (two batches by row count, of rank 4
    # at most, either way)
    counted = {}
    for how_many in (8, 64):
        shapes = tuple((5 + k % 7, 1 + k % 4) for k in range(how_many))
        packed = torch.randn(sum(n * r for n, r in shapes), dtype=torch.float32)
        with DispatchCount() as count:
            orthonormalize_packed_(packed, shapes)
        counted[how_many] = count.launches
    assert counted[64] == counted[8], f"operations by P's: {counted}"
    # an empty list is a no-op on every rank
    powersgd_allreduce_([], comm)
    return checks + 3


def check_operations_per_layer(rank, size):
    """One exchange of 8 and of 64 layers: the layers add at most four operations each (the
    products P_i = M_i Q, Q_i = M_i^T P^, the error's update and the result P^ Q^T); the error
    sums, the orthonormalization on the device and the warm start take a few for all of them
    (each operation a kernel launch or more on a GPU)."""
    comm = bm.runtime.get().topo.comm
    counted = {}
    for layers in (8, 64):
        segs = []
        for j in range(layers):
            rows, cols, r = 4 + j % 5, 6 + j % 3, 1 + j % 2
            segs.append(LowRankSegment(torch.randn(rows * cols), rows, r, initial_q(cols, 2, j),
                                       torch.zeros(rows * cols) if j % 2 else None))
        with DispatchCount() as count:
            powersgd_allreduce_(segs, comm, scale=1.0 / size)
        counted[layers] = count.launches
    assert counted[64] - counted[8] <= 4 * 56, f"operations by layers: {counted}"


def common_memory_layers(layers: int, rank: int, seed: int, device="cpu"):
    """The segments of a bucket as PowerSGD lays them out: ``layers`` (8 x 6) matrices, each
    followed by a bias of 8 in one flat gradient (so at one stride), their Q's end to end and
    their error memories end to end (error feedback on all), with per-rank data; then, in the
    same memories, a (6 x 8) layer (another shape), a rank-1 layer of the first shape (another
    rank), and three more of the first shape, the third after a wider gap (another stride):
    batches of ``layers``, 2 and 1 of the first kind, then 1 and 1. On ``device``."""
    shapes = [(8, 6, 2)] * layers + [(6, 8, 2), (8, 6, 1)] + [(8, 6, 2)] * 3
    gaps = [8] * (layers + 2) + [8, 20, 8]
    flat = torch.from_numpy(np.random.default_rng([seed, rank]).standard_normal(
        sum(n * m + gap for (n, m, _), gap in zip(shapes, gaps))).astype(np.float32)).to(device)
    q_memory = torch.empty(sum(m * 2 for _, m, _ in shapes), device=device)
    errors = torch.from_numpy(np.random.default_rng([seed, rank, 1]).standard_normal(
        sum(n * m for n, m, _ in shapes)).astype(np.float32)).to(device)
    segs, at, q_at, e_at = [], 0, 0, 0
    for j, ((n, m, r), gap) in enumerate(zip(shapes, gaps)):
        q = q_memory[q_at:q_at + m * 2].view(m, 2)
        q.copy_(initial_q(m, 2, j))
        segs.append(LowRankSegment(flat[at:at + n * m], n, r, q, errors[e_at:e_at + n * m]))
        at, q_at, e_at = at + n * m + gap, q_at + m * 2, e_at + n * m
    return segs


def each_in_own_memory(segments):
    """The same segments, each of their tensors cloned into memory of its own (so no two
    batch: each layer takes its own products)."""
    return [LowRankSegment(seg.flat.clone(), seg.rows, seg.rank, seg.q.clone(),
                           seg.error.clone()) for seg in segments]


def check_batches_in_common_memory(rank, size):
    """Layers of one shape and rank whose matrices, Q's and flats each lie at one stride take
    their products as one batch (``_product_batches``), with the bits each layer's own
    products give (the same segments, each cloned into memory of its own, one batch each):
    results, Q's and error memories, over three steps. The operations do not grow with such
    layers: as many for 32 as for 4 (each a kernel launch or more on a GPU)."""
    comm = bm.runtime.get().topo.comm
    batched = common_memory_layers(5, rank, 3)
    _, batches = lowrank._product_batches(batched, [seg.flat.numel() // seg.rows
                                                    for seg in batched])
    assert [b.stop - b.start for b in batches] == [5, 2, 1, 1, 1], batches
    alone = each_in_own_memory(batched)
    _, batches = lowrank._product_batches(alone, [seg.flat.numel() // seg.rows for seg in alone])
    assert all(b.stop - b.start == 1 for b in batches), batches
    for step in range(3):
        for segs in (batched, alone):
            for j, seg in enumerate(segs):
                seg.flat.copy_(torch.from_numpy(grads(step, j, size, seg.rows,
                                                      seg.flat.numel() // seg.rows)[rank])
                               .reshape(-1))
            powersgd_allreduce_(segs, comm, scale=1.0 / size)
        for j, (a, b) in enumerate(zip(batched, alone)):
            for what in ("flat", "q", "error"):
                assert torch.equal(getattr(a, what), getattr(b, what)), (step, j, what)
    counted = {}
    for layers in (4, 32):
        segs = common_memory_layers(layers, rank, 4)
        with DispatchCount() as count:
            powersgd_allreduce_(segs, comm, scale=1.0 / size)
        counted[layers] = count.launches
    assert counted[32] == counted[4], f"operations by layers in common memory: {counted}"


def check_plans_keep_their_batches(rank, size):
    """On the device route, each plan makes its Gram-Schmidt batches' positions once, when it
    is made, and its runs reuse them: 40 plans of their own shapes (a model of 40 buckets; the
    module-wide cache that held these had 32 places, and a GPU then copied every plan's
    positions to the device again each step), each run twice, make them 40 times."""
    comm = bm.runtime.get().topo.comm
    made = []
    original = lowrank.packed_batches

    def counted(shapes, device):
        made.append(shapes)
        return original(shapes, device)
    lowrank.packed_batches = counted
    try:
        plans = []
        for k in range(40):
            rows, cols = 3 + k, 4
            segment = LowRankSegment(torch.zeros(rows * cols), rows, 2, initial_q(cols, 2, k))
            plans.append((lowrank.LowRankExchange([segment]), segment, rows, cols))
        assert len(made) == 40, f"{len(made)} batches made for 40 plans"
        for step in range(2):
            for k, (plan, segment, rows, cols) in enumerate(plans):
                segment.flat.copy_(torch.from_numpy(grads(step, k, size, rows, cols)[rank])
                                   .reshape(-1))
                plan.run(comm, scale=1.0 / size)
        assert len(made) == 40, f"runs made batches again: {len(made) - 40} times in 80 runs"
    finally:
        lowrank.packed_batches = original


def check_bad_input(rank, size):
    comm = bm.runtime.get().topo.comm
    for r in (0, 5, 6):  # 4 x 5 matrix: min(n, m) = 4
        try:
            powersgd_allreduce_([LowRankSegment(torch.zeros(20), 4, r, torch.zeros(5, 6), None)],
                                comm)
        except ValueError as exc:
            assert f"rank={r}" in str(exc) and "4" in str(exc), str(exc)
        else:
            raise AssertionError(f"rank {r} of a 4 x 5 matrix was accepted")
    bad = [dict(flat=torch.zeros(20, dtype=torch.float64)), dict(rows=3),
           dict(q=torch.zeros(4, 2)), dict(q=torch.zeros(5, 1)), dict(error=torch.zeros(19))]
    for change in bad:
        args = dict(flat=torch.zeros(20), rows=4, rank=2, q=torch.zeros(5, 2), error=None)
        args.update(change)
        try:
            powersgd_allreduce_([LowRankSegment(**args)], comm)
        except ValueError:
            pass
        else:
            raise AssertionError(f"accepted {change}")
    for kwargs in (dict(rank=0), dict(rank=2.5), dict(warmup_steps=-1), dict(seed="x"),
                   dict(min_compression=0.5), dict(min_compression=float("nan")),
                   dict(error_feedback=1)):
        try:
            PowerSGD(**kwargs)
        except ValueError as exc:
            value = next(iter(kwargs.values()))
            assert repr(value) in str(exc), (kwargs, str(exc))
        else:
            raise AssertionError(f"PowerSGD({kwargs}) was accepted")


# -- the algorithm --------------------------------------------------------------------------------

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8))


def train(algorithm, rank, steps=80, model=None, opt=None, **options):
    """A small MLP regressing a fixed teacher; returns (global eval loss, model, optimizer)."""
    if model is None:
        model = make_model()
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                      named_parameters=model.named_parameters(),
                                      algorithm=algorithm, **options)
    teacher = torch.nn.Linear(16, 8)
    with torch.no_grad():
        teacher.weight.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(3)))
        teacher.bias.zero_()
    g = torch.Generator().manual_seed(1000 * rank + opt.steps)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), teacher(x).detach()).backward()
        opt.step()
    xe = torch.randn(512, 16, generator=torch.Generator().manual_seed(999))
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(xe), teacher(xe)).item()
    return bm.allreduce(torch.tensor([loss])).item(), model, opt


def params_of(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def check_training(rank, size):
    """PowerSGD trains the MLP to within 25% of gradient_allreduce's loss (rank 2 for weights
    of 32 x 16 and 8 x 32, both compressed at min_compression 2); with error feedback off it
    still learns (at most half the starting loss); every rank ends with the same model."""
    start, _, opt = train("gradient_allreduce", rank, steps=0)
    opt.close()
    dense, _, opt = train("gradient_allreduce", rank)
    opt.close()
    assert dense < 0.2 * start, (dense, start)
    losses = {"dense": dense}
    for label, algo, limit in (
            ("powersgd", PowerSGD(rank=2), 1.25 * dense + 1e-3),
            ("powersgd+warmup", PowerSGD(rank=2, warmup_steps=10), 1.25 * dense + 1e-3),
            ("powersgd-no-ef", PowerSGD(rank=2, error_feedback=False), 0.5 * start)):
        loss, model, opt = train(algo, rank)
        opt.close()
        losses[label] = loss
        assert loss <= limit, f"{label}: loss {loss:.5f} > {limit:.5f} (dense {dense:.5f})"
        if label == "powersgd":
            compressed = sorted(opt.impl.state.tensors["q"])
            assert compressed == ["0.weight", "2.weight"], compressed  # both weights, no bias
        everyone = bm.allgather_object(params_of(model).tolist())
        assert all(p == everyone[0] for p in everyone), f"{label}: models differ between ranks"
    # per-parameter gradients (no flattening) and float64 models (staged through float32)
    # make the same exchange
    flat_loss, flat_model, opt = train(PowerSGD(rank=2), rank, steps=20)
    opt.close()
    loose_loss, loose_model, opt = train(PowerSGD(rank=2), rank, steps=20, flatten=False)
    opt.close()
    assert np.array_equal(params_of(flat_model), params_of(loose_model)), (flat_loss, loose_loss)
    model = make_model().double()
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(),
                                  algorithm=PowerSGD(rank=2))
    teacher_x = torch.randn(32, 16, generator=torch.Generator().manual_seed(rank)).double()
    for _ in range(20):
        opt.zero_grad()
        model(teacher_x).square().mean().backward()
        opt.step()
    opt.close()
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in model.parameters())
    everyone = bm.allgather_object(params_of(model).tolist())  # averaged results came back
    assert all(p == everyone[0] for p in everyone), "float64: models differ between ranks"
    assert opt.impl.wire.bytes_sent > 0 or size == 1
    return losses


def check_first_step(rank, size):
    """The algorithm's first exchange is the simulated PowerSGD of every rank's gradients,
    started from ``initial_q(m, rank, seed + parameter index)``; biases are averaged."""
    model = make_model()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(50 + rank))
    model(x).square().mean().backward()
    local = [p.grad.detach().numpy().copy() for p in model.parameters()]
    everyone = [[np.asarray(a, dtype=np.float32) for a in per_rank]
                for per_rank in bm.allgather_object([a.tolist() for a in local])]
    model = make_model()
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                  named_parameters=model.named_parameters(),
                                  algorithm=PowerSGD(rank=2, seed=7))
    model(x).square().mean().backward()
    opt.step()
    opt.close()
    for layer, p in enumerate(model.parameters()):
        gs = [e[layer] for e in everyone]
        if p.dim() == 1:
            expected = np.mean(gs, axis=0, dtype=np.float64)
        else:
            q = initial_q(p.shape[1], 2, 7 + layer).double().numpy()
            expected = simulate([g.astype(np.float64) for g in gs], q, 1.0 / size)[0]
        close(p.grad.numpy(), expected, f"first step, parameter {layer}")


def check_bytes(rank, size):
    """Bytes per step against dense, from the shapes: a 64 x 256 weight at rank 4 sends
    P (64 x 4) and Q (256 x 4), its 64-element bias goes dense; dense sends all 16448
    (counted as ``WireStats.allreduce`` counts: 2(P-1)/P x the bytes of each allreduce)."""
    if size == 1:
        return None
    per_step = {}
    for algo in ("gradient_allreduce", PowerSGD(rank=4), PowerSGD(rank=4, warmup_steps=2)):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 64)
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      algorithm=algo)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
        label = opt.algorithm.name + ("+warmup" if getattr(algo, "warmup_steps", 0) else "")
        per_step[label] = opt.communication_stats()["bytes_per_step"]
        opt.close()

    def wire(floats):  # WireStats.allreduce of one float32 buffer
        return 2 * (size - 1) * floats * 4 // size

    expected_dense = wire(64 * 256 + 64)
    expected_low = wire(64 * 4) + wire(256 * 4) + wire(64)
    assert per_step["gradient_allreduce"] == expected_dense, per_step
    assert per_step["powersgd"] == expected_low, (per_step, expected_low)
    # warm-up: the first 2 of the 3 steps are dense allreduces
    assert abs(per_step["powersgd+warmup"] * 3 - (2 * expected_dense + expected_low)) < 1e-6, \
        per_step
    ratio = per_step["gradient_allreduce"] / per_step["powersgd"]
    assert ratio >= 0.99 * (64 * 256 + 64) / (64 * 4 + 256 * 4 + 64), ratio  # ~12.2x fewer
    return ratio


def check_state_round_trip(rank, size):
    """state_dict -> load_state_dict, into a fresh optimizer before its first step (applied
    once its buckets exist): continuing both gives the same models, bit for bit."""
    algo = PowerSGD(rank=2, seed=5)
    _, model, opt = train(algo, rank, steps=15)
    state = opt.algorithm_state_dict()
    tensors = state["state"]["tensors"]  # keyed by parameter name, not bucket
    assert set(tensors["q"]) == {"0.weight", "2.weight"} == set(tensors["error"]), tensors
    assert all(isinstance(v, torch.Tensor) for part in ("q", "error")
               for v in tensors[part].values())
    twin = make_model()
    twin.load_state_dict(model.state_dict())
    twin_opt = bm.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.05),
                                       named_parameters=twin.named_parameters(), algorithm=algo)
    twin_opt.load_algorithm_state_dict(state)
    train(algo, rank, steps=10, model=model, opt=opt)
    train(algo, rank, steps=10, model=twin, opt=twin_opt)
    assert np.array_equal(params_of(model), params_of(twin)), "resumed run differs"
    for name in ("q", "error"):
        for k, v in opt.impl.state_dict()["tensors"][name].items():
            assert torch.equal(v, twin_opt.impl.state_dict()["tensors"][name][k]), (name, k)
    # a state of another rank (Q of another width) is refused with a clear error
    other = PowerSGD(rank=3, seed=5)
    _, _, other_opt = train(other, rank, steps=1)
    try:
        other_opt.load_algorithm_state_dict(state)
    except ValueError as exc:
        assert "shape" in str(exc), str(exc)
    else:
        raise AssertionError("a rank-2 state was loaded into rank 3")
    for o in (opt, twin_opt, other_opt):
        o.close()


def on_the_device_route(check):
    """``check`` with the P's orthonormalized as CUDA tensors' are (``orthonormalize_packed_``,
    many layers' at once), here on host tensors."""
    def run(rank, size):
        saved = lowrank._on_device
        lowrank._on_device = lambda buf: True
        try:
            return check(rank, size)
        finally:
            lowrank._on_device = saved
    return run


def suite_checks() -> dict:
    """Every check by name, each reported on its own (``checks.run_suite``); the primitive's
    checks also on the device route (the P's orthonormalized as CUDA tensors' are)."""
    primitive = {"against_simulation": check_against_simulation,
                 "exact_cases": check_exact_cases,
                 "operations_per_layer": check_operations_per_layer,
                 "batches_in_common_memory": check_batches_in_common_memory}
    return {**primitive,
            **{f"{name}_device_route": on_the_device_route(check)
               for name, check in primitive.items()},
            "plans_keep_their_batches": on_the_device_route(check_plans_keep_their_batches),
            "bad_input": check_bad_input, "first_step": check_first_step,
            "training": check_training, "bytes": check_bytes,
            "state_round_trip": check_state_round_trip}


if __name__ == "__main__":
    sys.exit(run_suite(suite_checks()))
