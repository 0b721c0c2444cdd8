"""Model-parallel benchmark (DistBelief §3, the shape of the paper's Figure 3): training speed-up
of one model replica against the number of partitions, for a locally connected model and a fully
connected one of about the same size, with the bytes that cross partition boundaries per step and
each partition's compute.

    OMP_NUM_THREADS=1 python benchmarks/model_parallel.py --sweep --partitions 1 2 4 \\
        --markdown benchmarks/results/model_parallel.md

``--sweep`` (no MPI in this process) starts one ``mpiexec -n P`` job per (model, P), in
interleaved rounds, and keeps each configuration's best round. In a job of P ranks, the ranks are
the P partitions of one replica (``BlockModel``: every layer cut into P blocks of output units);
each step is forward, backward and a local SGD update of each partition's own parameters.
Recorded per partition: step time, time waiting for messages (compute = step - wait), CPU time
(``process_time``: its own work, whatever share of the cores it got), payload bytes it sent
(activations forward, gradients backward) and its multiply-adds.

* locally connected: 3x36x36 images -> LC 16ch k5 -> LC 16ch k5 -> LC 2ch k4 stride 4; each
  partition owns a band of rows of every layer; the halo is k - stride rows per cut.
* fully connected: 1760 -> 1760 -> 1760 -> 98 (LinearBlocks); each partition owns a block of the
  output features; every block needs every input feature, so each cut moves whole activations.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def build(kind: str):
    """(layers, input shape without the batch, output shape) -- the same on every rank."""
    import torch
    from torch import nn

    from bagua_mpi import distbelief as db
    torch.manual_seed(0)
    if kind == "lc":
        layers = [db.LocallyConnected2d(3, 16, (36, 36), 5), nn.ReLU(),
                  db.LocallyConnected2d(16, 16, (32, 32), 5), nn.ReLU(),
                  db.LocallyConnected2d(16, 2, (28, 28), 4, stride=4)]
        return layers, (3, 36, 36), (2, 7, 7)
    d = 1760
    layers = [db.LinearBlocks(nn.Linear(d, d)), nn.ReLU(), db.LinearBlocks(nn.Linear(d, d)),
              nn.ReLU(), db.LinearBlocks(nn.Linear(d, 98))]
    return layers, (d,), (98,)


def run_job(args) -> None:
    """Inside mpiexec: the ranks are the partitions of one replica."""
    import torch
    from mpi4py import MPI

    from bagua_mpi import distbelief as db
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    layers, in_shape, out_shape = build(args.model)
    model = db.BlockModel(layers, comm)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, *in_shape, generator=gen)
    target = torch.randn(args.batch, *out_shape, generator=gen)

    def mse(out, y):
        return ((out - y) ** 2).mean()

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(x, target, mse).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    model.link.reset_counters()
    comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    mine = {"step_s": elapsed / args.steps, "wait_s": model.link.wait_s / args.steps,
            "cpu_s": cpu / args.steps,
            "bytes": model.link.bytes_sent / args.steps,
            "messages": model.link.messages_sent / args.steps,
            "macs": model.macs(args.batch), "params": int(model.param_range[1]
                                                         - model.param_range[0])}
    rows = np.array([[mine[k] for k in sorted(mine)]], dtype=np.float64)
    table = np.empty((comm.Get_size(), rows.shape[1]), dtype=np.float64)
    comm.Gather(rows, table, root=0)
    if comm.Get_rank() == 0:
        parts = [dict(zip(sorted(mine), (float(v) for v in row))) for row in table]
        print("RESULT " + json.dumps({"model": args.model, "partitions": comm.Get_size(),
                                      "numel": model.numel, "parts": parts}), flush=True)


def sweep(args) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                          if p]))
    best: dict = {}
    for rnd in range(args.rounds):
        for model in ("lc", "fc"):
            for p in args.partitions:
                cmd = ["mpiexec", "-n", str(p), sys.executable, __file__, "--run", "--model",
                       model, "--batch", str(args.batch), "--steps", str(args.steps),
                       "--warmup", str(args.warmup)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
                line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")),
                            None)
                if out.returncode != 0 or line is None:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
                res = json.loads(line[7:])
                res["step_s"] = max(part["step_s"] for part in res["parts"])
                key = (model, p)
                if key not in best or res["step_s"] < best[key]["step_s"]:
                    best[key] = res
                print(f"round {rnd} {model} P={p}: {1e3 * res['step_s']:.1f} ms/step", flush=True)
    return [best[k] for k in sorted(best)]


def markdown(results: list[dict], args, load: tuple[float, float]) -> str:
    names = {"lc": "locally connected", "fc": "fully connected"}
    out = ["# Model parallelism: one replica cut into partitions (DistBelief §3, Figure 3 shape)",
           "", f"Command: `{args.command}`", "",
           f"Machine: {os.cpu_count()} CPU cores, shared with other jobs (load average when the "
           f"sweep started / ended: {load[0]:.1f} / {load[1]:.1f}). Partitions are MPI ranks "
           f"with `OMP_NUM_THREADS=1` and one torch thread each; MPICH, CPU torch. **With 2 "
           f"cores the wall-clock speed-up of a lone job could never exceed 2**, and at 4 "
           f"partitions two ranks share each core. On this shared, loaded machine a job of P "
           f"processes also gets a larger share of the cores than a job of one, so wall-clock "
           f"speed-ups here can exceed the core count; they measure this machine, not the "
           f"method. The bytes, multiply-adds and CPU time per partition do not depend on the "
           f"share and carry to a cluster with one machine per partition.", "",
           f"Batch {args.batch}; best of {args.rounds} interleaved rounds of {args.steps} steps "
           f"(after {args.warmup} warm-up steps). Step = forward + backward + local SGD update; "
           f"step time is the slowest partition's. Speed-up = step time at 1 partition / step "
           f"time at P. Boundary bytes = activation and gradient payload sent across all cuts "
           f"per step (float32).", "",
           "CPU speed-up = CPU time per step at 1 partition / the largest partition's CPU time per "
           "step at P: the speed-up one core per partition would give if messages cost no "
           "latency (it counts the partitioning's extra work, not the shared machine's "
           "scheduling).", "",
           "| model | parameters | partitions | step (ms) | speed-up | CPU / partition, max (ms) "
           "| CPU speed-up | boundary bytes / step | bytes / multiply-add | max wait / partition "
           "(ms) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["model"]: r["step_s"] for r in results if r["partitions"] == 1}
    base_cpu = {r["model"]: r["parts"][0]["cpu_s"] for r in results if r["partitions"] == 1}
    for r in results:
        parts = r["parts"]
        total_bytes = sum(p["bytes"] for p in parts)
        macs = sum(p["macs"] for p in parts)
        cpu = max(p["cpu_s"] for p in parts)
        wait = max(p["wait_s"] for p in parts)
        out.append(f"| {names[r['model']]} | {r['numel']} | {r['partitions']} | "
                   f"{1e3 * r['step_s']:.1f} | {base[r['model']] / r['step_s']:.2f}x | "
                   f"{1e3 * cpu:.1f} | {base_cpu[r['model']] / cpu:.2f}x | "
                   f"{total_bytes:,.0f} | {total_bytes / macs:.4f} | {1e3 * wait:.1f} |")
    out += ["", "Per partition (the best round): parameters, forward multiply-adds per step, "
            "payload bytes sent per step, step, wait and CPU time.", "",
            "| model | P | partition | parameters | multiply-adds (fwd) | bytes sent | step (ms) "
            "| wait (ms) | CPU (ms) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["partitions"] == 1:
            continue
        for m, p in enumerate(r["parts"]):
            out.append(f"| {names[r['model']]} | {r['partitions']} | {m} | {p['params']:.0f} | "
                       f"{p['macs']:,.0f} | {p['bytes']:,.0f} | {1e3 * p['step_s']:.1f} | "
                       f"{1e3 * p['wait_s']:.1f} | {1e3 * p['cpu_s']:.1f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="driver: run the mpiexec jobs")
    parser.add_argument("--run", action="store_true", help="inside mpiexec: one job")
    parser.add_argument("--model", choices=["lc", "fc"], default="lc")
    parser.add_argument("--partitions", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    args.command = "OMP_NUM_THREADS=1 python " + " ".join(
        [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])
    if args.run:
        run_job(args)
        return
    if not args.sweep:
        parser.error("give --sweep (driver) or --run (inside mpiexec)")
    load0 = os.getloadavg()[0]
    results = sweep(args)
    text = markdown(results, args, (load0, os.getloadavg()[0]))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
