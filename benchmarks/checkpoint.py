"""Save/load time and file size of checkpoints of a ~23M-parameter MLP with Adam.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/checkpoint.py --dir /tmp/ckpt_bench \\
        --markdown benchmarks/results/checkpoint.md

For each algorithm the model is trained two steps (1-bit Adam with ``warmup_steps=1`` is then
in its compressed stage, with per-rank momenta and error feedback), then saved ``--repeats``
times and loaded as many times. Times are wall-clock on rank 0 between barriers (collective
operations, so every rank waits as long). ``load`` verifies the whole file's SHA-256 on rank 0
before reading; ``load, verify=False`` relies on the fletcher32 sums alone. ``verify`` is the
single-process deep check (``python -m bagua_mpi.checkpoint verify``).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import time

import torch

import bagua_mpi as bm
import bagua_mpi.checkpoint as ckpt


def make_model(inputs: int, hidden: int, layers: int, outputs: int) -> torch.nn.Module:
    blocks, width = [], inputs
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    blocks.append(torch.nn.Linear(width, outputs))
    return torch.nn.Sequential(*blocks)


def timed(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        bm.barrier()
        start = time.perf_counter()
        result = fn()
        bm.barrier()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench(algorithm: str, args) -> dict:
    torch.manual_seed(0)
    model = make_model(1024, args.hidden, args.layers, 10)
    bm.broadcast_parameters(model.state_dict(), root_rank=0)
    spec = bm.algorithms.create("onebit_adam", warmup_steps=1) if algorithm == "onebit_adam" \
        else algorithm
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                  named_parameters=model.named_parameters(), algorithm=spec)
    for step in range(2):
        x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(step * 100 + bm.rank()))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    directory = os.path.join(args.dir, algorithm)
    if bm.rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    bm.barrier()
    save_s, path = timed(lambda: ckpt.save(directory, model=model, optimizer=opt, step=2,
                                           keep=1), args.repeats)
    load_s, info = timed(lambda: ckpt.load(directory, model=model, optimizer=opt),
                         args.repeats)
    load_fast_s, _ = timed(lambda: ckpt.load(directory, model=model, optimizer=opt,
                                             verify=False), args.repeats)
    verify_s = None
    if bm.rank() == 0:
        start = time.perf_counter()
        ckpt.verify(path)
        verify_s = time.perf_counter() - start
    opt.close()
    n_params = sum(p.numel() for p in model.parameters())
    return {"algorithm": algorithm, "params": n_params, "size": os.path.getsize(path),
            "save": save_s, "load": load_s, "load_fast": load_fast_s, "verify": verify_s,
            "trees": info.meta["trees"], "scheme": info.write_scheme,
            "per_rank": info.meta["per_rank_algorithm_state"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory (removed first)")
    parser.add_argument("--algorithms", default="gradient_allreduce,onebit_adam,decentralized")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--markdown", help="write the table here (rank 0)")
    args = parser.parse_args()
    bm.init()
    rows = [bench(a, args) for a in args.algorithms.split(",")
            if a in bm.algorithms.names()]
    if bm.rank() != 0:
        bm.shutdown()
        return
    load = os.getloadavg()
    lines = [
        f"# Checkpoint save/load, {bm.size()} ranks",
        "",
        f"Command: `OMP_NUM_THREADS=1 mpiexec -n {bm.size()} python benchmarks/checkpoint.py "
        f"--dir {args.dir} --markdown <file>` (best of {args.repeats}).",
        f"Model: MLP 1024 -> {args.layers} x {args.hidden} -> 10, "
        f"{rows[0]['params'] / 1e6:.1f}M parameters, float32, Adam. Machine: "
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), local disk, "
        f"write scheme `{rows[0]['scheme']}`; load average {load[0]:.1f} when it finished "
        "(the machine was shared).",
        "",
        "| algorithm | layout (model / optimizer / per-rank algorithm state) | file | save | "
        "load | load, verify=False | verify (1 process) | save MB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mb = r["size"] / 1e6
        layout = (f"{r['trees']['model']} / {r['trees']['optimizer']} / "
                  f"{'yes' if r['per_rank'] else 'empty'}")
        lines.append(f"| {r['algorithm']} | {layout} | {mb:.0f} MB | {r['save']:.2f} s | "
                     f"{r['load']:.2f} s | {r['load_fast']:.2f} s | {r['verify']:.2f} s | "
                     f"{mb / r['save']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    bm.shutdown()


if __name__ == "__main__":
    main()
