"""Does 1-bit Adam's compressed stage train the 21.5M-parameter MLP of the GPU check?

Runs the check's model and data (``tests/gpu/train_all.py``) for STEPS steps with 1-bit Adam
and prints the loss on the whole shard after each step from the switch on. ``--average exact``
replaces the 1-bit exchange of the momentum by an exact MPI average, so the frozen-variance
stage runs without compression: a divergence there comes from the algorithm's frozen
variance, not from the compression.

    mpiexec -n 2 python benchmarks/onebit_adam_stability.py --lr 1e-3 --average exact
"""
import argparse
import math
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi.algorithms import onebit_adam

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
from train_all import shard  # noqa: E402


def exact_momentum_average(self, bucket, step):
    """The compressed stage's momentum update, averaged exactly (CPU tensors only)."""
    m, _ = self.moments(bucket)
    ranks = self.comm.Get_size()
    contribution = bucket.grad_vector() * (self.scale * ranks)
    m.mul_(self.betas[0]).add_(contribution, alpha=1 - self.betas[0])
    self.comm.Allreduce(MPI.IN_PLACE, m.numpy(), op=MPI.SUM)
    m.div_(ranks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--width", type=int, default=4608)
    ap.add_argument("--average", choices=("onebit", "exact"), default="onebit")
    args = ap.parse_args()
    if args.average == "exact":
        onebit_adam.OneBitAdamImpl.reduce_bucket = exact_momentum_average
    bm.init()
    comm = bm.runtime.get().topo.comm
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(64, w), torch.nn.ReLU(), torch.nn.Linear(w, w),
                                torch.nn.ReLU(), torch.nn.Linear(w, 8))
    opt = bm.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr, eps=args.eps),
        named_parameters=model.named_parameters(),
        algorithm=bm.algorithms.OneBitAdam(warmup_steps=args.warmup, chunk=1024))
    x, y = shard(comm.Get_rank(), torch.device("cpu"))
    loss_fn = torch.nn.MSELoss()
    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        i = (step * 64) % 1024
        loss_fn(model(x[i:i + 64]), y[i:i + 64]).backward()
        opt.step()
        with torch.no_grad():
            losses.append(loss_fn(model(x), y).item())
        if not math.isfinite(losses[-1]):
            break
    opt.close()
    if comm.Get_rank() == 0:
        after = losses[args.warmup - 1:]
        print(f"lr {args.lr:g} eps {args.eps:g} warmup {args.warmup} average {args.average}: "
              f"loss at the switch {after[0]:.4g}, highest after it {max(after):.4g}, "
              f"last {losses[-1]:.4g} (step {len(losses) - 1})", flush=True)
    bm.shutdown()


if __name__ == "__main__":
    main()
