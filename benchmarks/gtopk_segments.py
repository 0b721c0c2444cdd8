"""gTop-k of a bucket's layers (``packed_gtopk_allreduce_``) on the host: how long one exchange
takes, and with ``--baseline FILE`` the same for another version of
``bagua_mpi/primitives/sparse.py`` (from a clone of an older commit), called interleaved with
this one on the same data, their results and residuals checked equal.

The cases: one tensor (a bucket that is one segment, as the ``gtopk`` algorithm sends it), and
many small layers, with their residuals end to end in one memory (as L-GreCo's top-k family
keeps them: the selection and decode run for all of them at once) or each in its own.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/gtopk_segments.py \
        [--baseline /tmp/old/bagua_mpi/primitives/sparse.py]
"""
import argparse
import statistics
import time

import numpy as np
import torch

import bagua_mpi as bm
from bagua_mpi.primitives import sparse
from other_version import load_other_version

# (name, layer sizes, density, residuals in one memory)
CASES = [("one tensor of 67,584", [67_584], 0.01, True),
         ("one tensor of 1M", [1 << 20], 0.001, True),
         ("64 layers of 1,056, common memory", [1056] * 64, 0.1, True),
         ("64 layers of 1,056, own memory", [1056] * 64, 0.1, False),
         ("16 layers of 16,384, common memory", [16_384] * 16, 0.01, True)]


class Bucket:
    """A bucket's flat gradient, its layers as views, and their residuals."""

    def __init__(self, sizes, density, common, rank):
        self.sizes, self.density = sizes, density
        self.grad = torch.from_numpy(np.random.default_rng([rank, len(sizes)]).standard_t(
            3, sum(sizes)).astype(np.float32))
        self.flat = self.grad.clone()
        starts = np.cumsum([0] + sizes)
        self.views = [self.flat[a:a + n] for a, n in zip(starts, sizes)]
        if common:
            memory = torch.zeros(sum(sizes))
            self.residuals = [memory[a:a + n] for a, n in zip(starts, sizes)]
        else:
            self.residuals = [torch.zeros(n) for n in sizes]

    def exchange(self, module, comm, size):
        self.flat.copy_(self.grad)
        segments = [module.SparseSegment(v, sparse.topk_count(v.numel(), self.density), r)
                    for v, r in zip(self.views, self.residuals)]
        comm.Barrier()
        start = time.perf_counter()
        module.packed_gtopk_allreduce_(segments, comm, scale=1.0 / size)
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another sparse.py to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    bm.init()
    comm = bm.runtime.get().topo.comm
    rank, size = comm.Get_rank(), comm.Get_size()
    modules = {"this tree": sparse}
    if args.baseline:
        modules = {"baseline": load_other_version(args.baseline), **modules}
    names = list(modules)
    if rank == 0:
        print(f"{size} ranks; median of {args.rounds} rounds, each the median of "
              f"{args.repeats} exchanges")
        print("| case | " + " | ".join(names) +
              (" | this tree / baseline |" if args.baseline else " |"))
        print("|---|" + "---:|" * (len(names) + bool(args.baseline)))
    for label, sizes, density, common in CASES:
        buckets = {name: Bucket(sizes, density, common, rank) for name in names}
        for name, mod in modules.items():   # compiles; then the versions must agree
            buckets[name].exchange(mod, comm, size)
        results = [(b.flat.clone(), torch.cat(b.residuals)) for b in buckets.values()]
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], other)), label
        times = {name: [] for name in names}
        for _ in range(args.rounds):   # interleaved: each round times every version in turn
            for name, mod in modules.items():
                times[name].append(statistics.median(
                    buckets[name].exchange(mod, comm, size) for _ in range(args.repeats)))
        medians = [statistics.median(times[name]) * 1e6 for name in names]
        if rank == 0:
            row = f"| {label} | " + " | ".join(f"{t:.0f} us" for t in medians)
            if args.baseline:
                row += f" | {medians[1] / medians[0]:.2f}x"
            print(row + " |", flush=True)
    if rank == 0 and args.baseline:
        print("(the two versions' results and residuals equal after the first exchange)")


if __name__ == "__main__":
    main()
