"""Allreduce latency and bus bandwidth: raw mpi4py against bagua_mpi, in the same run.

    mpiexec -n 4 python benchmarks/collectives.py [--min-bytes 64] [--max-mib 64]
        [--markdown out.md]

Bus bandwidth follows nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n for allreduce.
Each size is measured in interleaved rounds (raw, then each bagua_mpi variant, repeated) and the
median round is reported, so slow drift of a noisy machine hits every variant alike.

Variants:
  raw          comm.Allreduce(numpy send, numpy recv, SUM) on COMM_WORLD, recv preallocated
  raw-fresh    the same into a freshly allocated recv array each call: what an out-of-place
               call that returns a new array costs with raw mpi4py (with the mpich wheel's UCX
               transport, new buffer addresses cost up to 2x at 1-16 MiB)
  bm-sum       bagua_mpi.allreduce(torch tensor, Sum)          agreement check on (default)
  bm-sum-nock  the same with the agreement check off (BAGUA_MPI_CHECK=0 semantics)
  bm-inplace   bagua_mpi.allreduce_(tensor, Sum), check off
  bm-avg       bagua_mpi.allreduce(tensor) = Average, check on (one extra pass to divide)
  bm-async     allreduce_async_ + synchronize, check off
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import bagua_mpi as bm


def timed(fn, iters: int, comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    return comm.allreduce(elapsed, op=MPI.MAX) / iters  # the slowest rank defines the time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--min-bytes", type=int,
                        help="smallest message in bytes (overrides --min-kib)")
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", help="also write the table to this file (rank 0)")
    args = parser.parse_args()

    bm.init()
    world = MPI.COMM_WORLD
    n = world.Get_size()
    rank = world.Get_rank()
    sizes = []
    nbytes = args.min_bytes or args.min_kib * 1024
    while nbytes <= args.max_mib * 1024 * 1024:
        sizes.append(nbytes)
        nbytes *= 4

    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        send = np.full(count, rank + 1.0, dtype=np.float32)
        recv = np.empty_like(send)
        tensor = torch.from_numpy(send.copy())
        inplace = tensor.clone()
        # ~0.2 s of work per variant per round on this kind of machine
        iters = max(3, min(300, int(0.2 / (40e-6 + nbytes / 1.0e9))))

        def with_check(on: bool, fn):
            def run():
                bm.set_consistency_check(on)
                fn()
            return run

        variants = {
            "raw": lambda: world.Allreduce(send, recv, op=MPI.SUM),
            "raw-fresh": lambda: world.Allreduce(send, np.empty_like(send), op=MPI.SUM),
            "bm-sum": lambda: bm.allreduce(tensor, bm.Sum),
            "bm-sum-nock": lambda: bm.allreduce(tensor, bm.Sum),
            "bm-inplace": lambda: bm.allreduce_(inplace, bm.Sum),
            "bm-avg": lambda: bm.allreduce(tensor),
            "bm-async": lambda: bm.synchronize(bm.allreduce_async_(inplace, bm.Sum)),
        }
        checked = {"bm-sum", "bm-avg"}
        samples = {k: [] for k in variants}
        for name, fn in variants.items():  # warm-up
            bm.set_consistency_check(name in checked)
            fn()
        for _ in range(args.rounds):
            for name, fn in variants.items():
                bm.set_consistency_check(name in checked)
                samples[name].append(timed(fn, iters, world))
        bm.set_consistency_check(True)
        assert np.allclose(recv, n * (n + 1) / 2)
        med = {k: statistics.median(v) for k, v in samples.items()}
        rows.append((nbytes, med))

    if rank != 0:
        bm.shutdown()
        return
    factor = 2 * (n - 1) / n
    names = list(rows[0][1])
    # out-of-place variants are compared with raw-fresh, in-place ones with raw
    base_of = {k: ("raw-fresh" if k in ("bm-sum", "bm-sum-nock", "bm-avg") else "raw")
               for k in names}
    header = ("| bytes | " + " | ".join(f"{k} µs" for k in names) + " | raw busbw GB/s | "
              + " | ".join(f"{k}/{base_of[k]}" for k in names[2:]) + " | check cost µs |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for nbytes, med in rows:
        busbw = {k: nbytes / t * factor / 1e9 for k, t in med.items()}
        lines.append(
            f"| {_human(nbytes)} | " + " | ".join(f"{med[k] * 1e6:.1f}" for k in names)
            + f" | {busbw['raw']:.3f} | "
            + " | ".join(f"{busbw[k] / busbw[base_of[k]]:.3f}" for k in names[2:])
            + f" | {(med['bm-sum'] - med['bm-sum-nock']) * 1e6:.1f} |")
    summary = ["", f"ranks: {n}; MPI: {MPI.Get_library_version().splitlines()[0].strip()}"]
    for nbytes, small in rows:
        if nbytes > 4096:
            break
        summary.append(
            f"per-call overhead at {_human(nbytes)}: in place "
            f"{(small['bm-inplace'] - small['raw']) * 1e6:.1f} µs over raw (check off); "
            f"out of place {(small['bm-sum-nock'] - small['raw-fresh']) * 1e6:.1f} µs over "
            f"raw-fresh with the check off, {(small['bm-sum'] - small['raw-fresh']) * 1e6:.1f} "
            f"µs with it on")
    big = [(nb, m) for nb, m in rows if nb >= 1 << 20]
    if big:
        worst_in = min(m["raw"] / m["bm-inplace"] for _, m in big)
        worst_out = min(m["raw-fresh"] / m["bm-sum-nock"] for _, m in big)
        worst_ck = min(m["raw-fresh"] / m["bm-sum"] for _, m in big)
        summary.append(f"worst bus-bandwidth ratio at >= 1 MiB: in place / raw {worst_in:.3f}; "
                       f"out of place / raw-fresh {worst_out:.3f} (check off), {worst_ck:.3f} "
                       f"(check on)")
    text = "\n".join(lines + summary)
    print(text, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")
    bm.shutdown()


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    main()
