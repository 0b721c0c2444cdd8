"""Time Top-k and gTop-k aggregation alone (no model) on a shaped link, against dense allreduce.

A full training step hides the aggregation under compute (23M MLP at density 0.001: topk 262 ms,
gtopk 263 ms a step, ``algorithms_sweep.md``). This benchmark calls the primitives of
``bagua_mpi.primitives.sparse`` directly on a fixed float32 gradient of ``--numel`` elements
(seeded per rank) with a fixed starting residual, so every call does the same work:

* ``dense``: MPI Allreduce (in place, sum) of the whole gradient;
* ``topk``: ``topk_allgather_`` (compress, all-gather every rank's k pairs, decode all);
* ``gtopk``: ``gtopk_allreduce_`` (compress, binomial tree of top-k merges to rank 0, broadcast,
  restore dropped pairs into the residual, decode);
* ``compress``: the local top-k compression that both start with
  (``numba_kernels.compress_topk`` with the residual fused), so that total - compress is the rest;
* breakdown, on a payload compressed beforehand: ``allgather`` (Top-k's MPI Allgather alone),
  ``tree`` (gTop-k's binomial tree: the sends, receives and merges of ``gtopk_allreduce_``,
  until rank 0 holds the global top-k) and ``bcast`` (the binomial broadcast after it; at
  P = 2 ``gtopk_allreduce_`` itself swaps payloads once instead), ``merges`` (rank 0's
  ceil(log2 P) ``merge_topk`` calls alone, the other ranks waiting in a barrier as they would
  in the tree) and ``decode``
  (``decompress`` of one payload into the n-element output: a memset of the output plus k
  stores, which both primitives pay).

Each call is preceded by a Barrier (resetting the inputs comes before it, untimed); its time is
the MAX over ranks. After ``--warmup`` untimed rounds (JIT, TCP connections), ``--rounds`` rounds
each run every variant once, in an order rotated every round so that load drift hits all
variants alike; the tables give medians (dense: over the first ``--dense-rounds`` rounds).
Bytes sent per rank come from ``WireStats`` (``stats=``).

Each world size runs ``mpiexec -n P`` in a fresh network namespace whose loopback is shaped
with ``tc tbf`` to ``--gbit`` Gbit/s (``shaped_link.py``: root, MPICH over TCP). All ranks
share that one link. The tbf bucket is ``--burst`` (128kb): with a bucket of a few MB, a
whole Top-k or gTop-k exchange at density 0.001 fits in it after the idle barrier and crosses
the link unshaped. Recorded result (root, about 3 minutes on 2 cores; ``--json-out F`` also
keeps every sample):

    python benchmarks/sparse_timing.py --np 2,4,8 --gbit 1 \\
        --markdown benchmarks/results/sparse_timing.md

Quick check (unshaped TCP namespace, small gradient):

    python benchmarks/sparse_timing.py --np 2 --gbit none --numel 1000000 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- inside mpiexec ----------------------------------------------------------------------------

def inner(args) -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    import bagua_mpi as bm
    import numba_kernels as nk
    from bagua_mpi.buffers import host_view
    from bagua_mpi.accounting import WireStats
    from bagua_mpi.primitives.codecs import fit_kernel_threads
    from bagua_mpi.primitives.sparse import (binomial_broadcast, gtopk_allreduce_,
                                             gtopk_tree_reduce, topk_allgather_, topk_count)

    def compress(flat, k, residual):
        """The primitives' first step: top-k of the host gradient with the residual fused."""
        fit_kernel_threads()
        return nk.compress_topk(host_view(flat), k, index_dtype="int32",
                                residual=host_view(residual))

    bm.init()
    bm.set_consistency_check(False)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = args.numel
    rng = np.random.default_rng([args.seed, rank])
    grad = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    res0 = torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * np.float32(0.5))
    flat = torch.empty_like(grad)
    residual = torch.empty_like(grad)
    densities = [float(d) for d in args.densities.split(",")]

    def reset():
        flat.copy_(grad)
        residual.copy_(res0)

    def timed(fn, setup=None, parts=1):
        """Barrier, run fn, MAX over ranks of its seconds (fn may return ``parts`` times)."""
        if setup is not None:
            setup()
        comm.Barrier()
        t0 = time.perf_counter()
        got = fn()
        dt = time.perf_counter() - t0
        local = np.array(got if parts > 1 else [dt], dtype=np.float64)
        if parts > 1:
            local = local - t0
        out = np.empty_like(local)
        comm.Allreduce(local, out, op=MPI.MAX)
        return out.tolist()

    wire = {}  # (variant, density) -> bytes this rank sent in one call

    def with_stats(prim, k, d, name):
        def run():
            st = WireStats()
            prim(flat, comm, k, residual, scale=1.0 / size, stats=st)
            wire[(name, d)] = st.bytes_sent
        return run

    items = []  # (key, setup, fn, parts)
    if args.dense_rounds > 0:
        items.append((("dense", 0.0), lambda: flat.copy_(grad),
                      lambda: comm.Allreduce(MPI.IN_PLACE, host_view(flat), op=MPI.SUM), 1))
    payload_bytes = {}
    for d in densities:
        k = topk_count(n, d)
        reset()
        mine = compress(flat, k, residual)
        mine = nk.Payload(mine.format, mine.buffer.copy())
        payload_bytes[d] = (k, mine.nbytes)
        gathered = np.empty((size, mine.nbytes), dtype=np.uint8)
        depth = math.ceil(math.log2(size)) if size > 1 else 0
        # rank 0's partners in the tree: top-k payloads of other ranks' gradients (rank 2^j's
        # seed; their residuals left out), merged in the tree's order
        others = []
        if rank == 0:
            for j in range(depth):
                g = np.random.default_rng([args.seed, 1 << j]).standard_normal(
                    n, dtype=np.float32)
                others.append(nk.compress_topk(g, k))

        def tree_bcast(mine=mine, k=k):
            root = gtopk_tree_reduce(mine.buffer, [nk.TopKSegment(0, n, k, 0)], comm, None)
            t1 = time.perf_counter()
            glob = root if rank == 0 else np.empty(mine.nbytes, dtype=np.uint8)
            binomial_broadcast(glob, comm)
            return [t1, time.perf_counter()]

        def merges(mine=mine, others=others, depth=depth):
            if rank == 0:
                acc = mine
                for other in others:
                    acc = nk.merge_topk(acc, other, acc.format.k)

        items += [
            (("compress", d), reset, lambda k=k: compress(flat, k, residual), 1),
            (("topk", d), reset, with_stats(topk_allgather_, k, d, "topk"), 1),
            (("gtopk", d), reset, with_stats(gtopk_allreduce_, k, d, "gtopk"), 1),
            (("allgather", d), None, lambda m=mine, g=gathered: comm.Allgather(m.buffer, g), 1),
            (("tree_bcast", d), None, tree_bcast, 2),
            (("merges", d), None, merges, 1),
            (("decode", d), None, lambda m=mine: nk.decompress(m, out=host_view(flat)), 1),
        ]

    samples = {f"{name}@{d:g}": [] for (name, d), *_ in items}
    order = []
    t_start = time.perf_counter()
    for r in range(-args.warmup, args.rounds):
        shift = r % len(items)
        rotated = items[shift:] + items[:shift]
        for (name, d), setup, fn, parts in rotated:
            if name == "dense" and r >= args.dense_rounds:
                continue
            t = timed(fn, setup, parts)
            if r >= 0:
                samples[f"{name}@{d:g}"].append(t)
                if r == 0:
                    order.append(f"{name}@{d:g}")
    elapsed = time.perf_counter() - t_start

    stats = {}
    for (name, d), b in sorted(wire.items()):
        stats[f"{name}@{d:g}"] = {"max": comm.allreduce(b, op=MPI.MAX),
                                  "sum": comm.allreduce(b, op=MPI.SUM)}
    if rank == 0:
        with open(args.json, "w") as fh:
            json.dump({"P": size, "numel": n, "densities": densities,
                       "payload": {f"{d:g}": v for d, v in payload_bytes.items()},
                       "samples": samples, "wire": stats, "order_round0": order,
                       "seconds": elapsed, "rounds": args.rounds,
                       "dense_rounds": args.dense_rounds,
                       "mpi": " ".join(MPI.Get_library_version().split()[:3])}, fh)
    bm.shutdown()


# -- outside: launch per P, tabulate ------------------------------------------------------------

def _median(xs):
    xs = sorted(xs)
    m = len(xs)
    if not m:
        return float("nan")
    return xs[m // 2] if m % 2 else 0.5 * (xs[m // 2 - 1] + xs[m // 2])


def _quartiles(xs):
    xs = sorted(xs)
    if not xs:
        return float("nan"), float("nan")
    q = lambda f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]  # noqa: E731
    return q(0.25), q(0.75)


def _ms(x):
    if x != x:
        return "—"
    return f"{x * 1e3:.2f}" if abs(x) < 0.01 else f"{x * 1e3:.1f}"


def tables(results: dict, gbit: float | None) -> str:
    """Markdown tables for {P: inner json} at one bandwidth."""
    link = None if gbit is None else gbit * 1e9 / 8  # bytes/s of the shared link
    main = ["| P | density | k | dense ms | Top-k ms [IQR] | gTop-k ms [IQR] | Top-k / gTop-k "
            "| gTop-k faster (rounds) | compress ms | Top-k − compress | gTop-k − compress |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    wire = ["| P | density | payload KB | Top-k KB sent (busiest rank) | gTop-k KB sent "
            "(busiest rank) | Top-k MB on link (all ranks) | gTop-k MB on link (all ranks) "
            "| link-time bound Top-k / gTop-k ms |", "|---|---|---|---|---|---|---|---|"]
    brk = ["| P | density | Allgather ms | gTop-k tree ms | bcast ms | tree + bcast ms "
           "| Allgather / (tree + bcast) | rank 0 merges ms | decode ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(results):
        res = results[p]
        s = res["samples"]
        med = lambda key: _median([v[0] for v in s.get(key, [])])  # noqa: E731
        dense = med("dense@0")
        for d in res["densities"]:
            key = f"{d:g}"
            k, nbytes = res["payload"][key]
            tk = [v[0] for v in s[f"topk@{key}"]]
            gk = [v[0] for v in s[f"gtopk@{key}"]]
            t, g, c = _median(tk), _median(gk), med(f"compress@{key}")
            tq, gq = _quartiles(tk), _quartiles(gk)
            wins = sum(b < a for a, b in zip(tk, gk))
            main.append(f"| {p} | {d:g} | {k} | {_ms(dense)} | {_ms(t)} [{_ms(tq[0])}–"
                        f"{_ms(tq[1])}] | {_ms(g)} [{_ms(gq[0])}–{_ms(gq[1])}] | {t / g:.2f} "
                        f"| {wins}/{len(tk)} | {_ms(c)} | {_ms(t - c)} | {_ms(g - c)} |")
            wt, wg = res["wire"][f"topk@{key}"], res["wire"][f"gtopk@{key}"]
            bound = (f"{wt['sum'] / link * 1e3:.1f} / {wg['sum'] / link * 1e3:.1f}"
                     if link else "—")
            wire.append(f"| {p} | {d:g} | {nbytes / 1e3:.0f} | {wt['max'] / 1e3:.0f} | "
                        f"{wg['max'] / 1e3:.0f} | {wt['sum'] / 1e6:.2f} | {wg['sum'] / 1e6:.2f} "
                        f"| {bound} |")
            ag = med(f"allgather@{key}")
            tb = s[f"tree_bcast@{key}"]
            tree = _median([v[0] for v in tb])
            total = _median([v[1] for v in tb])
            brk.append(f"| {p} | {d:g} | {_ms(ag)} | {_ms(tree)} | {_ms(total - tree)} | "
                       f"{_ms(total)} | {ag / total:.2f} | {_ms(med(f'merges@{key}'))} | "
                       f"{_ms(med(f'decode@{key}'))} |")
    return "\n".join(
        ["Time per call, median over rounds, each call's time the max over ranks; IQR in "
         "brackets; 'gTop-k faster' counts the rounds (interleaved, paired) where gTop-k's call "
         "took less than Top-k's.", "", *main, "",
         "Bytes per call (WireStats: what each rank hands to MPI; the broadcast counted as a "
         "binomial tree, the dense allreduce would be a ring's 2(P-1)/P x 4n per rank). "
         "Link-time bound: all ranks' bytes / link bandwidth, the floor on one shared link.",
         "", *wire, "",
         "Where the time goes, on a payload compressed beforehand (no compression, no decode "
         "in the first four columns):", "", *brk])


def run_all(args) -> str:
    from shaped_link import shaped_link

    if os.geteuid() != 0:
        sys.exit("sparse_timing.py needs root for the network namespace (ip netns, tc)")
    # the ranks import bagua_mpi from this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    gbits = [None if g.strip().lower() in ("none", "off", "0") else float(g)
             for g in args.gbit.split(",")]
    sizes = [int(p) for p in args.np.split(",")]
    sections, loads = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for gbit in gbits:
            results = {}
            for p in sizes:
                label = "unshaped" if gbit is None else f"{gbit:g} Gbit/s"
                load = os.getloadavg()
                loads.append((label, p, load))
                print(f"--- P={p}, {label}, load average {load[0]:.2f} {load[1]:.2f} "
                      f"{load[2]:.2f}", flush=True)
                path = os.path.join(scratch, f"p{p}_{gbit}.json")
                with shaped_link(gbit, burst=args.burst) as link:
                    link.run(["mpiexec", "-n", str(p), sys.executable, os.path.abspath(__file__),
                              "--inner", "--json", path, "--numel", str(args.numel),
                              "--densities", args.densities, "--rounds", str(args.rounds),
                              "--warmup", str(args.warmup), "--dense-rounds",
                              str(args.dense_rounds), "--seed", str(args.seed)])
                with open(path) as fh:
                    results[p] = json.load(fh)
                print(f"    {results[p]['seconds']:.0f} s", flush=True)
                if args.json_out:
                    with open(args.json_out, "w") as fh:
                        json.dump({"gbit": gbit, "results": results}, fh)
            head = ("TCP over one loopback shaped to "
                    f"{gbit:g} Gbit/s (tc tbf, burst {args.burst}), shared by all ranks"
                    if gbit is not None
                    else "TCP over an unshaped loopback (no tc)")
            sections.append(f"### {head}\n\n" + tables(results, gbit))
    load = os.getloadavg()
    loads.append(("end", 0, load))
    mpi = next(iter(results.values()))["mpi"]
    lines = [f"Gradient: {args.numel / 1e6:g}M float32 ({4 * args.numel / 1e6:.0f} MB) per rank, "
             f"seeded per rank (N(0,1), different on every rank, so the ranks' top-k index sets "
             f"barely overlap: the worst case for gTop-k's merges); int32 indices. "
             f"{args.rounds} rounds after {args.warmup} warm-up round(s); dense over "
             f"{args.dense_rounds} round(s). {mpi}.",
             "",
             "Load average (1, 5, 15 min) before each run: " + "; ".join(
                 f"{lab + (f' P={p}' if p else '')}: {a:.2f} {b:.2f} {c:.2f}"
                 for lab, p, (a, b, c) in loads) + ".",
             "", *sections]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--np", default="2,4,8", help="comma-separated world sizes")
    parser.add_argument("--gbit", default="1",
                        help="comma-separated link bandwidths in Gbit/s; 'none': unshaped")
    parser.add_argument("--numel", type=int, default=25_000_000, help="gradient elements")
    parser.add_argument("--densities", default="0.001,0.01")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dense-rounds", type=int, default=3,
                        help="rounds that include the dense allreduce (0: skip it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--burst", default="128kb",
                        help="tc tbf bucket; larger lets a message that size pass unshaped "
                        "after an idle gap (shaped_link's default, 4mb, is 32 ms at 1 Gbit/s)")
    parser.add_argument("--markdown", help="write the tables (with the command) here")
    parser.add_argument("--json-out", help="also keep every sample here")
    args = parser.parse_args()
    if args.inner:
        inner(args)
        return
    text = run_all(args)
    print(text)
    if args.markdown:
        cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        caveat = ("Machine: 2 CPU cores shared with other work; every rank runs on it, so P=4 "
                  "oversubscribes the cores 2x and P=8 4x: compression, merges and decoding "
                  "(and MPI's busy-polling waiters) inflate with P, and the compute-side "
                  "columns are not what one rank per node would see. On one shared link the "
                  "total bytes of all ranks bound the time (Top-k's all-gather puts P(P-1)k "
                  "pairs on it, gTop-k's tree 2(P-1)k with a binomial broadcast); on a switched "
                  "full-duplex network only the per-rank critical path would count (Top-k: "
                  "(P-1)k pairs per rank in parallel, gTop-k: 2 ceil(log2 P) sequential "
                  "k-pair hops plus merges).")
        with open(args.markdown, "w") as fh:
            fh.write(f"Command (as root): `{cmd}`\n\n{caveat}\n\n{text}\n")


if __name__ == "__main__":
    main()
