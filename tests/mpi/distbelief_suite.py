"""DistBelief under a real mpiexec: Downpour SGD and Sandblaster L-BFGS (modes via argv).

    mpiexec -n N python tests/mpi/distbelief_suite.py MODE [ARGS]
    mpiexec -n N python tests/mpi/distbelief_suite.py MODE:ARG MODE:ARG ...   (one job, in order)

Modes (see tests/test_distbelief_mpi.py for the world sizes):
  exact S        1 worker, n_fetch = n_push = 1: bitwise equal to sequential Adagrad and SGD;
                 a run resumed from the shards' state_dict equals the uninterrupted one
  checkpoint S   the same resume, the states going through bagua_mpi.checkpoint (HDF5)
  convex S       several workers, warm start, Adagrad: reaches the stated loss; per-shard update
                 counts equal the pushes received; with S = 2 the last worker uses only shard 0
  robust         one slow worker, one that stops early, one whose step function raises
  silent         a worker goes silent; the shard declares it lost; it stops when it wakes up
  die            a worker process dies: the whole job ends (what does not survive)
  lbfgs S        Sandblaster reaches scipy's L-BFGS-B optimum; then again resumed from states
  stall          Sandblaster with a fast, a slow, and a stalling-then-raising worker
Every rank prints nothing unless a check fails; rank 0 prints one summary line.
"""
import logging
import os
import sys
import time

import numpy as np

import bagua_mpi as bm
from bagua_mpi import distbelief as db

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


# -- problems --------------------------------------------------------------------------------

class LeastSquares:
    """f(w) = mean_i (a_i.w - b_i)^2 / 2 on seeded data; minibatches drawn per (worker, step)."""

    def __init__(self, n=800, d=24, noise=0.1, seed=11, batch=16):
        rng = np.random.default_rng(seed)
        self.A = rng.standard_normal((n, d))
        self.b = self.A @ rng.standard_normal(d) + noise * rng.standard_normal(n)
        self.w_opt = np.linalg.lstsq(self.A, self.b, rcond=None)[0]
        self.batch, self.seed, self.n = batch, seed, n

    def loss(self, w):
        r = self.A @ w - self.b
        return 0.5 * float(r @ r) / self.n

    def step_fn(self, worker: int):
        def fn(w, step):
            idx = np.random.default_rng([self.seed, worker, step]).integers(0, self.n, self.batch)
            r = self.A[idx] @ w - self.b[idx]
            return 0.5 * float(r @ r) / len(idx), self.A[idx].T @ r / len(idx)
        return fn


class Logistic:
    """f(w) = mean_i log(1 + exp(-y_i a_i.w)) + l2/2 |w|^2, y in {-1, 1}; portions of rows."""

    def __init__(self, n=1200, d=12, l2=1e-2, seed=5, n_portions=24):
        rng = np.random.default_rng(seed)
        A = rng.standard_normal((n, d))
        A[:, -1] = 1.0  # bias column
        w_true = rng.standard_normal(d)
        self.y = np.where(rng.random(n) < 1 / (1 + np.exp(-A @ w_true)), 1.0, -1.0)
        self.A, self.n, self.l2, self.n_portions = A, n, l2, n_portions
        self.bounds = np.linspace(0, n, n_portions + 1).astype(int)

    def portion_fn(self, w, p):
        lo, hi = self.bounds[p], self.bounds[p + 1]
        z = self.y[lo:hi] * (self.A[lo:hi] @ w)
        loss = np.logaddexp(0.0, -z).sum()
        coef = -self.y[lo:hi] / (1.0 + np.exp(z))
        return float(loss), self.A[lo:hi].T @ coef

    def f_and_g(self, w):
        loss, grad = self.portion_fn_all(w)
        return loss / self.n + 0.5 * self.l2 * w @ w, grad / self.n + self.l2 * w

    def portion_fn_all(self, w):
        z = self.y * (self.A @ w)
        return np.logaddexp(0.0, -z).sum(), self.A.T @ (-self.y / (1.0 + np.exp(z)))

    def scipy_optimum(self):
        from scipy.optimize import minimize
        res = minimize(self.f_and_g, np.zeros(self.A.shape[1]), jac=True, method="L-BFGS-B",
                       options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 1000})
        return res.x, res.fun


def gather(obj):
    return bm.allgather_object(obj)


def by_rank(reports):
    return {r.rank: r for r in reports if r is not None}


# -- Downpour ----------------------------------------------------------------------------------

def sequential(problem, w0, optimizer, steps):
    """The same training on one process: the reference Downpour must equal bit for bit."""
    w, acc = w0.copy(), np.zeros_like(w0)
    fn = problem.step_fn(0)
    for step in range(steps):
        _, g = fn(w, step)
        if isinstance(optimizer, db.Adagrad):
            acc += g * g
            w -= optimizer.lr * (g / (np.sqrt(acc) + optimizer.eps))
        else:
            w -= optimizer.lr * g
    return w


def downpour_once(roles, layout, problem, w0, optimizer, steps, first_step=0, state=None):
    if roles.is_server:
        server = db.ShardServer(roles, layout, optimizer)
        if state is not None:
            for bad in (dict(state, start=state["start"] + 1), dict(state, format=99),
                        dict(state, slot_0=state["slot_0"][:-1])):
                try:
                    server.load_state_dict(bad)
                except db.DistBeliefError:
                    pass
                else:
                    raise AssertionError(f"load_state_dict accepted a bad state {bad}")
            server.load_state_dict(state)
        return server.serve(), server.params.copy()
    worker = db.DownpourWorker(roles, layout, init=w0)
    report = worker.run(problem.step_fn(0), steps, first_step=first_step)
    return report, worker.params.copy()


def mode_exact(n_servers):
    roles = db.setup(n_servers=n_servers)
    problem = LeastSquares()
    w0 = np.random.default_rng(3).standard_normal(problem.A.shape[1])
    layout = db.ShardLayout(w0.size, n_servers, dtype=np.float64)
    steps = 12
    for optimizer in (db.Adagrad(lr=0.1), db.SGD(lr=0.05)):
        expected = sequential(problem, w0, optimizer, steps)
        report, local = downpour_once(roles, layout, problem, w0, optimizer, steps)
        if roles.is_server:
            lo, hi = layout.shard_range(roles.server_index)
            assert np.array_equal(local, expected[lo:hi]), (optimizer, local, expected[lo:hi])
            assert report.updates == steps == report.pushes[roles.workers[0]], report
            assert report.staleness_counts.tolist() == [steps], report.staleness_counts
            assert report.departures == {roles.workers[0]: "DONE"}, report.departures
            state = report.state
        else:
            assert np.array_equal(local, expected), (optimizer, local - expected)
            assert (report.steps, report.pushes, report.fetches) == (steps, steps, steps + 1)
            assert report.error is None and not report.stopped_by_server
            state = None
        full = roles.gather_vector(layout, local if roles.is_server else None,
                                   root=roles.workers[0])
        if roles.is_worker:
            assert np.array_equal(full, expected)

        # Resume: 5 steps, checkpoint the shards, 7 more on fresh objects from the state.
        report, _ = downpour_once(roles, layout, problem, w0, optimizer, 5)
        state = report.state if roles.is_server else None
        if roles.is_server:
            assert set(state) >= {"slot_0", "updates", "staleness_counts", "pushes"}, set(state)
            assert all(isinstance(v, (int, float, np.ndarray)) for v in state.values()), state
            if isinstance(optimizer, db.Adagrad):
                assert state["opt_accumulator"].shape == state["slot_0"].shape
        zeros = np.zeros_like(w0)  # worker 0's init is replaced by the loaded state
        report, local = downpour_once(roles, layout, problem, zeros, optimizer, 7, first_step=5,
                                      state=state)
        if roles.is_server:
            lo, hi = layout.shard_range(roles.server_index)
            assert np.array_equal(local, expected[lo:hi]), "resumed run differs"
            assert report.updates == steps, report.updates
            assert report.staleness_counts.sum() == steps
        else:
            assert np.array_equal(local, expected), "resumed run differs on the worker"
    roles.close()
    return f"exact OK: {n_servers} shard(s), Adagrad and SGD bitwise equal, resume exact"


def mode_checkpoint(n_servers):
    """Shard states through an HDF5 checkpoint (bagua_mpi.checkpoint, per-rank extras)."""
    import shutil
    import tempfile

    import bagua_mpi.checkpoint as ckpt
    roles = db.setup(n_servers=n_servers)
    problem = LeastSquares()
    w0 = np.random.default_rng(3).standard_normal(problem.A.shape[1])
    layout = db.ShardLayout(w0.size, n_servers, dtype=np.float64)
    optimizer = db.Adagrad(lr=0.1)
    expected = sequential(problem, w0, optimizer, 12)
    directory = bm.broadcast_object(tempfile.mkdtemp() if bm.rank() == 0 else None)
    report, _ = downpour_once(roles, layout, problem, w0, optimizer, 5)
    mine = {"shard": report.state} if roles.is_server else {}
    ckpt.save(directory, step=5, rank_extras=mine, rng=False)
    info = ckpt.load(directory)
    state = info.rank_extras["shard"] if roles.is_server else None
    report, local = downpour_once(roles, layout, problem, np.zeros_like(w0), optimizer, 7,
                                  first_step=5, state=state)
    if roles.is_server:
        lo, hi = layout.shard_range(roles.server_index)
        assert np.array_equal(local, expected[lo:hi]), "resumed from HDF5: differs"
        assert report.updates == 12 and report.staleness_counts.tolist() == [12], report
    else:
        assert np.array_equal(local, expected), "resumed from HDF5: differs on the worker"
    bm.barrier()
    if bm.rank() == 0:
        shutil.rmtree(directory)
    roles.close()
    return f"checkpoint OK: {n_servers} shard state(s) through HDF5, resume bitwise equal"


def sub_model(fn, w_opt, lo, hi):
    """A replica whose model uses only w[lo:hi] (the other weights frozen at their optimum), so
    it needs only the shards holding that range."""
    def sub(w, step):
        full = w_opt.copy()
        full[lo:hi] = w[lo:hi]
        return fn(full, step)
    return sub


def mode_convex(n_servers):
    roles = db.setup(n_servers=n_servers)
    problem = LeastSquares()
    w0 = np.zeros(problem.A.shape[1])
    layout = db.ShardLayout(w0.size, n_servers, dtype=np.float64)
    steps, warm, n_fetch, n_push = 200, 20, 2, 3
    partial = roles.workers[-1] if n_servers > 1 else None
    param_range = layout.shard_range(0) if roles.rank == partial else None
    if roles.is_server:
        report = db.ShardServer(roles, layout, db.Adagrad(lr=0.3)).serve()
        final = report.state["slot_0"]
    else:
        fn = problem.step_fn(roles.worker_index)
        if param_range is not None:
            fn = sub_model(fn, problem.w_opt, *param_range)
        worker = db.DownpourWorker(roles, layout, init=w0, n_fetch=n_fetch, n_push=n_push,
                                   warm_start_steps=warm, param_range=param_range)
        report = worker.run(fn, steps)
        final = None
    reports = gather(report)
    full = roles.gather_vector(layout, final, root=0)
    servers = [reports[r] for r in roles.servers]
    workers = by_rank(reports[r] for r in roles.workers)
    warm_pushes = -(-warm // n_push)
    for s in servers:
        used_by = [w for w in roles.workers if w != partial or s.shard == 0]
        assert sorted(s.pushes) == used_by, (s.shard, s.pushes, used_by)
        for w in used_by:
            assert s.pushes[w] == workers[w].pushes, (s.shard, w, s.pushes, workers[w].pushes)
            assert s.departures[w] == "DONE"
        assert s.updates == sum(s.pushes.values()) == int(s.staleness_counts.sum())
        assert s.first_fetch_updates[roles.workers[0]] == 0
        for w in used_by[1:]:  # released only after worker 0's solo pushes were applied
            assert s.first_fetch_updates[w] >= warm_pushes, (w, s.first_fetch_updates)
    for w in workers.values():
        assert w.steps == steps and w.error is None, w
        assert w.pushes == -(-steps // n_push) + (1 if w.rank == roles.workers[0] and
                                                  warm % n_push else 0), w
    if roles.rank == 0:
        gap = problem.loss(full) - problem.loss(problem.w_opt)
        assert gap < 2e-3, f"loss {problem.loss(full):.5f} is {gap:.2e} above the optimum"
        stale = servers[0].staleness_summary()
        print(f"convex: loss gap {gap:.2e}, staleness {stale}", flush=True)

    # A warm start longer than worker 0's run: its goodbye must release the others.
    short = 10
    if roles.is_server:
        report = db.ShardServer(roles, layout, db.Adagrad(lr=0.3)).serve()
    else:
        fn = problem.step_fn(roles.worker_index)
        if param_range is not None:
            fn = sub_model(fn, problem.w_opt, *param_range)
        worker = db.DownpourWorker(roles, layout, init=w0, warm_start_steps=short + 5,
                                   param_range=param_range)
        report = worker.run(fn, short)
    reports = gather(report)
    for s in (reports[r] for r in roles.servers):
        assert s.first_fetch_updates[roles.workers[0]] == 0
        # held until worker 0's pushes were all applied: the first released worker to fetch sees
        # exactly those, a later one may also see that worker's pushes
        released = [n for w, n in s.first_fetch_updates.items() if w != roles.workers[0]]
        assert not released or min(released) == short, s.first_fetch_updates
        assert s.updates == short * len(s.pushes), s
    roles.close()
    return f"convex OK: {n_servers} shard(s), {roles.n_workers} workers"


def mode_robust():
    """Worker 0 normal, 1 slow, 2 stops after 5 steps, 3 raises at step 7."""
    roles = db.setup(n_servers=1)
    problem = LeastSquares()
    w0 = np.zeros(problem.A.shape[1])
    layout = db.ShardLayout(w0.size, 1, dtype=np.float64)
    fast_steps, slow_steps, slow_sleep = 60, 8, 0.4
    if roles.is_server:
        report = db.ShardServer(roles, layout, db.Adagrad(lr=0.3)).serve()
    else:
        i = roles.worker_index
        base = problem.step_fn(i)
        steps = {0: fast_steps, 1: slow_steps, 2: 5, 3: fast_steps}[i]

        def fn(w, step):
            if i == 1:
                time.sleep(slow_sleep)
            if i == 3 and step == 7:
                raise RuntimeError("deliberate failure in worker 3's step function")
            return base(w, step)
        report = db.DownpourWorker(roles, layout, init=w0).run(fn, steps)
    reports = gather(report)
    server = reports[roles.servers[0]]
    w = [reports[r] for r in roles.workers]
    assert [x.pushes for x in w] == [fast_steps, slow_steps, 5, 7], [x.pushes for x in w]
    assert [server.pushes[r] for r in roles.workers] == [fast_steps, slow_steps, 5, 7]
    assert [server.departures[r] for r in roles.workers] == ["DONE", "DONE", "DONE", "ERROR"]
    assert w[3].error == "RuntimeError: deliberate failure in worker 3's step function", w[3]
    assert w[0].error is w[1].error is w[2].error is None
    # The fast worker finished while the slow one was still at work: nobody waited for it.
    slow_when_fast_left = server.pushes_at_departure[roles.workers[0]][roles.workers[1]]
    assert slow_when_fast_left < slow_steps, server.pushes_at_departure
    roles.close()
    return (f"robust OK: slow worker had {slow_when_fast_left}/{slow_steps} pushes when the "
            f"fast one finished {fast_steps}")


def mode_silent():
    """Worker 2 sleeps past the shard's worker_timeout_s at step 3."""
    roles = db.setup(n_servers=1)
    problem = LeastSquares()
    w0 = np.zeros(problem.A.shape[1])
    layout = db.ShardLayout(w0.size, 1, dtype=np.float64)
    steps = 40
    if roles.is_server:
        report = db.ShardServer(roles, layout, db.SGD(lr=0.05), worker_timeout_s=3.0).serve()
    else:
        i = roles.worker_index
        base = problem.step_fn(i)

        def fn(w, step):
            if i == 2 and step == 3:
                time.sleep(7.0)  # silent: no MPI call for longer than the timeout
            return base(w, step)
        report = db.DownpourWorker(roles, layout, init=w0).run(fn, steps)
    reports = gather(report)
    server = reports[roles.servers[0]]
    w = [reports[r] for r in roles.workers]
    assert [server.departures[r] for r in roles.workers] == ["DONE", "DONE", "LOST"], server
    assert [server.pushes[r] for r in roles.workers] == [steps, steps, 3], server.pushes
    assert [x.pushes for x in w[:2]] == [steps, steps], w
    # On waking, the silent worker may send one more push before it reads the STOP the shard
    # left for it (MPI gives no ordering between the shard's send and the worker's); the shard
    # drops it. Either way its own count and the shard's agree.
    assert server.dropped == w[2].pushes - 3 and w[2].pushes in (3, 4), (server, w[2])
    assert w[2].stopped_by_server and not w[0].stopped_by_server, w
    assert server.updates == 2 * steps + 3, server
    roles.close()
    return "silent OK: the silent worker was declared lost and stopped when it woke up"


def mode_die():
    roles = db.setup(n_servers=1)
    problem = LeastSquares()
    w0 = np.zeros(problem.A.shape[1])
    layout = db.ShardLayout(w0.size, 1, dtype=np.float64)
    if roles.is_server:
        db.ShardServer(roles, layout, db.SGD(lr=0.05)).serve()
    else:
        i = roles.worker_index
        base = problem.step_fn(i)

        def fn(w, step):
            if i == 1 and step == 5:
                os._exit(3)  # the process dies: MPI cannot hide that
            return base(w, step)
        db.DownpourWorker(roles, layout, init=w0).run(fn, 1000)
    return "die: UNEXPECTED, the job survived a dead process"


# -- Sandblaster -------------------------------------------------------------------------------

def sandblaster(roles, layout, problem, fn, **options):
    options = {"l2": problem.l2, "gtol": 1e-9, "max_iter": 200, **options}
    return db.run_sandblaster(roles, layout, fn, problem.n_portions, problem.n,
                              init=np.zeros(layout.numel), **options)


def check_optimum(problem, result, x):
    x_opt, f_opt = problem.scipy_optimum()
    err = np.abs(x - x_opt).max()
    assert err < 1e-5, f"|x - x*|_inf = {err:.2e} (f = {result.f!r}, f* = {f_opt!r})"
    assert abs(result.f - f_opt) < 1e-9, (result.f, f_opt)
    return err


def mode_lbfgs(n_servers):
    roles = db.setup(n_servers=n_servers, coordinator=True)
    problem = Logistic()
    layout = db.ShardLayout(problem.A.shape[1], n_servers, dtype=np.float64)
    out = sandblaster(roles, layout, problem, problem.portion_fn)
    reports = gather(out)
    x = roles.gather_vector(layout, out.state["slot_0"] if roles.is_server else None,
                            root=roles.coordinator)
    result = reports[roles.coordinator]
    assert result.converged, result
    for r in roles.servers:
        assert reports[r].portions_accepted == problem.n_portions * result.evaluations
    done = sum(reports[r].portions for r in roles.workers)
    assert done == result.scheduling.portions + result.scheduling.duplicates, (done, result)
    if roles.is_coordinator:
        err = check_optimum(problem, result, x)
        print(f"lbfgs: {result.iterations} iterations, {result.evaluations} evaluations, "
              f"|x - x*| = {err:.1e}", flush=True)

    # Checkpoint after 3 iterations, resume from the states on fresh objects.
    out = sandblaster(roles, layout, problem, problem.portion_fn, max_iter=3)
    if roles.is_coordinator:
        assert out.iterations == 3 and not out.converged, out
    server_state = out.state if roles.is_server else None
    coordinator_state = out.state if roles.is_coordinator else None
    out = sandblaster(roles, layout, problem, problem.portion_fn, server_state=server_state,
                      coordinator_state=coordinator_state)
    x = roles.gather_vector(layout, out.state["slot_0"] if roles.is_server else None,
                            root=roles.coordinator)
    if roles.is_coordinator:
        assert out.converged and out.iterations > 3, out
        check_optimum(problem, out, x)
    roles.close()
    return f"lbfgs OK: {n_servers} shard(s), optimum of scipy L-BFGS-B reached, resume OK"


def mode_stall():
    """Workers: 0 fast; 1 slow on every portion; 2 stalls 2 s once; 3 raises at its 8th."""
    roles = db.setup(n_servers=1, coordinator=True)
    problem = Logistic()
    layout = db.ShardLayout(problem.A.shape[1], 1, dtype=np.float64)
    calls = {"n": 0}

    def fn(w, p):
        calls["n"] += 1
        i = roles.worker_index
        if i == 1:
            time.sleep(0.03)
        if i == 2 and calls["n"] == 5:
            time.sleep(2.0)  # a straggler: its portion must be finished by a backup copy
        if i == 3 and calls["n"] == 8:
            raise RuntimeError("deliberate failure in worker 3's portion function")
        return problem.portion_fn(w, p)
    out = sandblaster(roles, layout, problem, fn)
    reports = gather(out)
    x = roles.gather_vector(layout, out.state["slot_0"] if roles.is_server else None,
                            root=roles.coordinator)
    result = reports[roles.coordinator]
    stats = result.scheduling
    fast, slow, staller, raiser = roles.workers
    assert result.converged, result
    assert stats.backups_won >= 1, stats
    assert stats.won.get(fast, 0) > stats.won.get(slow, 0), stats.won
    assert reports[staller].portions >= 5 and reports[staller].error is None, reports[staller]
    # the straggler's stalled portion was answered first by someone else (a backup copy)
    assert stats.won.get(staller, 0) < reports[staller].portions, (stats, reports[staller])
    assert reports[raiser].portions == 7, reports[raiser]
    assert reports[raiser].error == \
        "RuntimeError: deliberate failure in worker 3's portion function", reports[raiser]
    assert reports[roles.servers[0]].portions_accepted == problem.n_portions * result.evaluations
    if roles.is_coordinator:
        check_optimum(problem, result, x)
        print(f"stall: won {stats.won}, backups issued {stats.backups_issued}, won "
              f"{stats.backups_won} ({100 * stats.backup_share:.1f}% of portions), duplicates "
              f"{stats.duplicates}, late {stats.late}", flush=True)
    roles.close()
    return "stall OK: every batch completed, fast worker did more, optimum reached"


MODES = {"exact": mode_exact, "checkpoint": mode_checkpoint, "convex": mode_convex, "robust": mode_robust,
         "silent": mode_silent, "die": mode_die, "lbfgs": mode_lbfgs, "stall": mode_stall}


def main():
    """``MODE [INT ...]``, or several ``MODE:INT`` items run one after the other in one job."""
    bm.init()
    if len(sys.argv) > 2 and ":" not in sys.argv[2]:
        runs = [(sys.argv[1], [int(a) for a in sys.argv[2:]])]
    else:
        runs = [(item.split(":")[0], [int(a) for a in item.split(":")[1:]])
                for item in sys.argv[1:]]
    for mode, args in runs:
        summary = MODES[mode](*args)
        bm.barrier()
        if bm.rank() == 0:
            print(f"{summary} on {bm.size()} ranks", flush=True)
    bm.shutdown()


if __name__ == "__main__":
    main()
