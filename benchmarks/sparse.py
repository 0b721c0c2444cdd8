"""Sparse and adaptive compression: gTop-k's O(k log P) bytes, and L-GreCo against uniform.

Bytes per rank per step of dense allreduce, Top-k and gTop-k as P grows (counted from message
sizes, so P up to 16 fits on one machine):

    python benchmarks/sparse.py --bytes 2,4,8,16 --markdown benchmarks/results/sparse_bytes.md

L-GreCo against uniform compression on a model with heterogeneous layers (a small causal
transformer LM: sparse token embedding, attention, feed-forward, layer norms, dense head).
Every row trains the same model on the same batches; "uniform" is the same code path with one
level on every layer and no decisions. The best uniform setting is the one with the fewest
bytes whose held-out loss is within ``--tolerance`` of float32's; L-GreCo then runs from that
default (and from ``--lgreco-default``). Reports loss, bytes per step, step time and the share
of training time its decisions took:

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/sparse.py --lgreco minmax \
        --optimizer sgd --lr 0.3 --markdown benchmarks/results/lgreco_minmax.md
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/sparse.py --lgreco topk \
        --levels 0.03,0.1,0.3 --lgreco-default 0.1 --optimizer sgd --lr 0.3 --markdown F

Time of the Top-k and gTop-k aggregations on a shaped 1 Gbit link as P grows:
``benchmarks/sparse_timing.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time


def inner_bytes(args) -> None:
    import torch
    from mpi4py import MPI

    import bagua_mpi as bm

    bm.init()
    bm.set_consistency_check(False)
    rows = {}
    for name, algo in (("dense", "gradient_allreduce"),
                       ("topk", bm.algorithms.TopK(density=args.density)),
                       ("gtopk", bm.algorithms.GTopK(density=args.density))):
        torch.manual_seed(0)
        model = torch.nn.Linear(args.numel // 8, 8, bias=False)
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      algorithm=algo, bucket_size_mb=1024)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, args.numel // 8)).square().sum().backward()
            opt.step()
        per_rank = opt.communication_stats()["bytes_per_step"]
        rows[name] = MPI.COMM_WORLD.allreduce(per_rank, op=MPI.MAX)
        opt.close()
    if bm.rank() == 0:
        with open(args.json, "w") as fh:
            json.dump(rows, fh)
    bm.shutdown()


def bytes_sweep(args) -> str:
    sizes = [int(p) for p in args.bytes.split(",")]
    results = {}
    for p in sizes:
        path = f"/tmp/bagua_sparse_{os.getpid()}_{p}.json"
        subprocess.run(["mpiexec", "-n", str(p), sys.executable, __file__, "--inner-bytes",
                        "--json", path, "--numel", str(args.numel), "--density",
                        str(args.density)], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", BAGUA_MPI_KERNEL_THREADS="1"))
        with open(path) as fh:
            results[p] = json.load(fh)
    k = max(1, round(args.density * args.numel))
    lines = [f"gradient of {args.numel / 1e6:.1f}M float32, density {args.density} (k = {k}, "
             f"int32 indices: {8 * k} bytes a payload); most bytes any rank sends per step",
             "", "| P | dense MB | Top-k KB | gTop-k KB | Top-k / (k pairs) | gTop-k / (k pairs) "
             "| log2 P |", "|---|---|---|---|---|---|---|"]
    for p in sizes:
        r = results[p]
        lines.append(f"| {p} | {r['dense'] / 1e6:.2f} | {r['topk'] / 1e3:.1f} | "
                     f"{r['gtopk'] / 1e3:.1f} | {r['topk'] / (8 * k):.1f} | "
                     f"{r['gtopk'] / (8 * k):.1f} | {math.log2(p):.1f} |")
    return "\n".join(lines)


class TinyLM:
    """A two-layer causal transformer language model: layers of very different sizes and
    gradient statistics (a sparse token embedding, attention, feed-forward, layer norms, a
    dense output head), as L-GreCo's evaluation models have."""

    @staticmethod
    def build(vocab, width, context):
        import torch

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.tok = torch.nn.Embedding(vocab, width)
                self.pos = torch.nn.Embedding(context, width)
                layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0,
                                                         batch_first=True)
                self.body = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
                self.norm = torch.nn.LayerNorm(width)
                self.head = torch.nn.Linear(width, vocab)
                self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(
                    context), persistent=False)

            def forward(self, x):
                h = self.tok(x) + self.pos.weight[:x.shape[1]]
                h = self.body(h, mask=self.mask[:x.shape[1], :x.shape[1]], is_causal=True)
                return self.head(self.norm(h))

        return Model()


def markov_source(vocab, branching, seed):
    """A fixed sparse Markov chain: each token has ``branching`` successors with Zipf-like
    probabilities, so the best achievable loss is the chain's entropy rate."""
    import numpy as np
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, branching))
    weights = 1.0 / np.arange(1, branching + 1)
    probs = rng.permuted(np.tile(weights, (vocab, 1)), axis=1)
    probs /= probs.sum(axis=1, keepdims=True)
    return successors, np.cumsum(probs, axis=1)


def sample_sequences(source, count, length, rng):
    import numpy as np
    successors, cdf = source
    out = np.empty((count, length), dtype=np.int64)
    out[:, 0] = rng.integers(0, successors.shape[0], count)
    for t in range(1, length):
        u = rng.random(count)[:, None]
        pick = np.minimum((u > cdf[out[:, t - 1]]).sum(axis=1), successors.shape[1] - 1)
        out[:, t] = successors[out[:, t - 1], pick]
    return out


def lgreco_variants(family, uniform_levels, lgreco_defaults, args):
    """(label, kind, level, algorithm) for the uniform settings and L-GreCo runs."""
    from bagua_mpi.lgreco import LGreCo
    rows = []
    for level in uniform_levels:
        # the same code path with no decisions: every layer keeps the level (the paper's
        # uniform baseline; bucket-wide top-k would already adapt across layers)
        name = {"minmax": f"{level}-bit", "topk": f"density {level:g}",
                "powersgd": f"rank {level}"}[family]
        rows.append((f"uniform {name}", "uniform", level,
                     LGreCo(family=family, default=level, warmup_steps=10**9)))
    for level in lgreco_defaults:
        rows.append((f"L-GreCo (default {level:g})", "lgreco", level,
                     LGreCo(family=family, default=level, warmup_steps=args.lgreco_warmup,
                            period_steps=args.lgreco_period)))
    return rows


def lgreco_run(args) -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    import bagua_mpi as bm

    bm.init()
    bm.set_consistency_check(False)
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    source = markov_source(args.vocab, 4, seed=1)
    held_out = torch.from_numpy(sample_sequences(source, 256, args.context,
                                                 np.random.default_rng(12345)))

    def train(algorithm):
        torch.manual_seed(0)
        model = TinyLM.build(args.vocab, args.width, args.context)
        base = (torch.optim.Adam(model.parameters(), lr=args.lr) if args.optimizer == "adam"
                else torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
        opt = bm.DistributedOptimizer(base,
                                      named_parameters=model.named_parameters(),
                                      algorithm=algorithm)
        rng = np.random.default_rng([rank, 7])
        batches = [torch.from_numpy(sample_sequences(source, args.batch, args.context, rng))
                   for _ in range(args.steps)]
        world.Barrier()
        t0 = time.perf_counter()
        for x in batches:
            opt.zero_grad()
            logits = model(x[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab),
                                              x[:, 1:].reshape(-1)).backward()
            opt.step()
        elapsed = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        with torch.no_grad():
            logits = model(held_out[:, :-1])
            loss = float(torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab),
                                                           held_out[:, 1:].reshape(-1)))
        stats = opt.communication_stats()
        decided = world.allreduce(getattr(opt.impl, "decision_seconds", 0.0), op=MPI.MAX)
        startup = world.allreduce(getattr(opt.impl, "startup_seconds", 0.0), op=MPI.MAX)
        assignment = dict(getattr(opt.impl, "assignment", {}))
        layers = {name: p.numel() for name, p in model.named_parameters()}  # model order
        opt.close()
        return dict(loss=world.bcast(loss), bytes=world.allreduce(stats["bytes_per_step"],
                                                                  op=MPI.MAX),
                    step=elapsed / args.steps, share=decided / elapsed, startup=startup,
                    assignment=assignment, layers=layers)

    family = args.lgreco
    levels = [float(v) if family == "topk" else int(v) for v in args.levels.split(",")]
    results = [("float32", "dense", None, train("gradient_allreduce"))]
    for label, kind, level, algo in lgreco_variants(family, levels, [], args):
        results.append((label, kind, level, train(algo)))
    target = results[0][3]["loss"] * (1 + args.tolerance)
    good = [r for r in results if r[1] == "uniform" and r[3]["loss"] <= target]
    best = min(good, key=lambda r: r[3]["bytes"]) if good else None
    # L-GreCo starts from the best uniform setting (the paper's default) and from --lgreco-default
    given = float(args.lgreco_default) if family == "topk" else int(args.lgreco_default)
    defaults = sorted({given} | ({best[2]} if best else set()))
    for label, kind, level, algo in lgreco_variants(family, [], defaults, args):
        results.append((label, kind, level, train(algo)))
    if rank == 0:
        text = lgreco_table(args, results, best, target)
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write(text + "\n")
    bm.shutdown()


def lgreco_table(args, results, best, target) -> str:
    import os as _os
    dense = results[0][3]
    n_params = sum(dense["layers"].values())
    optimizer = "Adam" if args.optimizer == "adam" else "SGD momentum 0.9"
    lines = [f"Command: `OMP_NUM_THREADS=1 mpiexec -n {args.np_hint} python benchmarks/sparse.py "
             f"{' '.join(sys.argv[1:])}` (load average {_os.getloadavg()[0]:.1f})", "",
             f"Model: causal transformer LM, 2 layers, width {args.width}, vocab {args.vocab}, "
             f"context {args.context} ({n_params / 1e6:.2f}M parameters in "
             f"{len(dense['layers'])} tensors); data from a fixed sparse Markov chain; "
             f"{optimizer}, lr {args.lr}, batch {args.batch} sequences per rank, "
             f"{args.steps} steps. Same "
             f"seeds and batches for every row. \"Same loss\": held-out loss within "
             f"{args.tolerance:.0%} of float32's ({target:.4f}). L-GreCo: warm-up "
             f"{args.lgreco_warmup} steps, a decision every {args.lgreco_period} steps.", "",
             "| variant | held-out loss | same loss | KB/rank/step | ratio vs float32 | "
             "step ms | decision share |", "|---|---|---|---|---|---|---|"]
    for label, _, _, r in results:
        lines.append(f"| {label} | {r['loss']:.4f} | {'yes' if r['loss'] <= target else 'no'} | "
                     f"{r['bytes'] / 1e3:.1f} | {dense['bytes'] / r['bytes']:.1f}x | "
                     f"{r['step'] * 1e3:.1f} | {r['share'] * 100:.2f}% |")
    lines.append("")
    if best is None:
        lines.append("No uniform setting reached the same loss.")
    else:
        lines.append(f"Best uniform setting at the same loss: {best[0]}, "
                     f"{best[3]['bytes'] / 1e3:.1f} KB/rank/step.")
        for label, kind, _, r in results:
            if kind == "lgreco":
                verdict = "same loss" if r["loss"] <= target else "NOT the same loss"
                lines.append(f"- {label}: the best uniform setting sends "
                             f"{best[3]['bytes'] / r['bytes']:.2f}x L-GreCo's bytes ({verdict}); "
                             f"decisions {r['share'] * 100:.2f}% of training time (plus "
                             f"{r['startup']:.2f} s once, loading the compiled DP).")
    lines.append("")
    lines.append(f"Iso-loss view: for each L-GreCo run, the cheapest uniform setting whose loss is "
                 f"no worse than L-GreCo's (within {args.tolerance:.0%}):")
    for label, kind, _, r in results:
        if kind != "lgreco":
            continue
        matched = [u for u in results if u[1] == "uniform"
                   and u[3]["loss"] <= r["loss"] * (1 + args.tolerance)]
        if matched:
            u = min(matched, key=lambda row: row[3]["bytes"])
            lines.append(f"- {label} (loss {r['loss']:.4f}, {r['bytes'] / 1e3:.1f} KB): {u[0]} "
                         f"(loss {u[3]['loss']:.4f}, {u[3]['bytes'] / 1e3:.1f} KB), "
                         f"{u[3]['bytes'] / r['bytes']:.2f}x L-GreCo's bytes. Decisions "
                         f"{r['share'] * 100:.2f}% of training time, plus {r['startup']:.2f} s "
                         f"once at start (loading the compiled DP).")
        else:
            lines.append(f"- {label} (loss {r['loss']:.4f}): no uniform setting tried was as good.")
    for label, kind, _, r in results:
        if kind == "lgreco":
            # the assignment is keyed by parameter name, as L-GreCo keeps it
            chosen = ", ".join(f"{name} ({numel}): {r['assignment'][name]:g}"
                               for name, numel in r["layers"].items() if name in r["assignment"])
            lines.append(f"\n{label}, last assignment (tensor (elements): level): {chosen}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", help="comma-separated world sizes for the bytes sweep")
    parser.add_argument("--inner-bytes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lgreco", choices=["minmax", "topk", "powersgd"],
                        help="L-GreCo against uniform settings of this compressor family")
    parser.add_argument("--levels", default="2,3,4,8",
                        help="uniform settings to try (bits; densities with --lgreco topk; "
                        "ranks with --lgreco powersgd)")
    parser.add_argument("--lgreco-default", default="4", help="L-GreCo's default level, run in "
                        "addition to the best uniform setting")
    parser.add_argument("--lgreco-warmup", type=int, default=50)
    parser.add_argument("--lgreco-period", type=int, default=100)
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--context", type=int, default=33)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                        help="Adam, or SGD with momentum 0.9")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--json")
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    args.np_hint = os.environ.get("PMI_SIZE", "4")
    if args.inner_bytes:
        inner_bytes(args)
    elif args.lgreco:
        lgreco_run(args)
    elif args.bytes:
        text = bytes_sweep(args)
        print(text)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write(f"Command: `python benchmarks/sparse.py --bytes {args.bytes}`\n\n"
                         + text + "\n")
    else:
        parser.error("choose --bytes P1,P2,... or --lgreco")


if __name__ == "__main__":
    main()
