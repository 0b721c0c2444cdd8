"""The device form of Adasum (what a CUDA tensor takes), run on CPU tensors: how many torch
operations it dispatches per call and how long a call takes, for fused buffers of 1 to 200
segments (the tensors of a grouped allreduce).

On a GPU each dispatched operation that computes or copies is at least one kernel launch (a
few microseconds of host time each), so the count is the launch cost a CPU can measure. The
NumPy form (what host buffers take) is timed alongside. ``--baseline FILE`` loads another
version of ``bagua_mpi/primitives/adasum.py`` (from a worktree of an older commit) and times
it interleaved with this one, call by call.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/adasum_device_form.py \\
        [--baseline /tmp/old/bagua_mpi/primitives/adasum.py]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi.primitives import adasum

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests" / "mpi"))
from dispatch_count import DispatchCount  # noqa: E402  (the tests' counter)
from other_version import load_other_version  # noqa: E402


def timed_interleaved(fns, repeats=11):
    """Median milliseconds of each function, called in turn, every rank together."""
    for fn in fns:
        fn()
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            bm.barrier()
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) * 1e3 for ts in times]


def count_ops(module, data, comm, counts):
    with DispatchCount() as mode:
        module.adasum_allreduce_(data.clone(), comm, counts)
    return mode


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1_000_000,
                        help="elements of the fused buffer (split evenly into segments)")
    parser.add_argument("--segments", default="1,10,50,200")
    parser.add_argument("--baseline", help="another adasum.py to time against this one")
    args = parser.parse_args()
    bm.init()
    comm = MPI.COMM_WORLD
    forms = {"this": adasum}
    if args.baseline:
        forms = {"baseline": load_other_version(args.baseline), "this": adasum}
    rng = np.random.default_rng(bm.rank())
    rows = []
    for segments in map(int, args.segments.split(",")):
        counts = [args.elements // segments] * segments
        counts[-1] += args.elements - sum(counts)
        data = torch.from_numpy(rng.standard_normal(args.elements).astype(np.float32))
        ops = {name: count_ops(m, data, comm, counts) for name, m in forms.items()}
        calls = [lambda m=m: m.adasum_allreduce_(data.clone(), comm, counts)
                 for m in forms.values()]
        calls.append(lambda: adasum.adasum_allreduce_(data.clone().numpy(), comm, counts))
        times = timed_interleaved(calls)
        rows.append((segments, ops, times))
    if bm.rank() == 0:
        names = list(forms)
        print(f"{bm.size()} ranks, {args.elements} float32 elements in equal segments")
        print("| segments | " + " | ".join(f"{n}: torch ops (+ views)" for n in names) + " | "
              + " | ".join(f"{n}: device form on CPU" for n in names) + " | NumPy form |"
              + (" this / baseline |" if len(names) == 2 else ""))
        print("|---:" * (2 * len(names) + 2 + (len(names) == 2)) + "|")
        for segments, ops, times in rows:
            cells = [f"{ops[n].launches} (+{ops[n].views})" for n in names]
            cells += [f"{t:.2f} ms" for t in times]
            if len(names) == 2:
                cells.append(f"{times[1] / times[0]:.2f}x")
            print(f"| {segments} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
