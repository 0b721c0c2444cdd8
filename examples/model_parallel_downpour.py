"""Downpour SGD over model-parallel replicas (DistBelief §3 + §4.1), in one mpiexec job.

    mpiexec -n 6 python examples/model_parallel_downpour.py --partitions 2 --servers 2
    mpiexec -n 6 python examples/model_parallel_downpour.py --partitions 2 --servers 2 --by-layers

R = (ranks - servers) / partitions replicas, each cut into ``--partitions`` partitions, and
``--servers`` parameter-server shards (the last ranks). The model is a small locally connected
network on generated 16x16 images (two locally connected layers, then a linear classifier on the
output partition); each partition owns a block of rows of every locally connected layer and
exchanges only the halo rows with its neighbours (``--by-layers``: the same layers cut into a
pipeline instead). Every partition is a Downpour worker for its own parameters: it fetches and
pushes only those, only to the shards that hold them, every ``--n-fetch``/``--n-push`` steps.
Replica 0 trains alone for ``--warm-start`` steps. At the end replica 0 runs inference with the
shards' parameters on held-out images and prints the accuracy.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

import bagua_mpi as bm
from bagua_mpi import distbelief as db

SIZE, CLASSES = 16, 4


def make_layers(by_layers: bool):
    """The whole model, identical on every rank (same seed): each partition keeps its part."""
    torch.manual_seed(0)
    body = [db.LocallyConnected2d(1, 4, (SIZE, SIZE), 3, 1), nn.ReLU(),
            db.LocallyConnected2d(4, 4, (SIZE - 2, SIZE - 2), 3, 2), nn.ReLU()]
    head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, CLASSES))
    if by_layers:
        return body + list(head), None
    return body, head


def quadrant_masks() -> torch.Tensor:
    h = SIZE // 2
    masks = torch.zeros(CLASSES, 1, SIZE, SIZE)
    for q in range(CLASSES):
        r, c = divmod(q, 2)
        masks[q, 0, r * h:(r + 1) * h, c * h:(c + 1) * h] = 1.0
    return masks


def batch_fn_for(replica: int, batch: int):
    """Noise images, one quadrant brighter: the label is which one. The same images on every
    partition of a replica (seeded by replica and step), different ones on each replica."""
    masks = quadrant_masks()

    def fn(step):
        gen = torch.Generator().manual_seed(1000 * replica + step)
        y = torch.randint(0, CLASSES, (batch,), generator=gen)
        x = torch.rand(batch, 1, SIZE, SIZE, generator=gen) + 0.3 * masks[y]
        return x, y
    return fn


def picture(roles: db.Roles, ranges: dict, layout: db.ShardLayout) -> str:
    """The job's layout as text: replicas, partitions, shards, and who talks to whom."""
    lines = []
    for r in range(roles.n_replicas):
        ranks = roles.replica_ranks(r)
        lines.append(f"  replica {r}: " + "  ".join(f"[p{m} rank {w}]"
                                                   for m, w in enumerate(ranks)))
    lines.append("  shards:    " + "  ".join(f"[s{k} rank {s} params {layout.shard_range(k)}]"
                                             for k, s in enumerate(roles.servers)))
    for m in range(roles.n_partitions):
        lo, hi = ranges[roles.workers[m]]
        lines.append(f"  partition {m}: params [{lo}, {hi}) -> shards "
                     f"{layout.shards_overlapping(lo, hi)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05, help="Adagrad lr on the shards")
    parser.add_argument("--n-fetch", type=int, default=2)
    parser.add_argument("--n-push", type=int, default=2)
    parser.add_argument("--warm-start", type=int, default=20)
    parser.add_argument("--by-layers", action="store_true", help="cut into a pipeline")
    args = parser.parse_args()

    bm.init()
    torch.set_num_threads(1)
    roles = db.setup(n_servers=args.servers, n_partitions=args.partitions)
    layers, head = make_layers(args.by_layers)
    model = None
    if roles.is_worker:
        model = (db.PipelineModel(layers, roles.group) if args.by_layers
                 else db.BlockModel(layers, roles.group, head=head))
    mine = np.array([model.numel, *model.param_range] if model else [0, 0, 0], dtype=np.int64)
    table = np.empty((roles.size, 3), dtype=np.int64)
    roles.comm.Allgather(mine, table)
    numel = int(table[roles.workers[0], 0])
    ranges = {w: (int(table[w, 1]), int(table[w, 2])) for w in roles.workers}
    layout = db.ShardLayout(numel, roles.n_servers)
    if bm.rank() == 0:
        print(f"Downpour over {roles.n_replicas} replica(s) x {roles.n_partitions} partition(s), "
              f"{roles.n_servers} shard(s); {numel} parameters; "
              f"{'pipeline' if args.by_layers else 'locally connected blocks'}\n"
              + picture(roles, ranges, layout), flush=True)

    loss_fn = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    if roles.is_server:
        report = db.ShardServer(roles, layout, db.Adagrad(lr=args.lr)).serve()
        final = report.state["slot_0"]
    else:
        inner = model.step_fn(batch_fn_for(roles.replica_index, args.batch), loss_fn)

        def step_fn(params, step):
            loss, grad = inner(params, step)
            if roles.rank == roles.workers[0] and (step % 50 == 0 or step == args.steps - 1):
                print(f"replica 0  step {step:4d}  loss {loss:.4f}", flush=True)
            return loss, grad
        worker = db.DownpourWorker(roles, layout, init=model.flat(), param_range=model.param_range,
                                   n_fetch=args.n_fetch, n_push=args.n_push,
                                   warm_start_steps=args.warm_start)
        report = worker.run(step_fn, args.steps)
        final = None
    elapsed = time.perf_counter() - t0
    vector = roles.gather_vector(layout, final)
    if vector is None:
        vector = np.empty(numel, dtype=layout.dtype)
    roles.comm.Bcast(vector, root=0)

    if roles.is_worker and roles.replica_index == 0:  # inference with the shards' parameters
        model.load_flat(vector)
        x, y = batch_fn_for(99, 512)(0)
        with torch.no_grad():
            out = model(x if (model.partition == 0 or not args.by_layers) else None)
        if model.is_output:
            acc = float((out.argmax(1) == y).float().mean())
            print(f"held-out accuracy {acc:.3f} (chance {1 / CLASSES:.2f}); trained in "
                  f"{elapsed:.1f} s; activation bytes sent by this partition "
                  f"{model.link.bytes_sent}", flush=True)
    if roles.is_server:
        print(f"shard {report.shard}: {report.updates} updates from partitions "
              f"{sorted(w for w, n in report.pushes.items() if n)}", flush=True)
    roles.close()
    bm.shutdown()


if __name__ == "__main__":
    main()
