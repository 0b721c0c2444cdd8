"""What a grouped allreduce and Adasum's delta optimizer dispatch around the reduction, and
how long they take, for 4 to 256 tensors of the same total size.

On a GPU each dispatched operation that computes or copies is at least one kernel launch (a
few microseconds of host time each), so the count is the launch cost a CPU can measure; the
times are CPU tensors' (what a CPU user gets). Run it with two trees (two venvs, each with one
editable install) and compare the lines.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/grouped_fusion.py
"""
import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bagua_mpi as bm


class Launches(TorchDispatchMode):
    """Operations dispatched from Python that compute or copy (not views or allocations)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and not name.startswith(("empty", "new_empty")):
            self.count += 1
        return func(*args, **(kwargs or {}))


def timed(fn, repeats=15):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        bm.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def launches(fn):
    with Launches() as mode:
        fn()
    return mode.count


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--tensors", default="4,64,256")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    bm.init()
    rows = []
    for n in map(int, args.tensors.split(",")):
        gen = torch.Generator().manual_seed(bm.rank())
        xs = [torch.randn(args.elements // n, generator=gen) for _ in range(n)]
        halves = [x.half() for x in xs]
        params = [torch.nn.Parameter(torch.randn(args.elements // n,
                                                 generator=torch.Generator().manual_seed(i)))
                  for i in range(n)]
        opt = bm.DistributedOptimizer(torch.optim.SGD(params, lr=0.01, foreach=True),
                                      named_parameters=[(f"p{i}", p)
                                                        for i, p in enumerate(params)],
                                      op=bm.Adasum)

        def step():
            for p, x in zip(params, xs):
                p.grad = x
            opt.step()

        cases = {"grouped Sum float32": lambda: bm.grouped_allreduce(xs, op=bm.Sum),
                 "grouped Sum float16": lambda: bm.grouped_allreduce(halves, op=bm.Sum),
                 "Adasum optimizer step": step}
        for name, fn in cases.items():
            rows.append((n, name, launches(fn), timed(fn)))
    if bm.rank() == 0:
        for n, name, count, ms in rows:
            print(f"{args.label} | {n} tensors | {name} | {count} operations | {ms:.2f} ms")


if __name__ == "__main__":
    main()
