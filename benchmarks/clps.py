"""C_LP_S costs that do not show in a step: an uneven length, and host time per segment.

Run under mpiexec (CPU tensors):

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/clps.py

1. **Uneven length.** Each round calls ``compressed_allreduce_`` (min-max 8-bit, worker and
   server error feedback, averaged) once on a float32 tensor of ``--numel`` elements (a
   multiple of every world size up to 16) and once on one of ``--numel + 1``, alternating
   which goes first. The uneven tensor's last partitions end one element short of n equal
   ones: the row-form kernels read past its end as zeros, so the ratio should stay near 1.
2. **Host time per segment.** ``packed_compressed_allreduce_`` of 1 and of 4 segments of 256
   elements (min-max 4-bit, error feedback), where the kernels and the wire cost next to
   nothing: what remains is the library's host time per exchange and per segment (argument
   checks, formats, views, launches), which a GPU pays on every bucket too.

Every call starts after a Barrier and counts as the slowest rank's time; the tables give
medians over ``--rounds`` rounds (of ``--calls`` calls each for the small exchanges) after
``--warmup``. Earlier figures: ``benchmarks/results/clps_before_after.md``.
"""
import argparse
import statistics
import time

import torch
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi.primitives.codecs import MinMaxCodec
from bagua_mpi.primitives.lowprec import (Segment, compressed_allreduce_,
                                          packed_compressed_allreduce_, padded_length,
                                          partition_length)


def timed(comm, fn, calls=1):
    comm.Barrier()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return comm.allreduce(time.perf_counter() - started, op=MPI.MAX) / calls


def errors(length, n):
    return torch.zeros(padded_length(length, n)), torch.zeros(partition_length(length, n))


def uneven(comm, args):
    n, rank = comm.Get_size(), comm.Get_rank()
    codec = MinMaxCodec(8, 1024)
    lengths = {"even": args.numel, "uneven": args.numel + 1}
    work = {name: (torch.randn(length, generator=torch.Generator().manual_seed(rank)),
                   *errors(length, n)) for name, length in lengths.items()}
    times = {name: [] for name in lengths}
    for r in range(args.warmup + args.rounds):
        for name in (lengths if r % 2 == 0 else reversed(list(lengths))):
            x, worker, server = work[name]
            elapsed = timed(comm, lambda: compressed_allreduce_(
                x, comm, codec, worker_error=worker, server_error=server, scale=1.0 / n, seed=r))
            if r >= args.warmup:
                times[name].append(elapsed)
    return {name: (lengths[name], statistics.median(t) * 1e3) for name, t in times.items()}


def host_time(comm, args):
    n = comm.Get_size()
    exchanges = {}
    for count in (1, 4):
        segments = [Segment(torch.randn(256), MinMaxCodec(4, 1024), *errors(256, n), seed=j)
                    for j in range(count)]
        exchanges[count] = segments
    times = {count: [] for count in exchanges}
    for r in range(args.warmup + args.rounds):
        for count, segments in exchanges.items():
            elapsed = timed(comm, lambda: packed_compressed_allreduce_(segments, comm, scale=0.5),
                            args.calls)
            if r >= args.warmup:
                times[count].append(elapsed)
    return {count: statistics.median(t) * 1e6 for count, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4 * 2**22)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    bm.init()
    comm = bm.runtime.get().topo.comm
    big = uneven(comm, args)
    small = host_time(comm, args)
    if comm.Get_rank() == 0:
        n = comm.Get_size()
        print(f"C_LP_S on {n} ranks, medians of {args.rounds} rounds")
        print("\n| tensor (min-max 8-bit, error feedback) | elements | ms |")
        print("|---|---:|---:|")
        for name, (length, ms) in big.items():
            print(f"| {name} | {length:,} | {ms:.1f} |")
        print(f"\nuneven / even: {big['uneven'][1] / big['even'][1]:.2f}")
        print("\n| exchange (256-element segments, min-max 4-bit) | us per call |")
        print("|---|---:|")
        for count, us in small.items():
            print(f"| {count} segment{'s' if count > 1 else ''} | {us:.0f} |")
        print(f"\nper segment beyond the first: {(small[4] - small[1]) / 3:.0f} us")
    bm.shutdown()


if __name__ == "__main__":
    main()
