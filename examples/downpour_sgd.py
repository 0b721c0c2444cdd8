"""Downpour SGD (DistBelief §4.1): asynchronous training through sharded parameter servers.

    mpiexec -n 4 python examples/downpour_sgd.py [--servers 1] [--steps 300] [--warm-start 30]
    srun --mpi=pmi2 -n 4 python examples/downpour_sgd.py

The last ``--servers`` ranks hold the parameter shards (Adagrad runs there); every other rank is
a model replica training an MLP on its own shard of a generated regression problem (targets from
a fixed random "teacher" network). Worker 0 trains alone for ``--warm-start`` steps, then the
others join. Worker 0 prints its loss as it goes; at the end rank 0 prints the held-out loss of
the shards' parameters, and each shard its update count and staleness.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import bagua_mpi as bm
from bagua_mpi import distbelief as db


def make_model(inputs: int, hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 1))


def data_shard(seed: int, n: int, inputs: int, teacher: torch.nn.Module):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inputs, generator=gen)
    with torch.no_grad():
        y = teacher(x) + 0.05 * torch.randn(n, 1, generator=gen)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300, help="steps per worker")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.03, help="Adagrad lr on the shards")
    parser.add_argument("--n-fetch", type=int, default=2)
    parser.add_argument("--n-push", type=int, default=2)
    parser.add_argument("--warm-start", type=int, default=30, help="worker 0's solo steps")
    args = parser.parse_args()

    bm.init()
    roles = db.setup(n_servers=args.servers)
    torch.manual_seed(0)  # every rank builds the same model and teacher
    model = make_model(args.inputs, args.hidden)
    teacher = make_model(args.inputs, 8)
    init = db.flat_parameters(model)
    layout = db.ShardLayout(init.size, roles.n_servers, dtype=np.float32)
    if bm.rank() == 0:
        print(f"Downpour SGD: {roles.n_servers} shard(s) on ranks {list(roles.servers)}, "
              f"{roles.n_workers} worker(s); {init.size} parameters; n_fetch={args.n_fetch} "
              f"n_push={args.n_push}, warm start {args.warm_start} steps", flush=True)

    step_fn = None
    if roles.is_worker:
        x, y = data_shard(1000 + roles.worker_index, 4096, args.inputs, teacher)

        def loss_fn(m, step):
            rows = torch.randint(0, len(x), (args.batch,),
                                 generator=torch.Generator().manual_seed(step))
            return torch.nn.functional.mse_loss(m(x[rows]), y[rows])
        inner = db.model_step_fn(model, loss_fn)

        def step_fn(params, step):
            loss, grad = inner(params, step)
            if roles.worker_index == 0 and (step % 50 == 0 or step == args.steps - 1):
                print(f"worker 0  step {step:4d}  loss {loss:.5f}", flush=True)
            return loss, grad

    t0 = time.perf_counter()
    report = db.run_downpour(roles, layout, step_fn, args.steps, init=init,
                             optimizer=db.Adagrad(lr=args.lr), n_fetch=args.n_fetch,
                             n_push=args.n_push, warm_start_steps=args.warm_start)
    elapsed = time.perf_counter() - t0
    final = roles.gather_vector(layout, report.state["slot_0"] if roles.is_server else None)
    reports = bm.allgather_object(report)
    if bm.rank() == 0:
        db.load_flat(model, final)
        x_test, y_test = data_shard(7, 2048, args.inputs, teacher)
        with torch.no_grad():
            test_loss = torch.nn.functional.mse_loss(model(x_test), y_test).item()
            base = torch.nn.functional.mse_loss(torch.zeros_like(y_test), y_test).item()
        samples = sum(reports[r].steps for r in roles.workers) * args.batch
        print(f"held-out loss {test_loss:.5f} (predicting 0: {base:.5f}); "
              f"{samples / elapsed:.0f} samples/s over {elapsed:.2f} s", flush=True)
        for r in roles.servers:
            s = reports[r]
            print(f"shard {s.shard}: {s.updates} updates, staleness {s.staleness_summary()}",
                  flush=True)
        for r in roles.workers:
            w = reports[r]
            print(f"worker rank {r}: {w.steps} steps, {w.pushes} pushes, {w.fetches} fetches, "
                  f"waited {w.warm_wait_s:.2f} s for the warm start", flush=True)
    roles.close()
    bm.shutdown()


if __name__ == "__main__":
    main()
