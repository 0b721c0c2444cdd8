"""Every registered algorithm trains a small CUDA model with DistributedOptimizer.

Run by ``tests/gpu/run.sh`` under ``mpiexec -n 2`` on one GPU (both ranks on cuda:0), once
with payloads staged through pinned host memory (``BAGUA_MPI_CUDA_AWARE=0``) and once with
device buffers handed to MPI where the MPI is CUDA-aware. Per algorithm it checks:

* the loss falls (every rank: final loss on its own shard < ``FALL`` x the first), or, with
  ``--timing-only``, at least stays finite;
* centralized algorithms end with identical parameters on both ranks (bit for bit);
* the compressed algorithms make no device->host copy of a dense tensor once compressing
  (``accounting.staging.dense_d2h_bytes`` stays 0; payload copies are counted separately),
  and with a CUDA-aware MPI no algorithm does (model averaging, ``async`` included). PowerSGD
  by design sends the layers it does not compress (here the two biases) through the plain
  dense allreduce: staged, it may copy those bytes and not one more;

* an algorithm that keeps its buckets' exchange plans (``opt.impl._plans``) views no tensor
  as a Numba array and asks for no new array in a step after the timed ones: the plans hold
  their views and the exchanges their payload buffers (``device_arrays.kept``);

and records the step time, so a compressed algorithm's step can be set against
``gradient_allreduce``'s on the same run, and the CUDA kernels of one more step (torch's
profiler: every thread's, the library's own and Numba's and NCCL's included). Rank 0 appends
one JSON line per algorithm to ``--out`` and prints a table. Before the algorithms, two checks
on the device: a broadcast of an optimizer's state (``optimizer_state_broadcast``) and a
checkpoint's exact resume (``checkpoint_resume``). Exit status 1 if any check failed
(all algorithms still run).
"""
import argparse
import json
import math
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

import bagua_mpi as bm
from bagua_mpi import backends
from bagua_mpi.accounting import staging

sys.path.append(str(Path(__file__).resolve().parent.parent / "mpi"))
from dispatch_count import ArraysAsked, cuda_kernels  # noqa: E402  (the tests' counters)

OVERRIDES = {
    "onebit_adam": dict(warmup_steps=10, chunk=1024),
    "lgreco": dict(warmup_steps=10, period_steps=20),
    "topk": dict(density=0.05),
    "gtopk": dict(density=0.05),
    "powersgd": dict(rank=2),
    "async": dict(sync_interval_ms=0, max_staleness=1),
}
WARMUP = {"onebit_adam": 10, "lgreco": 10}  # steps before the compressed stage
# no dense tensor may leave the device once these compress (staged through the library's
# copies, which ``accounting.staging`` counts; lgreco's rank-0 decision reads its accumulators
# on the host every period_steps, outside the exchange)
NO_DENSE_STAGING = {"qsgd", "bytegrad", "onebit_adam", "powersgd", "topk", "gtopk", "lgreco"}
# algorithms that leave some layers uncompressed by design: which parameters those are (in this
# script's model: PowerSGD compresses both weight matrices at rank 2, never a 1-D tensor)
UNCOMPRESSED = {"powersgd": lambda p: p.dim() < 2}
STEPS, FALL = 80, 0.5


def shard(rank, device):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1024, 64, generator=g)
    teacher = torch.linspace(-1, 1, 64 * 8).reshape(64, 8)
    y = torch.tanh(x @ teacher) + 0.05 * torch.randn(1024, 8, generator=g)
    return x.to(device), y.to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def optimizer_state_broadcast(comm, device) -> list[str]:
    """``broadcast_optimizer_state`` of an Adam's state on ``device``, which only rank 0 has,
    under the run's backend and under gloo (where a CUDA tensor takes MPI and a host tensor
    gloo: a rank receiving a CUDA state into a host tensor would take another wire than the
    root's). Every rank must end with rank 0's moments on its parameters' device. Returns the
    problems found (none: passed)."""
    problems = []
    for backend in (None, "gloo"):
        backends.set_default(backend)
        try:
            torch.manual_seed(comm.Get_rank())   # every rank's model and moments its own
            model = torch.nn.Linear(16, 4).to(device)
            opt = torch.optim.Adam(model.parameters())
            if comm.Get_rank() == 0:
                model(torch.randn(8, 16, device=device)).square().sum().backward()
                opt.step()
            bm.broadcast_optimizer_state(opt, root_rank=0)
            moments = [opt.state[p]["exp_avg"] for p in model.parameters()]
            mine = b"".join(m.cpu().numpy().tobytes() for m in moments)
            where = {str(m.device) for m in moments} == {str(device)}
            if comm.allgather(mine) != [comm.bcast(mine, root=0)] * comm.Get_size() or not where:
                problems.append(f"backend {backend or 'of the run'}: the moments differ from "
                                f"rank 0's or left {device} ({[str(m.device) for m in moments]})")
        except Exception as exc:  # noqa: BLE001 - reported with the others
            problems.append(f"backend {backend or 'of the run'}: {type(exc).__name__}: {exc}")
        finally:
            backends.set_default(None)
    return problems


# what the resume check trains: per-rank error feedback, PowerSGD's Q, 1-bit Adam past its
# warm-up, and ZeRO over optimizers whose 0-d state lives with the parameters (a fused Adam's
# step; ASGD's eta and mu)
RESUMES = {
    "qsgd": lambda params, device: (torch.optim.SGD(params, lr=0.05, momentum=0.9),
                                    {"algorithm": "qsgd"}),
    "powersgd": lambda params, device: (torch.optim.SGD(params, lr=0.05),
                                        {"algorithm": bm.algorithms.create("powersgd", rank=2)}),
    "onebit_adam": lambda params, device: (
        torch.optim.Adam(params, lr=1e-3),
        {"algorithm": bm.algorithms.create("onebit_adam", warmup_steps=2, chunk=1024)}),
    "zero1 fused Adam": lambda params, device: (torch.optim.Adam(params, lr=1e-3, fused=True),
                                                {"zero_stage": 1}),
    "zero1 ASGD": lambda params, device: (torch.optim.ASGD(params, lr=0.01), {"zero_stage": 1}),
}


def checkpoint_resume(comm, device) -> list[str]:
    """Each of ``RESUMES`` saved at step 3 of 6, rebuilt, loaded (every generator reseeded
    first) and run to step 6 on ``device``: the parameters must equal an uninterrupted run's
    bit for bit, with dropout drawing from the restored generators, and ``rng_restored`` be
    True. Returns the problems found (none: passed)."""
    folder = comm.bcast(tempfile.mkdtemp(prefix="bagua_mpi_resume_") if comm.Get_rank() == 0
                        else None, root=0)
    try:
        return _resume_each(comm, device, folder)
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)


def _resume_each(comm, device, folder) -> list[str]:
    problems = []
    x, y = (t[:64] for t in shard(comm.Get_rank(), device))

    def build(make):
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Dropout(0.2), torch.nn.Linear(128, 8)).to(device)
        inner, options = make(model.parameters(), device)
        return model, bm.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                              **options)

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    for label, make in RESUMES.items():
        try:
            model, opt = build(make)
            train(model, opt, 6)
            want = [p.detach().cpu().clone() for p in model.parameters()]
            opt.close()
            model, opt = build(make)
            train(model, opt, 3)
            saved = bm.checkpoint.save(f"{folder}/{label.replace(' ', '_')}", model, opt,
                                       step=3)
            opt.close()
            model, opt = build(make)
            torch.manual_seed(12345)   # only a restored generator gives the same dropout
            info = bm.checkpoint.load(saved, model, opt)
            train(model, opt, 3)
            opt.close()
            got = [p.detach().cpu() for p in model.parameters()]
            if not all(torch.equal(a, b) for a, b in zip(want, got)):
                problems.append(f"{label}: the resumed parameters differ from the "
                                f"uninterrupted run's")
            if not info.rng_restored:
                problems.append(f"{label}: rng_restored is False")
        except Exception as exc:  # noqa: BLE001 - reported with the others
            problems.append(f"{label}: {type(exc).__name__}: {exc}")
    return problems


def run_one(name, comm, device, mode, width=256, timing_only=False, profile_steps=0):
    rank = comm.Get_rank()
    algo = bm.algorithms.create(name, **OVERRIDES.get(name, {}))
    torch.manual_seed(0)
    middle = [torch.nn.Linear(width, width), torch.nn.ReLU()] if width > 256 else []
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), *middle,
                                torch.nn.Linear(width, 8)).to(device)
    # 1-bit Adam's frozen-variance stage diverges on the 21.5M-parameter MLP at lr 1e-3 and
    # above, with the momentum averaged exactly too, where plain Adam trains; 1e-4 trains
    # (benchmarks/results/onebit_adam_stability.md)
    adam_lr = 3e-3 if width <= 256 else 1e-4
    base = (torch.optim.Adam(model.parameters(), lr=adam_lr) if name == "onebit_adam"
            else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    opt = bm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                  algorithm=algo)
    x, y = shard(rank, device)
    loss_fn = torch.nn.MSELoss()
    with torch.no_grad():
        first = loss_fn(model(x), y).item()
    times = []
    counted_steps = STEPS - WARMUP.get(name, 0)

    def one_step(step):
        opt.zero_grad()
        i = (step * 64) % 1024
        loss_fn(model(x[i:i + 64]), y[i:i + 64]).backward()
        opt.step()
        sync(device)

    for step in range(STEPS):
        if step == WARMUP.get(name, 0):
            staging.reset()
        sync(device)
        t0 = time.perf_counter()
        one_step(step)
        times.append(time.perf_counter() - t0)
    snap = staging.snapshot()
    stats = opt.communication_stats()
    with torch.no_grad():   # the loss check covers the STEPS steps, not the profiled ones after
        last = loss_fn(model(x), y).item()
    # one more step with the kernels' arrays counted (what a kept plan must not ask for)
    with ArraysAsked() as asked:
        one_step(STEPS)
    views, new_arrays = len(asked.views), len(asked.new)
    kept_plans = len(opt.impl._plans)
    # one more under torch's profiler: every kernel it launched, on every thread (the bucket
    # exchanges', Numba's and NCCL's included), after the timed steps it would slow
    kernels = cuda_kernels(lambda: one_step(STEPS + 1)) if device.type == "cuda" else None
    profile = None
    if profile_steps:   # after the timed steps, which the sampler would slow down
        from stack_sampler import measure
        steps = iter(range(STEPS + 2, STEPS + 2 + profile_steps))
        profile = measure(lambda: one_step(next(steps)), profile_steps)
    backend = opt.backend
    opt.close()
    params = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    everyone = comm.allgather(params.numpy().tobytes())
    identical = all(e == everyone[0] for e in everyone)
    falls = comm.allgather(last < FALL * first)
    centralized = not algo.averages_models
    problems = []
    if not all(falls) and not timing_only:
        problems.append(f"loss did not fall below {FALL} x start on every rank "
                        f"(rank {rank}: {first:.4f} -> {last:.4f})")
    finite = comm.allgather(math.isfinite(last))
    if timing_only and not all(finite):   # a timing row still may not hide a divergence
        problems.append(f"the loss is not finite on every rank (rank {rank}: {last})")
    if centralized and not identical:
        problems.append("ranks' parameters differ (centralized algorithm)")
    aware = mode.startswith("cuda-aware")
    dense_forbidden = aware or name in NO_DENSE_STAGING  # aware: nothing dense leaves the GPU
    uncompressed = UNCOMPRESSED.get(name)
    allowed = 0 if aware or uncompressed is None else counted_steps * sum(
        p.numel() * p.element_size() for p in model.parameters() if uncompressed(p))
    if dense_forbidden and snap["dense_d2h_bytes"] > allowed:
        problems.append(f"{snap['dense_d2h_bytes']} bytes of dense tensors copied to the host "
                        f"({'the MPI reads device memory' if aware else 'while compressing'}"
                        f"; allowed: {allowed}, the uncompressed layers)")
    if aware and snap["d2h_bytes"]:  # a CUDA-aware MPI reads every payload where it is
        problems.append(f"{snap['d2h_bytes']} payload bytes went through the host")
    if kept_plans and (views or new_arrays):
        problems.append(f"{views} tensors viewed and {new_arrays} new arrays in a step with "
                        f"{kept_plans} kept plans")
    tail = sorted(times[-30:])
    return {"algorithm": name, "mode": mode, "ranks": comm.Get_size(),
            "device": device_name(device), "loss_first": first,
            "loss_last": last, "centralized": centralized, "identical": identical,
            "step_ms_median": 1e3 * tail[len(tail) // 2], "staging": snap,
            # the first step compiles the kernels that no earlier algorithm of this run used
            "first_step_ms": 1e3 * times[0],
            "parameters": sum(p.numel() for p in model.parameters()), "backend": backend,
            "launches_per_bucket": stats["launches_per_bucket"],
            "syncs_per_bucket": stats["syncs_per_bucket"],
            "allocations_per_bucket": stats["allocations_per_bucket"],
            "cuda_kernels_per_step": kernels, "kept_plans": kept_plans,
            "views_per_step": views, "new_arrays_per_step": new_arrays,
            "profile": profile, "ok": not problems, "problems": problems}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, help="label: staged or cuda-aware")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--width", type=int, default=256,
                    help="hidden width (above 256 a third layer: 4608 gives 21.5M parameters)")
    ap.add_argument("--timing-only", action="store_true",
                    help="record step times; require only a finite loss, not a falling one")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after the timed steps, sample the host's stacks for STEPS more "
                         "(tests/gpu/stack_sampler.py) and record where the time went")
    ap.add_argument("--device", default="cuda",
                    help="cuda (the check); cpu only smoke-tests this script")
    args = ap.parse_args()
    # the test model's small layers launch kernels of a few blocks; Numba warns about each
    warnings.filterwarnings("ignore", message=".*Grid size")
    bm.init()
    comm = bm.runtime.get().topo.comm
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # every rank of this check shares the one GPU
    failed = False
    checks = {} if args.timing_only else {"(check) broadcast_optimizer_state":
                                          optimizer_state_broadcast,
                                          "(check) checkpoint resume": checkpoint_resume}
    for label, check in checks.items():   # a row each in --out, for the summary's table
        problems = check(comm, device)
        failed |= bool(problems)
        if comm.Get_rank() == 0:
            with open(args.out, "a") as fh:
                fh.write(json.dumps({"algorithm": label, "mode": args.mode,
                                     "ok": not problems, "problems": problems}) + "\n")
            print(f"{args.mode:>10} {label} {'FAIL' if problems else 'OK'} "
                  f"{'; '.join(problems)}", flush=True)
    rows = []
    for name in args.only or bm.algorithms.names():
        try:
            row = run_one(name, comm, device, args.mode, args.width, args.timing_only,
                          args.profile)
        except Exception as exc:  # noqa: BLE001 - report it, run the other algorithms
            row = {"algorithm": name, "mode": args.mode, "ok": False,
                   "problems": [f"{type(exc).__name__}: {exc}"],
                   "traceback": traceback.format_exc()[-3000:]}
            # a rank failing alone would leave the other in a collective: end the job
            print(row["traceback"], file=sys.stderr, flush=True)
            comm.Abort(2)
        failed |= not row["ok"]
        rows.append(row)
        if comm.Get_rank() == 0:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"{args.mode:>10} {name:<28} {'OK ' if row['ok'] else 'FAIL'} "
                  f"loss {row.get('loss_first', 0):.4f}->{row.get('loss_last', 0):.4f} "
                  f"step {row.get('step_ms_median', 0):.2f} ms "
                  f"d2h {row.get('staging', {}).get('d2h_bytes', 0)} B "
                  f"(dense {row.get('staging', {}).get('dense_d2h_bytes', 0)}) "
                  f"{'; '.join(row['problems'])}", flush=True)
    bm.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
