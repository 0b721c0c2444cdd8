"""Training step time: bagua_mpi against Horovod and DDP (gloo), interleaved in one run.

    python benchmarks/step_time.py [--ranks 2 4] [--models mlp resnet] [--rounds 3]
                                   [--steps 6] [--device cpu|cuda] [--gbit 1]
                                   [--markdown benchmarks/results/step_time.md]

Each variant runs as its own ``mpiexec -n N`` job (so an idle Horovod background thread never
competes with another variant for the cores), and the jobs are interleaved: round 1 runs every
variant once, round 2 again, ... ; the median round is reported. Every variant trains the same
model from the same initial weights on the same per-rank data, batch ``--batch`` per rank, SGD
with momentum. ``--device cuda`` puts every rank's model and data on GPU 0 (the ranks share it;
DDP's gloo and bagua_mpi's staged payloads go through host memory). ``--gbit G`` (root) runs
every job in a network namespace whose loopback is shaped to G Gbit/s, all ranks sharing it,
with MPICH on TCP there and each rank posing as its own node (``BAGUA_MPI_RANKS_PER_NODE=1``),
so every library's bytes cross the slow link.

Models: ``mlp`` = Linear 1024->4096->4096->10 (21.0M parameters, three large tensors);
``resnet`` = a CIFAR-style ResNet (3 stages x 3 basic blocks, widths 32/64/128, 32x32 inputs:
1.1M parameters in 65 tensors, many small).

Variants:
  no-comm        local training, no communication (the floor)
  ddp-gloo       torch DistributedDataParallel over gloo
  horovod        horovod.torch.DistributedOptimizer (skipped, with the reason, if Horovod
                 cannot be imported by ``--horovod-python``)
  horovod-fp16   ... with hvd.Compression.fp16
  bagua          bagua_mpi.DistributedOptimizer, gradient_allreduce, defaults (check off)
  bagua-fp16     ... with compression="fp16"
  bagua-overlap-on, bagua-overlap-off, bagua-fp16-overlap-on/off
                 (not run by default) the automatic overlap choice forced either way
  raw-allreduce  not a training step: one mpi4py Allreduce of all gradient bytes, and of 4 KiB,
                 against bagua_mpi.allreduce_ of the same (the wire time and the latency)

``overhead`` = step - no-comm; ``wire`` = the raw mpi4py allreduce of the model's gradient
bytes measured in the same round. The goal this answers: bagua <= 0.9 x Horovod and DDP, and
overhead <= 2 x wire.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
VARIANTS = ["no-comm", "ddp-gloo", "horovod", "horovod-fp16", "bagua", "bagua-fp16",
            "raw-allreduce"]


# -- models (built identically in every job) ------------------------------------------------------
def make_model(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 10))

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                        nn.BatchNorm2d(cout)) if stride != 1 or cin != cout
                          else nn.Identity())

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.b2(self.c2(y)) + self.short(x))

    layers, cin = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()], 32
    for stage, width in enumerate((32, 64, 128)):
        for block in range(3):
            layers.append(Block(cin, width, 2 if stage and not block else 1))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def make_batch(model: str, rank: int, size: int, device: str = "cpu"):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    shape = (size, 1024) if model == "mlp" else (size, 3, 32, 32)
    return (torch.randn(*shape, generator=g).to(device),
            torch.randint(0, 10, (size,), generator=g).to(device))


# -- one job: one variant ---------------------------------------------------------------------------
def timed(fn, iters: int, comm, warmups: int = 1) -> float:
    """Seconds per call of the slowest rank, after ``warmups`` untimed calls (two for training
    steps: bagua_mpi profiles the first one, Horovod negotiates its first)."""
    from mpi4py import MPI

    for _ in range(warmups):
        fn()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)


def job(variant: str, model_name: str, batch: int, steps: int, device: str = "cpu") -> dict:
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if device == "cuda":
        torch.cuda.set_device(0)
    model = make_model(model_name).to(device)
    x, y = make_batch(model_name, rank, batch, device)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"variant": variant, "ranks": size, "model": model_name, "grad_bytes": nbytes,
              "device": device}

    if variant == "raw-allreduce":
        import numpy as np

        import bagua_mpi as bm

        bm.init()
        bm.set_consistency_check(False)
        out = {}
        for label, n in (("4KiB", 1024), ("grads", nbytes // 4)):
            t = torch.from_numpy(np.ones(n, dtype=np.float32))
            a = t.numpy()  # the same memory for both: only the call path differs
            iters = 200 if n == 1024 else 3
            raw = []
            ours = []
            for _ in range(3):  # interleaved
                raw.append(timed(lambda: world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM),
                                      iters, world))
                ours.append(timed(lambda: bm.allreduce_(t, bm.Sum), iters, world))
            out[f"raw_{label}_s"] = statistics.median(raw)
            out[f"bagua_{label}_s"] = statistics.median(ours)
        bm.shutdown()
        result.update(out)
        return result

    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt, net, cleanup = sgd, model, None
    if variant == "ddp-gloo":
        import torch.distributed as dist

        port = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = world.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        cleanup = dist.destroy_process_group
    elif variant.startswith("horovod"):
        import horovod.torch as hvd

        hvd.init(comm=world)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = hvd.Compression.fp16 if variant.endswith("fp16") else hvd.Compression.none
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       compression=compression)
        cleanup = hvd.shutdown
    elif variant.startswith("bagua"):
        import bagua_mpi as bm

        bm.init()
        bm.set_consistency_check(False)
        options = {"compression": "fp16"} if "fp16" in variant else {}
        if "overlap-" in variant:  # diagnostic variants: the automatic choice forced
            options["overlap"] = variant.endswith("overlap-on")
        opt = bm.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **options)
        result["overlap"] = opt.overlap

        def cleanup():
            opt.close()
            bm.shutdown()

    def step():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if device == "cuda":  # the step is done when the GPU has applied it
            torch.cuda.synchronize()

    result["step_s"] = timed(step, steps, world, warmups=2)
    if cleanup is not None:
        cleanup()
    return result


# -- the driver --------------------------------------------------------------------------------------
def launch(python: str, variant: str, ranks: int, args, link=None) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    cmd = ["mpiexec", "-n", str(ranks), python, HERE, "--job", variant, "--model", args.model,
           "--batch", str(args.batch), "--steps", str(args.steps), "--device", args.device]
    if link is not None:   # every rank its own node
        from shaped_link import one_rank_per_node
        cmd = (link.prefix + ["OMP_NUM_THREADS=" + env["OMP_NUM_THREADS"]]
               + one_rank_per_node(ranks) + cmd)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"variant": variant, "error": f"rc {proc.returncode}: " + " | ".join(tail)}


def device_label(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    return f"{torch.cuda.get_device_name(0)} (every rank on GPU 0)"


def horovod_missing(python: str) -> str | None:
    probe = subprocess.run([python, "-c", "import horovod.torch"], capture_output=True,
                           text=True)
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or ["import failed"])[-1]


def table(model: str, ranks: int, rounds: list[dict], variants: list[str]) -> list[str]:
    def med(variant, key="step_s"):
        vals = [r[variant][key] for r in rounds if variant in r and key in r[variant]]
        return statistics.median(vals) if vals else None

    floor, wire = med("no-comm"), med("raw-allreduce", "raw_grads_s")
    ref = {"horovod": med("horovod"), "ddp-gloo": med("ddp-gloo")}
    out = [f"### {model}, {ranks} ranks", "",
           "| variant | step ms | / horovod | / ddp-gloo | overhead ms | overhead / wire |",
           "|---|---|---|---|---|---|"]

    def ratio(a, b):
        return f"{a / b:.3f}" if a is not None and b else "-"

    for v in [v for v in variants if v != "raw-allreduce"]:
        s = med(v)
        if s is None:
            errors = [r[v].get("error") or r[v].get("skipped") for r in rounds if v in r]
            out.append(f"| {v} | - ({errors[0] if errors else 'not run'}) | | | | |")
            continue
        over = s - floor if floor is not None else None
        chosen = [r[v]["overlap"] for r in rounds if "overlap" in r.get(v, {})]
        label = f"{v} (overlap {'on' if chosen[0] else 'off'})" if chosen else v
        out.append(f"| {label} | {s * 1e3:.1f} | {ratio(s, ref['horovod'])} | "
                   f"{ratio(s, ref['ddp-gloo'])} | "
                   f"{over * 1e3:.1f} | {ratio(over, wire)} |" if over is not None else
                   f"| {label} | {s * 1e3:.1f} | | | | |")
    if wire is not None:
        small_raw, small_ours = med("raw-allreduce", "raw_4KiB_s"), med("raw-allreduce",
                                                                         "bagua_4KiB_s")
        big_ours = med("raw-allreduce", "bagua_grads_s")
        mbytes = next(r["raw-allreduce"]["grad_bytes"] for r in rounds
                      if "raw-allreduce" in r) / 1e6
        out += ["", f"wire: raw mpi4py Allreduce of the {mbytes:.1f} MB of gradients "
                    f"{wire * 1e3:.1f} ms "
                    f"(bagua_mpi.allreduce_ {big_ours * 1e3:.1f} ms); 4 KiB: raw "
                    f"{small_raw * 1e6:.1f} us, bagua_mpi.allreduce_ (check off) "
                    f"{small_ours * 1e6:.1f} us (+{(small_ours - small_raw) * 1e6:.1f} us)"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--horovod-python", default=sys.executable)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gbit", type=float,
                        help="run every job over a loopback shaped to this many Gbit/s (root)")
    parser.add_argument("--markdown")
    args = parser.parse_args()

    if args.job:
        result = job(args.job, args.model, args.batch, args.steps, args.device)
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return

    missing = horovod_missing(args.horovod_python)
    lines = [f"command: `python benchmarks/{os.path.basename(HERE)} "
             + " ".join(sys.argv[1:]) + "`",
             f"cores: {os.cpu_count()}; device: {device_label(args.device)}; batch {args.batch} "
             f"per rank; median of {args.rounds} interleaved rounds x {args.steps} timed steps; "
             f"OMP_NUM_THREADS = cores / ranks",
             f"horovod: {'not importable: ' + missing if missing else 'imported by ' + args.horovod_python}",
             ""]
    if args.gbit is not None:
        sys.path.insert(0, os.path.dirname(HERE))
        from shaped_link import shaped_link

        lines.insert(2, f"link: TCP over one loopback shaped to {args.gbit:g} Gbit/s, shared by "
                        f"all ranks (benchmarks/shaped_link.py); each rank its own node")
        with shaped_link(args.gbit) as link:
            run_all(args, missing, lines, link)
    else:
        run_all(args, missing, lines, None)
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")


def run_all(args, missing, lines: list[str], link) -> None:
    """Every model x rank count x round x variant (interleaved), tables appended to lines."""
    for model in args.models:
        args.model = model
        for ranks in args.ranks:
            rounds = []
            for r in range(args.rounds):
                got = {}
                for v in args.variants:
                    if v.startswith("horovod") and missing:
                        got[v] = {"variant": v, "skipped": "Horovod not importable"}
                        continue
                    python = args.horovod_python if v.startswith("horovod") else sys.executable
                    got[v] = launch(python, v, ranks, args, link)
                    print(f"[{model} n={ranks} round {r}] {v}: "
                          f"{json.dumps(got[v])[:300]}", file=sys.stderr, flush=True)
                rounds.append(got)
            lines += table(model, ranks, rounds, args.variants) + [""]


if __name__ == "__main__":
    main()
