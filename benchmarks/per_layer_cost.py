"""What each further layer costs a training step: the step time of every algorithm on a model of
4 and of 64 small layers (Linear(32, 32): 1,056 parameters each, all in one bucket), and the
difference per layer. The model's own compute is in every row (``gradient_allreduce``'s per-layer
figure is about that); what an algorithm adds above it is its host work per layer, which a GPU
pays as launches and Python alike. Ranks have their own data.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/per_layer_cost.py [--only lgreco_minmax ...]

To compare two versions, run it in a clone of each, alternating (``PYTHONPATH`` set to the
clone, as ``benchmarks/results/lgreco_layers_together.md`` does).
"""
import argparse
import statistics

import torch

import bagua_mpi as bm
from bagua_mpi.algorithms import (QSGD, ByteGrad, Decentralized, GTopK, LGreCo, LocalSGD,
                                  LowPrecisionDecentralized, OneBitAdam, PowerSGD, TopK)
from timed_steps import step_times

ALGORITHMS = {
    "gradient_allreduce": lambda: "gradient_allreduce",
    "qsgd": QSGD, "bytegrad": ByteGrad, "onebit_adam": lambda: OneBitAdam(warmup_steps=2),
    "decentralized": Decentralized, "low_precision_decentralized": LowPrecisionDecentralized,
    "topk": lambda: TopK(density=0.1), "gtopk": lambda: GTopK(density=0.1),
    "powersgd": lambda: PowerSGD(rank=2), "local_sgd": lambda: LocalSGD(period=1),
    **{f"lgreco_{family}": (lambda family=family: LGreCo(family=family, warmup_steps=2,
                                                          period_steps=1000))
       for family in ("minmax", "topk", "powersgd")},
}


def step_ms(algorithm, layers, steps, rank):
    """Median step time (ms) after 5 warm-up steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
    cls = torch.optim.Adam if algorithm == "onebit_adam" else torch.optim.SGD
    opt = bm.DistributedOptimizer(cls(model.parameters(), lr=1e-3),
                                  named_parameters=model.named_parameters(),
                                  algorithm=ALGORITHMS[algorithm]())
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    times = step_times(model, opt, x, steps, warmup=5)
    opt.close()
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(ALGORITHMS), default=None)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    bm.init()
    bm.set_consistency_check(False)
    names = args.only or list(ALGORITHMS)
    few, many = {}, {}
    for name in names:   # each algorithm's two models back to back
        few[name] = step_ms(name, 4, args.steps, bm.rank())
        many[name] = step_ms(name, 64, args.steps, bm.rank())
    if bm.rank() == 0:
        print(f"{bm.size()} ranks, Linear(32, 32) layers, median of {args.steps} steps")
        print("| algorithm | step, 4 layers | step, 64 layers | per further layer |")
        print("|---|---:|---:|---:|")
        for name in names:
            per = (many[name] - few[name]) / 60 * 1e3
            print(f"| {name} | {few[name]:.2f} ms | {many[name]:.2f} ms | {per:.0f} us |")


if __name__ == "__main__":
    main()
