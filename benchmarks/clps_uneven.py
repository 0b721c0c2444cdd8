"""C_LP_S of a tensor whose length the ranks do not divide, against one they divide.

Run under mpiexec (CPU tensors):

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/clps_uneven.py

Each round calls ``compressed_allreduce_`` (min-max 8-bit, worker and server error feedback,
averaged) once on a float32 tensor of ``--numel`` elements (a multiple of every world size up
to 16) and once on one of ``--numel + 1``, alternating which goes first; each call starts
after a Barrier and counts as the slowest rank's time. The table gives medians over
``--rounds`` rounds after ``--warmup``, and their ratio. The uneven tensor's last partitions
end one element short of n equal ones: the row-form kernels read past its end as zeros, so
the ratio should stay near 1; it was about 1.5 at 4 ranks when such a tensor was first copied
into a zero-padded buffer and back on every call
(``benchmarks/results/clps_uneven_before_after.md``).
"""
import argparse
import statistics
import time

import torch
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi.primitives.codecs import MinMaxCodec
from bagua_mpi.primitives.lowprec import compressed_allreduce_, padded_length, partition_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4 * 2**22)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    bm.init()
    comm = bm.runtime.get().topo.comm
    n, rank = comm.Get_size(), comm.Get_rank()
    codec = MinMaxCodec(8, 1024)
    lengths = {"even": args.numel, "uneven": args.numel + 1}
    work = {}
    for name, length in lengths.items():
        x = torch.randn(length, generator=torch.Generator().manual_seed(rank))
        work[name] = (x, torch.zeros(padded_length(length, n)),
                      torch.zeros(partition_length(length, n)))
    times = {name: [] for name in lengths}
    for r in range(args.warmup + args.rounds):
        order = list(lengths) if r % 2 == 0 else list(reversed(lengths))
        for name in order:
            x, worker, server = work[name]
            comm.Barrier()
            started = time.perf_counter()
            compressed_allreduce_(x, comm, codec, worker_error=worker, server_error=server,
                                  scale=1.0 / n, seed=r)
            elapsed = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
            if r >= args.warmup:
                times[name].append(elapsed)
    if rank == 0:
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"C_LP_S min-max 8-bit with error feedback, {n} ranks, median of {args.rounds}")
        print("| tensor | elements | ms |")
        print("|---|---:|---:|")
        for name, length in lengths.items():
            print(f"| {name} | {length:,} | {medians[name]:.1f} |")
        print(f"uneven / even: {medians['uneven'] / medians['even']:.2f}")
    bm.shutdown()


if __name__ == "__main__":
    main()
