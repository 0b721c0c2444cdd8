"""PowerSGD's exchange of many layers (``powersgd_allreduce_``, rank r, error feedback): the torch
operations it dispatches and how long it takes, on both of its routes, for layers of one total
size cut into 4 to 256 matrices.

On a GPU each dispatched operation that computes or copies is at least one kernel launch (a
few microseconds of host time each), so the count is the launch cost a CPU can measure. The
device route (what CUDA tensors take: the P's orthonormalized many at once in torch) runs here
on CPU tensors; the host route orthonormalizes every P in one compiled loop. ``--baseline
FILE`` loads another version of ``bagua_mpi/primitives/lowrank.py`` (from a clone of an older
commit), runs it interleaved with this one, step by step on twin states, and checks that both
leave the same bits in every result, Q and error memory.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/powersgd_exchange.py \\
        [--baseline /tmp/old/bagua_mpi/primitives/lowrank.py]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import bagua_mpi as bm
from bagua_mpi.primitives import LowRankSegment, initial_q, lowrank

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests" / "mpi"))
from dispatch_count import DispatchCount  # noqa: E402  (the tests' counter)
from other_version import load_other_version  # noqa: E402

# (layers, rows, cols, rank): 2^20 weights in 4 to 256 square layers, 16 rectangular ones at
# rank 8, and 24 layers of a transformer's attention shape and of its MLP shape
CASES = [(4, 512, 512, 4), (64, 128, 128, 4), (256, 64, 64, 4), (16, 1024, 256, 8),
         (24, 768, 768, 4), (24, 3072, 768, 4)]


def segments(layers, rows, cols, rank):
    gen = torch.Generator().manual_seed(bm.rank())
    return [LowRankSegment(torch.randn(rows * cols, generator=gen), rows, rank,
                           initial_q(cols, rank, j), torch.zeros(rows * cols))
            for j in range(layers)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another lowrank.py to compare with")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    bm.init()
    comm = bm.runtime.get().topo.comm
    modules = {"this tree": lowrank}
    if args.baseline:
        modules = {"baseline": load_other_version(args.baseline), **modules}
    host_routes = {name: m._on_device for name, m in modules.items()}
    lines = []
    for device_route in (True, False):
        route = "device route" if device_route else "host route"
        for name, module in modules.items():  # the route's predicate, as the suite sets it
            module._on_device = (lambda buf: True) if device_route else host_routes[name]
        for layers, rows, cols, rank in CASES:
            states = {name: segments(layers, rows, cols, rank) for name in modules}
            times = {name: [] for name in modules}
            counts = {}
            for repeat in range(args.repeats + 2):
                for name, module in modules.items():
                    bm.barrier()
                    if repeat == 0:  # counted apart: the counting mode slows every operation
                        with DispatchCount() as mode:
                            module.powersgd_allreduce_(states[name], comm, scale=1.0 / bm.size())
                        counts[name] = mode.launches
                        continue
                    start = time.perf_counter()
                    module.powersgd_allreduce_(states[name], comm, scale=1.0 / bm.size())
                    elapsed = time.perf_counter() - start
                    if repeat >= 2:
                        times[name].append(elapsed)
            if args.baseline:
                same = all(torch.equal(a.flat, b.flat) and torch.equal(a.q, b.q)
                           and torch.equal(a.error, b.error)
                           for a, b in zip(*states.values()))
                assert same, f"{route}, {layers} layers: the two versions differ"
            medians = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            cells = [f"{counts[name]} ops, {medians[name]:.2f} ms" for name in modules]
            ratio = (f" | {medians['this tree'] / medians['baseline']:.2f}x"
                     if args.baseline else "")
            lines.append(f"| {route} | {layers} x {rows}x{cols}, rank {rank} | "
                         + " | ".join(cells) + ratio + " |")
    if bm.rank() == 0:
        print("| route | layers | " + " | ".join(modules)
              + (" | this tree / baseline (time) |" if args.baseline else " |"))
        print("|---|---|" + "---|" * (len(modules) + bool(args.baseline)))
        print("\n".join(lines), flush=True)
        if args.baseline:
            print("(every result, Q and error memory bit-identical between the two, "
                  f"after {args.repeats + 2} steps of each case on each route)")


if __name__ == "__main__":
    main()
