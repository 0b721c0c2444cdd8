"""Step time of bagua_mpi against PyTorch DDP (gloo), same model, data and ranks, one run.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/ddp_compare.py [--steps 10] [--markdown F]

The model is an MLP of ~21M parameters (1024 -> 6 x 2048 hidden -> 10). Variants, each timed
over the same number of steps after warm-up, interleaved in rounds:

  no-comm       local training, no communication at all (the floor)
  ddp-gloo      torch.nn.parallel.DistributedDataParallel, gloo backend
  bagua         DistributedOptimizer(gradient_allreduce), everything on
  bagua-O-off   ... without overlap            bagua-F-off   ... without flattening
  bagua-H-on    ... hierarchical on 2 simulated nodes of n/2 ranks (BAGUA_MPI_RANKS_PER_NODE)
  bagua-fp16    ... with fp16 wire compression
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import bagua_mpi as bm


def make_model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks, width = [], 1024
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    blocks.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*blocks)


def batch(rank: int, size: int):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(size, 1024, generator=g), torch.randint(0, 10, (size,), generator=g)


def run_steps(model, step_fn, x, y, steps: int) -> float:
    """Seconds per step, the slowest rank's (a step ends when every rank has finished it)."""
    step_fn(model, x, y)  # warm-up (and bagua_mpi's profiling iteration)
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step_fn(model, x, y)
    elapsed = (time.perf_counter() - t0) / steps
    return MPI.COMM_WORLD.allreduce(elapsed, op=MPI.MAX)


def plain_step(opt):
    def step(model, x, y):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def init_gloo(rank: int, size: int) -> None:
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = MPI.COMM_WORLD.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--markdown")
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    os.environ.setdefault("BAGUA_MPI_RANKS_PER_NODE", str(max(1, size // 2)))
    bm.init()
    init_gloo(rank, size)
    x, y = batch(rank, args.batch)
    n_params = sum(p.numel() for p in make_model(args.hidden, args.layers).parameters())

    def variant(name):
        model = make_model(args.hidden, args.layers)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name == "no-comm":
            return model, plain_step(sgd), None
        if name == "ddp-gloo":
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            return ddp, plain_step(torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)), None
        options = {"bagua": {}, "bagua-O-off": {"overlap": False},
                   "bagua-F-off": {"flatten": False}, "bagua-H-on": {"hierarchical": True},
                   "bagua-fp16": {"compression": "fp16"}}[name]
        bm.set_consistency_check(False)  # the engine verified the model layout at wrap time
        opt = bm.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **options)
        return model, plain_step(opt), opt

    names = ["no-comm", "ddp-gloo", "bagua", "bagua-O-off", "bagua-F-off", "bagua-H-on",
             "bagua-fp16"]
    samples = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            model, step, opt = variant(name)
            samples[name].append(run_steps(model, step, x, y, args.steps))
            if opt is not None:
                opt.close()
    med = {n: statistics.median(v) for n, v in samples.items()}
    if rank == 0:
        lines = [f"model: MLP 1024 -> {args.layers} x {args.hidden} -> 10, "
                 f"{n_params / 1e6:.1f}M parameters; {size} ranks; batch {args.batch} per rank; "
                 f"median of {args.rounds} rounds x {args.steps} steps",
                 "", "| variant | step ms | / ddp-gloo | / bagua |", "|---|---|---|---|"]
        for n in names:
            lines.append(f"| {n} | {med[n] * 1e3:.1f} | {med[n] / med['ddp-gloo']:.3f} | "
                         f"{med[n] / med['bagua']:.3f} |")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write(text + "\n")
    dist.destroy_process_group()
    bm.shutdown()


if __name__ == "__main__":
    main()
