"""Data-parallel training of an MLP on synthetic data: the README's main job.

    mpiexec -n 4 python examples/train_mlp.py [--steps 50] [--hidden 1024] [--batch 64]

Each rank generates its own shard of a fixed synthetic regression problem (no downloads), runs
forward/backward, averages gradients over all ranks with bagua_mpi, and steps its optimizer.
Rank 0 prints the loss and the throughput.
"""
from __future__ import annotations

import argparse
import time

import torch

import bagua_mpi as bm


def make_model(inputs: int, hidden: int, layers: int, outputs: int) -> torch.nn.Module:
    blocks, width = [], inputs
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    blocks.append(torch.nn.Linear(width, outputs))
    return torch.nn.Sequential(*blocks)


def synthetic_batch(step: int, rank: int, batch: int, inputs: int, teacher: torch.nn.Module):
    """A batch of this rank's data shard: inputs from a seeded RNG, targets from a teacher."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(batch, inputs, generator=gen)
    with torch.no_grad():
        y = teacher(x)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    bm.init()
    torch.manual_seed(0)  # same initial model everywhere; broadcast keeps it so regardless
    model = make_model(args.inputs, args.hidden, args.layers, 1)
    teacher = make_model(args.inputs, 64, 1, 1)
    for p in list(model.parameters()) + list(teacher.parameters()):
        bm.broadcast_(p.data, root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    if bm.rank() == 0:
        print(f"{bm.size()} ranks, MLP with {n_params / 1e6:.2f}M parameters, "
              f"{args.batch} samples per rank per step", flush=True)

    start = time.perf_counter()
    for step in range(args.steps):
        x, y = synthetic_batch(step, bm.rank(), args.batch, args.inputs, teacher)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        bm.grouped_allreduce_([p.grad for p in params])  # one fused message per step
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            mean_loss = bm.allreduce(loss.detach()).item()
            if bm.rank() == 0:
                elapsed = time.perf_counter() - start
                rate = (step + 1) * args.batch * bm.size() / elapsed
                print(f"step {step:4d}  loss {mean_loss:.5f}  {rate:9.1f} samples/s", flush=True)
    bm.shutdown()


if __name__ == "__main__":
    main()
