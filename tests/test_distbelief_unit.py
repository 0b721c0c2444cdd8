"""Single-process tests of the DistBelief pieces: layout, update rules, vector programs, the
vector-free L-BFGS two-loop against a NumPy reference, the line search, the portion scheduler
(with fake workers), the wire format, and the torch bridges."""
import heapq
import math

import numpy as np
import pytest
import torch
from mpi4py import MPI
from numpy.testing import assert_allclose

from bagua_mpi import distbelief as db
from bagua_mpi.distbelief.parameter_server.protocol import HEADER_BYTES, Endpoint, Op, pack
from bagua_mpi.distbelief.parameter_server.roles import plan_roles
from bagua_mpi.distbelief.parameter_server.vector_ops import G, X, s_slot, y_slot


# -- layout and roles --------------------------------------------------------------------------

@pytest.mark.parametrize("numel,shards", [(1, 1), (10, 3), (7, 7), (100, 8), (1001, 4)])
def test_layout_is_balanced_and_covers_everything(numel, shards):
    layout = db.ShardLayout(numel, shards)
    sizes = [layout.shard_size(k) for k in range(shards)]
    assert sum(sizes) == numel and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger shards first
    assert layout.bounds[0] == 0 and layout.bounds[-1] == numel
    vec = np.arange(numel, dtype=np.float32)
    pieces = layout.split(vec)
    assert np.array_equal(np.concatenate(pieces), vec)
    pieces[0][0] = -1  # views, not copies
    assert vec[0] == -1


def test_layout_overlap_and_the_shards_a_worker_needs():
    layout = db.ShardLayout(10, 3)  # [0,4) [4,7) [7,10)
    assert layout.shards_overlapping(0, 10) == [0, 1, 2]
    assert layout.shards_overlapping(3, 5) == [0, 1]
    assert layout.shards_overlapping(4, 7) == [1]
    assert layout.overlap(1, 3, 5) == (4, 5)
    assert layout.overlap(2, 0, 7) is None
    assert layout.check_range(None) == (0, 10)
    assert layout.check_range((2, 9)) == (2, 9)


@pytest.mark.parametrize("args,match", [((0, 1), "numel"), ((5, 0), "n_shards"),
                                        ((3, 4), "at most 3 servers"), ((True, 1), "numel")])
def test_layout_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        db.ShardLayout(*args)


def test_layout_rejects_bad_dtype_range_and_vector():
    with pytest.raises(TypeError, match="float32 or float64"):
        db.ShardLayout(4, 2, dtype=np.int32)
    layout = db.ShardLayout(4, 2)
    for bad in ((2, 2), (-1, 3), (0, 5)):
        with pytest.raises(ValueError, match="param_range"):
            layout.check_range(bad)
    with pytest.raises(ValueError, match="4 parameters"):
        layout.split(np.zeros(5))


def test_role_plans():
    assert plan_roles(4, 1) == ((3,), (0, 1, 2), None)
    assert plan_roles(5, 2, coordinator=True) == ((3, 4), (1, 2), 0)
    assert plan_roles(4, server_ranks=[0, 2]) == ((0, 2), (1, 3), None)
    assert plan_roles(4, server_ranks=[0], coordinator=True) == ((0,), (2, 3), 1)
    for args, kwargs in [((1, 1), {}), ((2, 1), {"coordinator": True}), ((3, 0), {}),
                         ((3,), {"server_ranks": [3]}), ((3,), {"server_ranks": [1, 1]})]:
        with pytest.raises(ValueError):
            plan_roles(*args, **kwargs)



class _ServerRoles:
    """Just enough of ``Roles`` for the checks a shard makes before its first message."""

    is_server, rank, role, n_partitions = True, 3, "server", 1

    def __init__(self, coordinator=None):
        self.coordinator = coordinator


def test_shard_server_is_the_kind_its_optimizer_names():
    layout = db.ShardLayout(4, 1)
    made = db.ShardServer.__new__(db.ShardServer, _ServerRoles(), layout, db.Adagrad())
    assert type(made) is db.DownpourShardServer
    made = db.ShardServer.__new__(db.ShardServer, _ServerRoles(0), layout, None)
    assert type(made) is db.SandblasterShardServer
    assert issubclass(db.DownpourShardServer, db.ShardServer)
    assert issubclass(db.SandblasterShardServer, db.ShardServer)
    # the checks run before any message, with the messages of the single class they replace
    with pytest.raises(TypeError, match="optimizer must be distbelief.Adagrad"):
        db.ShardServer(_ServerRoles(), layout, "adagrad")
    with pytest.raises(ValueError, match="Sandblaster .optimizer=None. needs setup"):
        db.ShardServer(_ServerRoles(), layout, None)
    with pytest.raises(ValueError, match="Sandblaster .optimizer=None. needs setup"):
        db.ShardServer(_ServerRoles(0), layout, db.SGD())
    with pytest.raises(TypeError, match="no update rule"):
        db.SandblasterShardServer(_ServerRoles(0), layout, db.SGD())

# -- update rules ------------------------------------------------------------------------------

def test_adagrad_matches_the_formula_and_torch():
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(50)
    grads = [rng.standard_normal(50) for _ in range(20)]
    opt = db.Adagrad(lr=0.1, eps=1e-10)
    w, state = w0.copy(), opt.init_state(50, np.float64)
    ref_w, ref_acc = w0.copy(), np.zeros(50)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    torch_opt = torch.optim.Adagrad([p], lr=0.1, eps=1e-10)
    for g in grads:
        opt.apply(w, g, state, 0, 50)
        ref_acc += g * g
        ref_w -= 0.1 * (g / (np.sqrt(ref_acc) + 1e-10))
        p.grad = torch.from_numpy(g.copy())
        torch_opt.step()
    assert_allclose(w, ref_w, rtol=0, atol=0)  # the same operations: bit for bit
    assert_allclose(state["accumulator"], ref_acc, rtol=0, atol=0)
    assert_allclose(w, p.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_update_rules_touch_only_the_pushed_window():
    for opt in (db.Adagrad(lr=0.5, initial_accumulator=0.1), db.SGD(lr=0.5)):
        w = np.ones(10)
        state = opt.init_state(10, np.float64)
        opt.apply(w, np.full(3, 2.0), state, 4, 7)
        assert np.all(w[:4] == 1) and np.all(w[7:] == 1) and np.all(w[4:7] < 1)
        if state:
            assert_allclose(state["accumulator"], [0.1] * 4 + [4.1] * 3 + [0.1] * 3)
    w = np.ones(4)
    db.SGD(lr=0.25).apply(w, np.full(4, 2.0), {}, 0, 4)
    assert_allclose(w, 0.5)


@pytest.mark.parametrize("kwargs", [{"lr": 0}, {"lr": -1.0}, {"lr": math.inf}, {"eps": 0},
                                    {"initial_accumulator": -1.0}, {"lr": True}])
def test_update_rules_validate(kwargs):
    with pytest.raises(ValueError):
        db.Adagrad(**kwargs)


# -- vector programs ---------------------------------------------------------------------------

def test_programs_against_numpy():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(7), rng.standard_normal(7)
    store = db.SlotStore(7, np.float64)
    store.slots[0], store.slots[1] = a.copy(), b.copy()
    prog = db.Program()
    prog.copy(2, 0).scale(2, 3.0).axpy(2, -2.0, 1)          # 3a - 2b
    prog.lincomb(3, 0.5, 0, 4.0, 1)                          # 0.5a + 4b
    prog.lincomb(0, 2.0, 0, 1.0, 1)                          # a <- 2a + b (aliasing)
    i = prog.dot(2, 3)
    j = prog.dot(0, 0)
    prog.zero(1)
    res = store.run(prog.array())
    assert_allclose(store.slots[2], 3 * a - 2 * b)
    assert_allclose(store.slots[3], 0.5 * a + 4 * b)
    assert_allclose(store.slots[0], 2 * a + b)
    assert np.all(store.slots[1] == 0)
    assert_allclose(res[i], (3 * a - 2 * b) @ (0.5 * a + 4 * b))
    assert_allclose(res[j], (2 * a + b) @ (2 * a + b))


def test_programs_reject_bad_input():
    store = db.SlotStore(3, np.float64)
    with pytest.raises(db.DistBeliefError, match="read before it was written"):
        store.run(db.Program().copy(1, 0).array())
    with pytest.raises(db.DistBeliefError, match="unknown vector operation"):
        store.run(np.array([[99, 0, 0, 0, 0, 0]], dtype=np.float64))
    with pytest.raises(db.DistBeliefError, match=r"\(n, 6\)"):
        store.run(np.zeros((2, 5)))
    store.slots[X] = np.zeros(3)
    with pytest.raises(db.DistBeliefError, match="shard server"):
        store.run(db.Program().begin_eval(X, 0).array())


# -- L-BFGS ------------------------------------------------------------------------------------

def two_loop_reference(g, S, Y):
    """Nocedal & Wright Algorithm 7.4 on explicit vectors (oldest pair first): returns H g."""
    q = g.copy()
    alphas = []
    for s, y in reversed(list(zip(S, Y))):
        a = (s @ q) / (s @ y)
        q -= a * y
        alphas.append(a)
    if S:
        q *= (S[-1] @ Y[-1]) / (Y[-1] @ Y[-1])
    for (s, y), a in zip(zip(S, Y), reversed(alphas)):
        b = (y @ q) / (s @ y)
        q += (a - b) * s
    return q


def random_pairs(rng, k, n):
    A = rng.standard_normal((n, n))
    H = A @ A.T + n * np.eye(n)  # SPD, so y = H s has s.y > 0
    S = [rng.standard_normal(n) for _ in range(k)]
    return S, [H @ s for s in S]


@pytest.mark.parametrize("k", [0, 1, 2, 5, 10])
def test_vector_free_two_loop_equals_the_numpy_reference(k):
    rng = np.random.default_rng(k)
    n = 30
    S, Y = random_pairs(rng, k, n)
    g = rng.standard_normal(n)
    basis = np.array(S + Y + [g])
    coef = db.two_loop_coefficients(basis @ basis.T, k)
    assert_allclose(coef @ basis, two_loop_reference(g, S, Y), rtol=1e-10, atol=1e-12)


def test_two_loop_rejects_a_wrong_gram_shape():
    with pytest.raises(ValueError, match=r"\(5, 5\)"):
        db.two_loop_coefficients(np.eye(3), 2)


def test_history_on_two_fake_shards_gives_the_reference_direction():
    """The coordinator's path without MPI: Gram entries from programs on two shard stores."""
    rng = np.random.default_rng(7)
    n, m = 20, 3
    S, Y = random_pairs(rng, 5, n)
    g = rng.standard_normal(n)
    shards = [db.SlotStore(len(part), np.float64) for part in np.array_split(np.zeros(n), 2)]
    cut = [0, shards[0].size, n]

    def run(prog):
        return sum(st.run(prog.array()) for st in shards)

    hist = db.History(m)
    for k, st in enumerate(shards):
        st.slots[G] = g[cut[k]:cut[k + 1]].copy()
    for s, y in zip(S, Y):  # five pairs through a memory of three: the ring reuses slots
        slot = hist.next_slot()
        for k, st in enumerate(shards):
            st.slots[s_slot(slot)] = s[cut[k]:cut[k + 1]].copy()
            st.slots[y_slot(slot)] = y[cut[k]:cut[k + 1]].copy()
        hist.push(slot)
        prog, pairs = db.Program(), []
        for u in (s_slot(slot), y_slot(slot), G):
            for v in hist.vectors():
                pairs.append((u, v, prog.dot(u, v)))
        res = run(prog)
        for u, v, i in pairs:
            hist.set_dot(u, v, res[i])
    assert len(hist.order) == m
    prog = db.Program()
    terms = hist.direction_terms()
    prog.zero(2)
    for slot, c in terms:
        prog.axpy(2, c, slot)
    run(prog)
    d = np.concatenate([st.slots[2] for st in shards])
    assert_allclose(d, -two_loop_reference(g, S[-m:], Y[-m:]), rtol=1e-10, atol=1e-12)


def test_wolfe_search_accepts_a_point_meeting_both_conditions():
    # f(x) = x^4 - 3x^2 + x along d = 1 from x = 0 (g = 1, so descend with d = -1).
    def f(t):
        x = -t
        return x ** 4 - 3 * x ** 2 + x, -(4 * x ** 3 - 6 * x + 1)
    f0, gd0 = f(0.0)
    for t0 in (1e-4, 1.0, 100.0):
        ls = db.WolfeSearch(f0, gd0, t0)
        while (verdict := ls.update(*f(ls.t))) == "continue":
            pass
        assert verdict == "accept"
        ft, gdt = f(ls.t)
        assert ft <= f0 + 1e-4 * ls.t * gd0 and gdt >= 0.9 * gd0


def test_wolfe_search_fails_and_validates():
    ls = db.WolfeSearch(0.0, -1.0, max_trials=5)
    verdicts = [ls.update(1.0, -1.0) for _ in range(5)]  # never any decrease
    assert verdicts == ["continue"] * 4 + ["fail"]
    with pytest.raises(ValueError, match="descend"):
        db.WolfeSearch(0.0, 0.5)
    with pytest.raises(ValueError, match="c1"):
        db.WolfeSearch(0.0, -1.0, c1=0.95, c2=0.9)


# -- portion scheduler -------------------------------------------------------------------------

def test_scheduler_hands_out_every_portion_once_with_affinity():
    sched = db.PortionScheduler(8, ["a", "b"])
    assert sched.next_task("a") == (0, False)
    assert sched.next_task("b") == (4, False)  # workers start spread over the batch
    assert sched.next_task("a") == (1, False)  # then continue where they were
    for p, w in [(0, "a"), (4, "b"), (1, "a")]:
        assert sched.complete(w, p)
    got = []
    while (task := sched.next_task("b")) is not None and not task[1]:
        got.append(task[0])
        sched.complete("b", task[0])
    assert got == [5, 6, 7, 2, 3]
    assert sched.done and sched.stats.backups_issued == 0
    assert sched.stats.won == {"a": 2, "b": 6}


def test_scheduler_backup_copy_wins_and_the_straggler_is_discarded():
    sched = db.PortionScheduler(3, ["slow", "fast"], max_copies=2)
    assert sched.next_task("slow") == (0, False)
    assert sched.next_task("fast") == (1, False)
    sched.complete("fast", 1)
    assert sched.next_task("fast") == (2, False)
    sched.complete("fast", 2)
    assert sched.next_task("fast") == (0, True)  # nothing left: a backup copy of 0
    assert sched.next_task("fast") is None  # it already holds 0; nothing else outstanding
    assert sched.complete("fast", 0) is True
    assert sched.done
    assert sched.complete("slow", 0) is False  # the straggler's answer arrives later
    st = sched.stats
    assert (st.backups_issued, st.backups_won, st.duplicates) == (1, 1, 1)
    assert st.won == {"fast": 3} and st.computed == {"fast": 3, "slow": 1}
    assert st.backup_share == pytest.approx(1 / 3)


def test_scheduler_backups_prefer_fewest_copies_then_oldest_and_respect_the_cap():
    sched = db.PortionScheduler(3, ["a", "b", "c", "d"], max_copies=2)
    for w in "abc":
        sched.next_task(w)  # a:0, b:1 (or next), c:2
    held = {w: p for w, p in zip("abc", sorted(sched.outstanding()))}
    assert sched.next_task("d") == (0, True)  # all have one copy: the oldest issue
    assert sched.next_task("a") == (1, True)  # 0 has two copies now: the next oldest
    assert sched.outstanding() == [0, 1, 2]
    assert held == {"a": 0, "b": 1, "c": 2}
    assert db.PortionScheduler(1, ["a", "b"], max_copies=1).next_task("a") == (0, False)
    one = db.PortionScheduler(1, ["a", "b"], max_copies=1)
    one.next_task("a")
    assert one.next_task("b") is None  # max_copies=1: no backup tasks at all


def test_scheduler_reissues_the_portions_of_a_lost_worker():
    sched = db.PortionScheduler(4, ["a", "b"])
    sched.next_task("a")  # 0
    sched.next_task("b")  # 2
    sched.next_task("a")  # 1
    assert sched.next_task("b") == (3, False)
    assert sched.next_task("b") == (0, True)  # b holds a backup of a's portion 0
    assert sched.worker_lost("a") == [1]  # 0 still runs on b; 1 goes back to the pool
    assert sched.next_task("b") == (1, False)
    sched.abandon("b", 0)
    assert sched.next_task("b") == (0, False)
    for p in (0, 1, 2, 3):
        sched.complete("b", p)
    assert sched.done


def simulate(speeds, n_portions, batches, max_copies=2):
    """Discrete-event run of fake workers: a portion takes ``speeds[w]`` time units
    (``math.inf``: the worker stalls forever on its first portion)."""
    total = db.SchedulerStats()
    clock = 0.0
    for _ in range(batches):
        sched = db.PortionScheduler(n_portions, list(speeds), max_copies)
        events, seq = [], 0
        idle = list(speeds)
        while not sched.done:
            for w in list(idle):
                task = sched.next_task(w)
                if task is not None:
                    idle.remove(w)
                    heapq.heappush(events, (clock + speeds[w], seq, w, task[0]))
                    seq += 1
            assert events, "deadlock: nobody is working and the batch is not done"
            clock, _, w, p = heapq.heappop(events)
            if clock == math.inf:
                break
            sched.complete(w, p)
            idle.append(w)
        assert sched.done
        total.add(sched.stats)
        # stalled workers stay stalled: keep them out of the next batches
        speeds = {w: s for w, s in speeds.items() if s != math.inf}
    return total


def test_fake_workers_faster_do_more_and_a_stalled_one_cannot_block_a_batch():
    stats = simulate({"fast": 1.0, "mid": 2.0, "slow": 5.0, "stalled": math.inf},
                     n_portions=40, batches=3)
    assert stats.portions == 120
    assert stats.won["fast"] > stats.won["mid"] > stats.won["slow"]
    assert "stalled" not in stats.won
    assert stats.backups_won >= 1  # the stalled worker's portion came from a backup copy
    no_backup = db.PortionScheduler(4, ["a", "b"], max_copies=1)
    no_backup.next_task("a")
    for _ in range(3):
        p, _ = no_backup.next_task("b")
        no_backup.complete("b", p)
    assert no_backup.next_task("b") is None and not no_backup.done  # without backups: stuck


def test_scheduler_validates():
    for args in ((0, ["a"]), (3, ["a"], 0), (True, ["a"])):
        with pytest.raises(ValueError):
            db.PortionScheduler(*args)
    with pytest.raises(ValueError, match="out of range"):
        db.PortionScheduler(2, ["a"]).complete("a", 5)


# -- reports, wire format, torch bridges -------------------------------------------------------

def test_staleness_summary():
    report = db.ServerReport(0, 0, 10, {}, {}, 0, np.array([5, 3, 0, 2]), {}, {}, {})
    s = report.staleness_summary()
    assert s == {"pushes": 10, "mean": 0.9, "p50": 0.0, "p90": 3.0, "max": 3.0}
    empty = db.ServerReport(0, 0, 0, {}, {}, 0, np.zeros(0, np.int64), {}, {}, {})
    assert empty.staleness_summary()["pushes"] == 0


def test_messages_round_trip_through_mpi():
    ep = Endpoint(MPI.COMM_SELF)
    payload = np.arange(5, dtype=np.float32)
    buf = pack(Op.PUSH, 7, -2, 3, payload=payload)
    assert buf.nbytes == HEADER_BYTES + payload.nbytes
    ep.send(0, buf)
    m = ep.recv(source=0)
    assert (m.source, m.op, m.a, m.b, m.c) == (0, Op.PUSH, 7, -2, 3)
    assert np.array_equal(m.data(np.float32), payload)
    ep.wait([])
    assert ep.pending == 0 and ep.try_recv() is None
    ep.send(0, pack(Op.BYE))
    assert ep.recv().payload.nbytes == 0
    ep.progress()  # retire the completed send (an MPI request must not outlive MPI)
    assert ep.pending == 0


def test_flat_parameters_and_the_model_step_fn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    flat = db.flat_parameters(model, np.float64)
    assert flat.shape == (21,)
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def loss_fn(m, step):
        return torch.nn.functional.mse_loss(m(x), y)
    step_fn = db.model_step_fn(model, loss_fn)
    shifted = flat + 0.1
    loss, grad = step_fn(shifted, 0)
    assert_allclose(db.flat_parameters(model, np.float64), shifted, rtol=1e-6)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    db.load_flat(ref, shifted)
    ref_loss = loss_fn(ref, 0)
    ref_loss.backward()
    ref_grad = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).numpy()
    assert loss == pytest.approx(ref_loss.item())
    assert_allclose(grad, ref_grad, rtol=1e-6)
    with pytest.raises(ValueError, match="21 trainable"):
        db.load_flat(model, np.zeros(20))
