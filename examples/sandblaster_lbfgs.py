"""Sandblaster L-BFGS (DistBelief §4.2): batch optimization by a coordinator that holds no
parameters, with gradient work in small portions and backup tasks for stragglers.

    mpiexec -n 4 python examples/sandblaster_lbfgs.py [--servers 1] [--straggler]
    srun --mpi=pmi2 -n 4 python examples/sandblaster_lbfgs.py

Rank 0 coordinates, the last ``--servers`` ranks hold the shards (and the L-BFGS history), the
others compute portions of an L2-regularized logistic regression on generated data. The
coordinator prints f and |g| each iteration, then how the portions were shared out.
``--straggler`` makes the last worker sleep on every portion, to show the backup tasks at work.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import bagua_mpi as bm
from bagua_mpi import distbelief as db


def generate(n: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim))
    x[:, -1] = 1.0  # bias
    w_true = rng.standard_normal(dim) / np.sqrt(dim) * 3
    y = np.where(rng.random(n) < 1 / (1 + np.exp(-x @ w_true)), 1.0, -1.0)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--dim", type=int, default=100)
    parser.add_argument("--portions", type=int, default=64)
    parser.add_argument("--l2", type=float, default=1e-3)
    parser.add_argument("--history", type=int, default=10)
    parser.add_argument("--max-iter", type=int, default=100)
    parser.add_argument("--straggler", action="store_true",
                        help="the last worker sleeps 20 ms on every portion")
    args = parser.parse_args()

    bm.init()
    roles = db.setup(n_servers=args.servers, coordinator=True)
    layout = db.ShardLayout(args.dim, roles.n_servers, dtype=np.float64)
    x, y = generate(args.samples, args.dim)  # each worker could load only its portions instead
    bounds = np.linspace(0, args.samples, args.portions + 1).astype(int)
    slow = args.straggler and roles.is_worker and roles.worker_index == roles.n_workers - 1

    def portion_fn(w, p):
        if slow:
            time.sleep(0.02)
        lo, hi = bounds[p], bounds[p + 1]
        z = y[lo:hi] * (x[lo:hi] @ w)
        return float(np.logaddexp(0.0, -z).sum()), x[lo:hi].T @ (-y[lo:hi] / (1 + np.exp(z)))

    def progress(it, f, gnorm):
        print(f"iteration {it:3d}  f {f:.10f}  |g| {gnorm:.2e}", flush=True)

    if bm.rank() == 0:
        print(f"Sandblaster L-BFGS: coordinator rank {roles.coordinator}, {roles.n_servers} "
              f"shard(s), {roles.n_workers} worker(s); {args.samples} samples x {args.dim} "
              f"features in {args.portions} portions per evaluation", flush=True)
    out = db.run_sandblaster(roles, layout, portion_fn, args.portions, args.samples,
                             init=np.zeros(args.dim), l2=args.l2, history=args.history,
                             max_iter=args.max_iter, gtol=1e-8, callback=progress)
    w = roles.gather_vector(layout, out.state["slot_0"] if roles.is_server else None)
    if roles.is_coordinator:
        st = out.scheduling
        accuracy = float(np.mean(np.sign(x @ w) == y))
        print(f"{out.message}: f {out.f:.10f}, |g| {out.grad_norm:.2e}, {out.iterations} "
              f"iterations, {out.evaluations} evaluations in {out.elapsed_s:.2f} s; training "
              f"accuracy {accuracy:.3f}", flush=True)
        print(f"portions answered first, by worker rank: {dict(sorted(st.won.items()))}; backup "
              f"tasks {st.backups_issued} issued, {st.backups_won} won "
              f"({100 * st.backup_share:.1f}% of portions), {st.duplicates + st.late} "
              f"answers discarded", flush=True)
    roles.close()
    bm.shutdown()


if __name__ == "__main__":
    main()
