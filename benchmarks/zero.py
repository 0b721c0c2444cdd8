"""ZeRO: memory and step time of zero_stage 0, 1 and 2 (and compressed stage 2), interleaved.

    python benchmarks/zero.py [--ranks 1 2 4] [--rounds 3] [--steps 5] [--gbit 1]
                              [--variants stage0 stage1 stage2 ...] [--markdown FILE]

The model is the README's MLP (Linear 1024->4096->4096->10, 21.0M parameters) with Adam,
batch 16 per rank. Each variant runs as its own ``mpiexec -n N`` job and the jobs are
interleaved (round 1 runs every variant once, then round 2, ...); the table gives each
variant's median round and its ratio to stage 0 of the same round.

Per rank, after the last step (maximum over ranks):

* ``state MB``: bytes of the optimizer's state tensors (``opt.memory_stats()``); the target
  is 1/n of stage 0's within 5%;
* ``grad MB``: bytes of gradient buffers still held (bucket buffers, plus the reduced slices
  at stage 2); the target at stage 2 is 1/n of stage 0's plus one bucket within 10%;
* ``peak RSS MB``: the process's peak resident set (``ru_maxrss``), model and data included;
* ``sent MB/step``: bytes this rank handed to MPI per step.

``--gbit G`` (root) runs every job in a network namespace whose loopback is shaped to G Gbit/s
(``shaped_link.py``), each rank posing as its own node, so every byte crosses the slow link.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
VARIANTS = {  # name -> (zero_stage, algorithm, compression)
    "stage0": (0, "gradient_allreduce", "none"),
    "stage1": (1, "gradient_allreduce", "none"),
    "stage2": (2, "gradient_allreduce", "none"),
    "stage2-fp16": (2, "gradient_allreduce", "fp16"),
    "stage2-bytegrad": (2, "bytegrad", "none"),
    "stage2-qsgd": (2, "qsgd", "none"),
}
DEFAULT = ["stage0", "stage1", "stage2", "stage2-bytegrad"]


def worker(args) -> None:
    """One job: train ``args.steps`` timed steps (after 2 untimed) of one variant."""
    import torch

    import bagua_mpi as bm

    bm.init()
    stage, algorithm, compression = VARIANTS[args.variant]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 10))
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                  named_parameters=model.named_parameters(),
                                  algorithm=algorithm, compression=compression,
                                  zero_stage=stage)
    g = torch.Generator().manual_seed(bm.rank())
    x, y = torch.randn(16, 1024, generator=g), torch.randint(0, 10, (16,), generator=g)
    times = []
    for step in range(args.steps + 2):
        bm.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    stats = opt.memory_stats()
    comm = opt.communication_stats()
    mine = {"step_ms": 1000 * statistics.median(times),
            "state_mb": stats["optimizer_state_bytes"] / 2 ** 20,
            "grad_mb": stats["gradient_bytes"] / 2 ** 20,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "sent_mb": comm["bytes_per_step"] / 2 ** 20,
            "bucket_mb": max(b.nbytes for b in opt.buckets) / 2 ** 20}
    everyone = bm.allgather_object(mine)
    if bm.rank() == 0:
        worst = {k: max(r[k] for r in everyone) for k in mine}
        print("RESULT " + json.dumps(worst), flush=True)
    opt.close()
    bm.shutdown()


def run_job(args, variant: str, ranks: int, link) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)))
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, HERE, "--worker", "--variant", variant,
           "--steps", str(args.steps)]
    if link is not None:   # every rank its own node
        from shaped_link import one_rank_per_node
        env = dict(env, **link.env)
        cmd = link.prefix + one_rank_per_node(ranks) + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{variant} on {ranks} ranks failed:\n{out.stdout}\n{out.stderr}")


def table(ranks: int, rounds: list[dict], variants: list[str]) -> list[str]:
    lines = [f"### {ranks} rank(s)", "",
             "| variant | step ms | vs stage0 | state MB | grad MB | peak RSS MB | sent MB/step |",
             "|---|---|---|---|---|---|---|"]
    for v in variants:
        step = statistics.median(r[v]["step_ms"] for r in rounds)
        ratio = statistics.median(r[v]["step_ms"] / r["stage0"]["step_ms"] for r in rounds)
        last = rounds[-1][v]
        lines.append(f"| {v} | {step:.0f} | {ratio:.2f}x | {last['state_mb']:.1f} | "
                     f"{last['grad_mb']:.1f} | {last['rss_mb']:.0f} | {last['sent_mb']:.1f} |")
    base = rounds[-1]["stage0"]
    for v in variants:
        if v == "stage0":
            continue
        got = rounds[-1][v]
        lines.append("")
        lines.append(f"{v}: state {got['state_mb'] / base['state_mb']:.3f} of stage 0's "
                     f"(1/n = {1 / ranks:.3f}); grads {got['grad_mb']:.1f} MB against "
                     f"1/n of stage 0's + one bucket = "
                     f"{base['grad_mb'] / ranks + base['bucket_mb']:.1f} MB")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="stage0")
    parser.add_argument("--variants", nargs="+", default=DEFAULT, choices=list(VARIANTS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gbit", type=float)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    variants = ["stage0"] + [v for v in args.variants if v != "stage0"]
    lines = [f"command: `python benchmarks/zero.py {' '.join(sys.argv[1:])}`",
             f"cores: {os.cpu_count()}; MLP 21.0M parameters, Adam, batch 16 per rank; median of "
             f"{args.rounds} interleaved rounds x {args.steps} timed steps", ""]

    def run_all(link):
        for ranks in args.ranks:
            rounds = []
            for _ in range(args.rounds):
                rounds.append({v: run_job(args, v, ranks, link) for v in variants})
            lines.extend(table(ranks, rounds, variants))
            print("\n".join(lines[-(len(variants) * 2 + 6):]), flush=True)

    if args.gbit is not None:
        sys.path.insert(0, os.path.dirname(HERE))
        from shaped_link import shaped_link

        lines.insert(2, f"link: TCP over one loopback shaped to {args.gbit:g} Gbit/s, shared by "
                        f"all ranks (benchmarks/shaped_link.py); each rank its own node")
        with shaped_link(args.gbit) as link:
            run_all(link)
    else:
        run_all(None)
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
