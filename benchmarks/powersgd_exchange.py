"""PowerSGD's exchange of many layers (``powersgd_allreduce_``, rank r, error feedback): the torch
operations it dispatches and how long it takes, on both of its routes, for layers of one total
size cut into 4 to 256 matrices.

On a GPU each dispatched operation that computes or copies is at least one kernel launch (a
few microseconds of host time each), so the count is the launch cost a CPU can measure. The
device route (what CUDA tensors take: the P's orthonormalized many at once in torch) runs here
on CPU tensors; the host route orthonormalizes every P in one compiled loop. "this tree"
plans each call (``powersgd_allreduce_``), "kept plan" plans once and runs the plan every step,
as PowerSGD does for a bucket (``LowRankExchange``). ``--baseline FILE`` loads another version
of ``bagua_mpi/primitives/lowrank.py`` (from a clone of an older commit), runs it interleaved
with this one, step by step on twin states, and checks that all leave the same bits in every
result, Q and error memory.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/powersgd_exchange.py \\
        [--baseline /tmp/old/bagua_mpi/primitives/lowrank.py]
"""
import argparse
import functools
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
    modules = {"this tree": lowrank, "kept plan": lowrank}
    if args.baseline:
        modules = {"baseline": load_other_version(args.baseline), **modules}
    host_routes = {name: m._on_device for name, m in modules.items()}
    scale = 1.0 / bm.size()

    def exchange(name, module, state):
        """One step of ``name``'s exchange of ``state``, as a call."""
        if name == "kept plan":
            return functools.partial(module.LowRankExchange(state).run, comm, scale=scale)
        return functools.partial(module.powersgd_allreduce_, state, comm, scale=scale)
    lines = []
    for device_route in (True, False):
        route = "device route" if device_route else "host route"
        for name, module in modules.items():  # the route's predicate, as the suite sets it
            module._on_device = (lambda buf: True) if device_route else host_routes[name]
        for layers, rows, cols, rank in CASES:
            states = {name: segments(layers, rows, cols, rank) for name in modules}
            steps = {name: exchange(name, module, states[name])
                     for name, module in modules.items()}
            times = {name: [] for name in modules}
            counts = {}
            for repeat in range(args.repeats + 2):
                for name in modules:
                    bm.barrier()
                    if repeat == 0:  # counted apart: the counting mode slows every operation
                        with DispatchCount() as mode:
                            steps[name]()
                        counts[name] = mode.launches
                        continue
                    start = time.perf_counter()
                    steps[name]()
                    elapsed = time.perf_counter() - start
                    if repeat >= 2:
                        times[name].append(elapsed)
            first, *others = states.values()
            same = all(torch.equal(a.flat, b.flat) and torch.equal(a.q, b.q)
                       and torch.equal(a.error, b.error)
                       for other in others for a, b in zip(first, other))
            assert same, f"{route}, {layers} layers: the versions differ"
            medians = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            cells = [f"{counts[name]} ops, {medians[name]:.2f} ms" for name in modules]
            ratio = (f" | {medians['this tree'] / medians['baseline']:.2f}x"
                     f" | {medians['kept plan'] / medians['baseline']:.2f}x"
                     if args.baseline else "")
            lines.append(f"| {route} | {layers} x {rows}x{cols}, rank {rank} | "
                         + " | ".join(cells) + ratio + " |")
    if bm.rank() == 0:
        print("| route | layers | " + " | ".join(modules)
              + (" | this tree / baseline | kept plan / baseline (time) |" if args.baseline
                 else " |"))
        print("|---|---|" + "---|" * (len(modules) + 2 * bool(args.baseline)))
        print("\n".join(lines), flush=True)
        print(f"(every result, Q and error memory bit-identical between the {len(modules)}, "
              f"after {args.repeats + 2} steps of each case on each route)")


if __name__ == "__main__":
    main()
