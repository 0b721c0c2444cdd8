"""Step time and bytes per step of every algorithm, and the network trade-off (BAGUA Fig. 7).

Plain run, on whatever network MPI uses (shared memory on one machine):

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/algorithms.py

Bandwidth sweep (root; Linux network namespaces and tc): each point runs the ranks inside a
fresh network namespace whose loopback is shaped with ``tc tbf``, with MPICH forced onto TCP
over that loopback (``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=lo
MPIR_CVAR_NOLOCAL=1``; without the first, the mpich wheel uses UCX and bypasses the shaper).
The shaped loopback is one link that all ranks' traffic shares:

    python benchmarks/algorithms.py --sweep 10,2.5,1,0.5 --out benchmarks/results

writes ``algorithms_sweep.md`` (table) and ``algorithms_sweep.png`` (step time against
bandwidth). Latency is not swept: it needs the netem qdisc, which not every kernel has
(``--latency-ms`` adds it where it exists). The namespace and its shaping are
``shaped_link.py``'s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from shaped_link import one_rank_per_node, shaped_link

ALGORITHMS = ["gradient_allreduce", "gradient_allreduce+fp16", "qsgd", "bytegrad",
              "onebit_adam", "decentralized", "low_precision_decentralized", "local_sgd",
              "async"]


def inner(args) -> None:
    """Run under mpiexec: time every algorithm on the same model and data."""
    import torch
    from mpi4py import MPI

    import bagua_mpi as bm
    from bagua_mpi.algorithms import AsyncModelAverage, GTopK, LocalSGD, OneBitAdam, TopK

    bm.init()
    bm.set_consistency_check(False)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1024, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    rows = []
    for name in args.algorithms.split(","):
        torch.manual_seed(0)
        blocks, width = [], 1024
        for _ in range(args.layers):
            blocks += [torch.nn.Linear(width, args.hidden), torch.nn.ReLU()]
            width = args.hidden
        model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))
        n_params = sum(p.numel() for p in model.parameters())
        algo, compression = name, "none"
        if name.endswith("+fp16"):  # the algorithm with 16-bit words on the wire
            algo, compression = name.removesuffix("+fp16"), "fp16"
        elif name == "onebit_adam":
            algo = OneBitAdam(warmup_steps=args.warmup)
        elif name == "local_sgd":
            algo = LocalSGD(period=4)
        elif name == "async":
            algo = AsyncModelAverage(sync_interval_ms=100)
        elif name in ("topk", "gtopk") and args.density:
            algo = (GTopK if name == "gtopk" else TopK)(density=args.density)
        base = (torch.optim.Adam(model.parameters(), lr=1e-4) if name == "onebit_adam"
                else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        opt = bm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                      algorithm=algo, compression=compression,
                                      bucket_size_mb=args.bucket_mb)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        # profiling iteration, 1-bit Adam's warm-up, then two steps so that kernels compiled
        # on first use (the compressed stage's) are not timed
        for _ in range(args.warmup + 2):
            step()
        before = opt.communication_stats()["bytes_sent"]
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        elapsed = world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / args.steps
        sent = (opt.communication_stats()["bytes_sent"] - before) / args.steps
        opt.close()
        sent = world.allreduce(sent, op=MPI.MAX)
        rows.append({"algorithm": name, "step_s": elapsed, "bytes_per_step": sent,
                     "params": n_params})
        if rank == 0:
            print(f"{name:30s} step {elapsed * 1e3:9.1f} ms   sent/rank/step "
                  f"{sent / 1e6:9.2f} MB", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh)
    bm.shutdown()


def shaped_run(gbit: float | None, latency_ms: float, args, json_path: str) -> list[dict]:
    """Run ``inner`` in a fresh network namespace with a shaped loopback (None: unshaped).
    Every rank is its own node there (``one_rank_per_node``), as on a cluster with one rank per
    node: node-shared buckets would otherwise reduce the dense (and fp16) gradients through
    memory, past the link and past the fp16 wire."""
    with shaped_link(gbit, latency_ms, burst=args.burst) as link:
        link.run(one_rank_per_node(args.np) + [
            "mpiexec", "-n", str(args.np), sys.executable, __file__, "--inner",
            "--json", json_path, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--batch", str(args.batch), "--algorithms", args.algorithms,
            "--bucket-mb", str(args.bucket_mb), "--density", str(args.density)])
        with open(json_path) as fh:
            return json.load(fh)


def sweep(args) -> None:
    points = [float(v) for v in args.sweep.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for gbit in points:
            print(f"--- {gbit:g} Gbit/s shaped loopback", flush=True)
            results[gbit] = shaped_run(gbit, args.latency_ms, args,
                                       os.path.join(scratch, f"sweep_{gbit:g}.json"))
    names = [r["algorithm"] for r in results[points[0]]]
    params = results[points[0]][0]["params"]
    lines = [f"model: MLP, {params / 1e6:.1f}M parameters; {args.np} ranks, batch {args.batch} "
             f"per rank; TCP over one shaped loopback shared by all ranks"
             + (f", +{args.latency_ms} ms" if args.latency_ms else ""),
             "", "step time in ms (speed-up over gradient_allreduce); MB sent per rank per step",
             "", "| algorithm | MB/step | " + " | ".join(f"{g:g} Gbit/s" for g in points) + " |",
             "|---|---|" + "---|" * len(points)]
    for i, name in enumerate(names):
        cells = []
        for g in points:
            t = results[g][i]["step_s"]
            base = results[g][0]["step_s"]
            cells.append(f"{t * 1e3:.0f} ({base / t:.2f}x)")
        mb = results[points[0]][i]["bytes_per_step"] / 1e6
        lines.append(f"| {name} | {mb:.2f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "algorithms_sweep.md"), "w") as fh:
        fh.write("Command: `python benchmarks/algorithms.py " + " ".join(sys.argv[1:])
                 + f"` (as root; tbf bucket {args.burst}, load average "
                 f"{os.getloadavg()[0]:.1f})\n\n" + text + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install 'bagua_mpi[bench]'): no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors  # more algorithms than the default 10-colour cycle
    for i, name in enumerate(names):
        ax.plot(points, [results[g][i]["step_s"] for g in points], marker="o", label=name,
                color=colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth of the shaped link (Gbit/s)")
    ax.set_ylabel("time per step (s)")
    ax.set_title(f"{params / 1e6:.0f}M-parameter MLP, {args.np} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "algorithms_sweep.png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json")
    parser.add_argument("--sweep", help="comma-separated bandwidths in Gbit/s (needs root)")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed steps (local_sgd averages "
                        "every 4, so keep a multiple of 4)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--density", type=float, default=0.0,
                        help="density of topk/gtopk (0: the algorithms' default, 0.001)")
    parser.add_argument("--burst", default="4mb",
                        help="tc tbf bucket; a small one (128kb) shapes short exchanges too")
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
    else:
        inner(args)


if __name__ == "__main__":
    main()
