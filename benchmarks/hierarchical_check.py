"""What the per-bucket agreement check costs a step with ``hierarchical=True``.

The two-level exchange used to skip the check (one 40-byte allreduce over all ranks per
bucket); it now runs it. Both are timed in one job, interleaved round by round: the check on
(today) and off (``bm.set_consistency_check(False)``, which is what the two-level exchange did
before). The model is the step benchmark's MLP (``step_time.make_model("mlp")``: 21M
parameters, batch 16 per rank), in buckets of ``--bucket-mb``.

    BAGUA_MPI_RANKS_PER_NODE=2 OMP_NUM_THREADS=1 mpiexec -n 4 \\
        python benchmarks/hierarchical_check.py --bucket-mb 25 1
"""
import argparse
import statistics
import time

import torch

import bagua_mpi as bm
from step_time import make_model  # the step benchmark's MLP, as the README's figure


def timed_steps(model, opt, steps: int) -> float:
    """Seconds per step, the slowest rank's (every rank waits for it anyway)."""
    x = torch.randn(16, 1024)  # the MLP's input width
    bm.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    elapsed = (time.perf_counter() - start) / steps
    return bm.allreduce(torch.tensor([elapsed]), op=bm.Max).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 1.0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    bm.init()
    topo = bm.runtime.get().topo
    if bm.rank() == 0:
        print(f"ranks {bm.size()} ({topo.cross_size} nodes of {topo.local_size}), "
              f"hierarchical=True, {args.rounds} rounds x {args.steps} steps, median")
        print("| bucket MB | buckets | check off (ms) | check on (ms) | on / off |")
        print("|---:|---:|---:|---:|---:|")
    for bucket_mb in args.bucket_mb:
        model = make_model("mlp")
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                      named_parameters=model.named_parameters(),
                                      hierarchical=True, bucket_size_mb=bucket_mb)
        timed_steps(model, opt, 2)  # the profiling step and a warm one
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for check in (False, True):
                bm.set_consistency_check(check)
                times[check].append(timed_steps(model, opt, args.steps))
        bm.set_consistency_check(True)
        off, on = (statistics.median(times[c]) * 1e3 for c in (False, True))
        if bm.rank() == 0:
            print(f"| {bucket_mb:g} | {len(opt.buckets)} | {off:.1f} | {on:.1f} | "
                  f"{on / off:.3f} |", flush=True)
        opt.close()
    bm.shutdown()


if __name__ == "__main__":
    main()
