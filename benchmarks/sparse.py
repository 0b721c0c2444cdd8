"""Sparse and adaptive compression: gTop-k's O(k log P) bytes, and L-GreCo against uniform.

Bytes per rank per step of dense allreduce, Top-k and gTop-k as P grows (counted from message
sizes, so P up to 16 fits on one machine):

    python benchmarks/sparse.py --bytes 2,4,8,16 --markdown benchmarks/results/sparse_bytes.md

L-GreCo against the uniform 4-bit setting on an MLP with very different layer sizes, same steps:
final loss, bytes per step, compression ratio, step time, and the share of time its decisions
took:

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/sparse.py --lgreco --markdown F

Time per step on a shaped link: ``benchmarks/algorithms.py --sweep 1 --algorithms
gradient_allreduce,topk,gtopk``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time


def inner_bytes(args) -> None:
    import torch
    from mpi4py import MPI

    import bagua_mpi as bm

    bm.init()
    bm.set_consistency_check(False)
    rows = {}
    for name, algo in (("dense", "gradient_allreduce"),
                       ("topk", bm.algorithms.TopK(density=args.density)),
                       ("gtopk", bm.algorithms.GTopK(density=args.density))):
        torch.manual_seed(0)
        model = torch.nn.Linear(args.numel // 8, 8, bias=False)
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      algorithm=algo, bucket_size_mb=1024)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, args.numel // 8)).square().sum().backward()
            opt.step()
        per_rank = opt.communication_stats()["bytes_per_step"]
        rows[name] = MPI.COMM_WORLD.allreduce(per_rank, op=MPI.MAX)
        opt.close()
    if bm.rank() == 0:
        with open(args.json, "w") as fh:
            json.dump(rows, fh)
    bm.shutdown()


def bytes_sweep(args) -> str:
    sizes = [int(p) for p in args.bytes.split(",")]
    results = {}
    for p in sizes:
        path = f"/tmp/bagua_sparse_{os.getpid()}_{p}.json"
        subprocess.run(["mpiexec", "-n", str(p), sys.executable, __file__, "--inner-bytes",
                        "--json", path, "--numel", str(args.numel), "--density",
                        str(args.density)], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", BAGUA_MPI_KERNEL_THREADS="1"))
        with open(path) as fh:
            results[p] = json.load(fh)
    k = max(1, round(args.density * args.numel))
    lines = [f"gradient of {args.numel / 1e6:.1f}M float32, density {args.density} (k = {k}, "
             f"int32 indices: {8 * k} bytes a payload); most bytes any rank sends per step",
             "", "| P | dense MB | Top-k KB | gTop-k KB | Top-k / (k pairs) | gTop-k / (k pairs) "
             "| log2 P |", "|---|---|---|---|---|---|---|"]
    for p in sizes:
        r = results[p]
        lines.append(f"| {p} | {r['dense'] / 1e6:.2f} | {r['topk'] / 1e3:.1f} | "
                     f"{r['gtopk'] / 1e3:.1f} | {r['topk'] / (8 * k):.1f} | "
                     f"{r['gtopk'] / (8 * k):.1f} | {math.log2(p):.1f} |")
    return "\n".join(lines)


def lgreco_run(args) -> None:
    import torch
    from mpi4py import MPI

    import bagua_mpi as bm
    from bagua_mpi.lgreco import LGreCo

    bm.init()
    bm.set_consistency_check(False)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    rows = []
    for label, algo in (("float32", "gradient_allreduce"),
                        ("uniform 4-bit", bm.algorithms.ByteGrad(bits=4, error_feedback=True)),
                        ("uniform 8-bit", bm.algorithms.ByteGrad(bits=8, error_feedback=True)),
                        ("L-GreCo (default 4)", LGreCo(family="minmax", default=4,
                                                       warmup_steps=args.steps // 5,
                                                       period_steps=args.steps // 5))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
                                    torch.nn.Linear(1024, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 512), torch.nn.Tanh(),
                                    torch.nn.Linear(512, 1))
        teacher = torch.nn.Linear(1024, 1)
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                      named_parameters=model.named_parameters(), algorithm=algo)
        g = torch.Generator().manual_seed(rank)
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            x = torch.randn(32, 1024, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), teacher(x).detach()).backward()
            opt.step()
        elapsed = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        xe = torch.randn(512, 1024, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            loss = float(torch.nn.functional.mse_loss(model(xe), teacher(xe)))
        stats = opt.communication_stats()
        dp = getattr(opt.impl, "decision_seconds", 0.0)
        dp = world.allreduce(dp, op=MPI.MAX)
        assignment = dict(getattr(opt.impl, "assignment", {}))
        opt.close()
        rows.append((label, loss, world.allreduce(stats["bytes_per_step"], op=MPI.MAX),
                     elapsed / args.steps, dp / elapsed, assignment))
    if rank == 0:
        dense = rows[0][2]
        lines = [f"MLP 1024-1024-64-512-1 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M"
                 f" parameters), {world.Get_size()} ranks, {args.steps} steps, SGD lr 0.05",
                 "", "| variant | final loss | KB/rank/step | ratio vs float32 | step ms | "
                 "decision share |", "|---|---|---|---|---|---|"]
        for label, loss, b, step, share, _ in rows:
            lines.append(f"| {label} | {loss:.5f} | {b / 1e3:.1f} | {dense / b:.1f}x | "
                         f"{step * 1e3:.1f} | {share * 100:.2f}% |")
        lines.append("")
        lines.append(f"L-GreCo's last assignment (bits per parameter tensor): {rows[-1][5]}")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write(text + "\n")
    bm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", help="comma-separated world sizes for the bytes sweep")
    parser.add_argument("--inner-bytes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lgreco", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    if args.inner_bytes:
        inner_bytes(args)
    elif args.lgreco:
        lgreco_run(args)
    elif args.bytes:
        text = bytes_sweep(args)
        print(text)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write(f"Command: `python benchmarks/sparse.py --bytes {args.bytes}`\n\n"
                         + text + "\n")
    else:
        parser.error("choose --bytes P1,P2,... or --lgreco")


if __name__ == "__main__":
    main()
