"""Allgather, broadcast, alltoall and reducescatter: raw mpi4py against bagua_mpi on each wire,
in the same run.

    mpiexec -n 2 python benchmarks/data_movement.py [--sizes 64 65536 4194304] [--rounds 5]
        [--backends mpi gloo] [--markdown out.md]

For each collective and payload size (bytes of float32 per rank; the grouped forms split it
among 8 tensors), interleaved rounds time:

  raw    mpi4py on preallocated NumPy arrays (Allgatherv, Bcast, Alltoallv, Reduce_scatter; one
         call per tensor of a group)
  mpi    bagua_mpi's call on a CPU tensor under backend ``mpi`` (agreement check on)
  gloo   the same under backend ``gloo``: the process-group wire NCCL gives CUDA tensors
         (allgather padded to equal blocks, alltoall with per-rank counts, reducescatter
         padded by a row)

The rows are uneven (rank r has r + 1 parts), as a gathered batch or a routed token list is.
The median round is reported, with each variant's time over raw's. Run it with another tree on
``PYTHONPATH`` for the same table of that code, with ``--backends mpi`` to compare the MPI path
alone: the gloo group's threads, once made, slow the MPI calls of the same processes by a few
microseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi import backends


def timed(fn, iters: int, comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / iters


def cases(nbytes: int, comm):
    """{name: (raw call, bagua_mpi call)} for one payload size; rank r has r + 1 parts."""
    rank, size = comm.Get_rank(), comm.Get_size()
    part = max(1, nbytes // 4 // (size + 1))
    rows = [(r + 1) * part for r in range(size)]
    mine = np.ones(rows[rank], np.float32)
    tensor = torch.from_numpy(mine)
    gathered = np.empty(sum(rows), np.float32)
    # alltoall: rank r sends (r + 1) * part to every rank
    send_splits = [rows[rank]] * size
    sent = torch.ones(rows[rank] * size)
    recv = np.empty(sum(rows), np.float32)
    # reducescatter of size * part + 1 rows: the first rank keeps one row more
    total = size * part + 1
    whole = torch.ones(total)
    kept = bm.collectives.reducescatter_rows(total, size)
    scattered = np.empty(kept[rank], np.float32)
    shared = torch.ones(max(1, nbytes // 4))  # broadcast: the same length on every rank
    # a group of 8 tensors, the payload split among them (raw: one Allgatherv each)
    eighth = [torch.ones(max(1, rows[rank] // 8)) for _ in range(8)]
    eighth_rows = [max(1, r // 8) for r in rows]
    eighth_out = [np.empty(sum(eighth_rows), np.float32) for _ in range(8)]
    eighth_whole = [torch.ones(max(size, total // 8)) for _ in range(8)]
    eighth_kept = bm.collectives.reducescatter_rows(max(size, total // 8), size)
    eighth_scattered = [np.empty(eighth_kept[rank], np.float32) for _ in range(8)]
    return {
        "allgather": (lambda: comm.Allgatherv(mine, [gathered, rows]),
                      lambda: bm.allgather(tensor)),
        "broadcast": (lambda: comm.Bcast(shared.numpy(), root=0),
                      lambda: bm.broadcast_(shared, 0)),
        "alltoall": (lambda: comm.Alltoallv([sent.numpy(), send_splits], [recv, rows]),
                     lambda: bm.alltoall(sent, send_splits)),
        "grouped_allgather x8": (
            lambda: [comm.Allgatherv(t.numpy(), [o, eighth_rows])
                     for t, o in zip(eighth, eighth_out)],
            lambda: bm.grouped_allgather(eighth)),
        "grouped_reducescatter x8": (
            lambda: [comm.Reduce_scatter(t.numpy(), o, recvcounts=eighth_kept)
                     for t, o in zip(eighth_whole, eighth_scattered)],
            lambda: bm.grouped_reducescatter(eighth_whole, op=bm.Sum)),
        "reducescatter": (lambda: comm.Reduce_scatter(whole.numpy(), scattered,
                                                      recvcounts=kept),
                          lambda: bm.reducescatter(whole, op=bm.Sum)),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1 << 16, 1 << 22])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["mpi", "gloo"],
                        choices=["mpi", "gloo"])
    parser.add_argument("--markdown", help="also write the table to this file (rank 0)")
    args = parser.parse_args()
    bm.init()
    comm = MPI.COMM_WORLD
    names = ["raw"] + args.backends
    lines = [f"{comm.Get_size()} ranks; median of {args.rounds} interleaved rounds, us per call",
             "", "| collective | bytes per rank | " + " | ".join(names) + " | "
             + " | ".join(f"{b}/raw" for b in args.backends) + " |",
             "|---|---|" + "---|" * (2 * len(names) - 1)]
    for nbytes in args.sizes:
        iters = max(5, min(500, (1 << 24) // max(nbytes, 1)))
        for name, (raw, ours) in cases(nbytes, comm).items():
            times = {name: [] for name in names}
            for _ in range(args.rounds):
                times["raw"].append(timed(raw, iters, comm))
                for backend in args.backends:
                    backends._default = backend
                    ours()  # a first call per backend makes the gloo group
                    times[backend].append(timed(ours, iters, comm))
            backends._default = None
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            lines.append(f"| {name} | {nbytes} | "
                         + " | ".join(f"{med[n]:.1f}" for n in names) + " | "
                         + " | ".join(f"{med[b] / med['raw']:.2f}" for b in args.backends)
                         + " |")
    if comm.Get_rank() == 0:
        print("\n".join(lines), flush=True)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write("\n".join(lines) + "\n")
    bm.shutdown()


if __name__ == "__main__":
    main()
