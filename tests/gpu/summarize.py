"""Markdown summary of a ``tests/gpu/run.sh`` run: python3 summarize.py RESDIR DEVICE MPI RC."""
import json
import os
import sys


def per_bucket(row) -> str:
    """'launches, waits, allocations' of each bucket's last exchange, e.g. '12, 2, 0 / 3, 0, 0'."""
    launches, waits = row.get("launches_per_bucket", {}), row.get("syncs_per_bucket", {})
    allocations = row.get("allocations_per_bucket", {})
    return " / ".join(f"{launches[k]}, {waits.get(k, '')}, {allocations.get(k, '')}"
                      for k in sorted(launches))


def kept(row) -> str:
    """'plans: views, new arrays' of the step counted after the timed ones ('' without plans)."""
    if not row.get("kept_plans"):
        return ""
    return f"{row['kept_plans']}: {row['views_per_step']}, {row['new_arrays_per_step']}"


def profiles(rows, top: int = 8) -> list:
    """Where each profiled run's host time went (``train_all.py --profile``): the innermost
    library frames and the library functions on the stack, as shares of the samples."""
    found = [r for r in rows if r.get("profile")]
    if not found:
        return []
    out = ["", "## Where the host's time goes (stack samples of the training and "
           "communication threads)", "",
           "| mode | algorithm | ms/step | innermost frames | on the stack |", "|---|---|---|---|---|"]
    for r in found:
        p = r["profile"]

        def shares(pairs):
            return "; ".join(f"{name} {share:.0%}" for name, share in pairs[:top])
        ms = 1e3 * p["seconds"] / max(1, p["steps"])
        out.append(f"| {r['mode']} | {r['algorithm']} | {ms:.2f} | {shares(p['innermost'])} | "
                   f"{shares(p['inclusive'])} |")
    return out


def main():
    res, device, mpi, rc = sys.argv[1:5]
    out = [f"# GPU check (tests/gpu/run.sh) on {device}", "",
           f"MPI: {mpi}. Exit status {rc} (0: every part that ran passed).", ""]
    rows = []
    path = os.path.join(res, "train.jsonl")
    if os.path.exists(path):
        rows = [json.loads(line) for line in open(path) if line.strip()]
    out += ["## Every algorithm, 2 ranks sharing the GPU", "",
            "| mode | algorithm | ok | loss first -> last | identical | step ms (median) | "
            "first step ms | d2h bytes/run | dense d2h | "
            "launches, host waits, allocations per bucket | CUDA kernels a step | "
            "kept plans: views, new arrays a step | problems |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['mode']} | (all) | skipped | | | | | | | | | | {r['skipped']} |")
            continue
        if r["algorithm"].startswith("(check)"):   # train_all.py's checks before the training
            out.append(f"| {r['mode']} | {r['algorithm']} | {'yes' if r['ok'] else 'NO'} | "
                       f"| | | | | | | | | {'; '.join(r['problems'])} |")
            continue
        st = r.get("staging", {})
        if r["algorithm"] == "gradient_allreduce" and "step_ms_median" in r:
            base[r["mode"]] = r["step_ms_median"]
        out.append(f"| {r['mode']} | {r['algorithm']} | {'yes' if r['ok'] else 'NO'} | "
                   f"{r.get('loss_first', float('nan')):.4f} -> "
                   f"{r.get('loss_last', float('nan')):.4f} | "
                   f"{r.get('identical', '')}{'' if r.get('centralized', True) else ' (n/a)'} | "
                   f"{r.get('step_ms_median', float('nan')):.2f} | "
                   f"{r.get('first_step_ms', float('nan')):.0f} | {st.get('d2h_bytes', '')} | "
                   f"{st.get('dense_d2h_bytes', '')} | {per_bucket(r)} | "
                   f"{r.get('cuda_kernels_per_step') or ''} | {kept(r)} | "
                   f"{'; '.join(r.get('problems', []))} |")
    out += ["", "Compressed step time / gradient_allreduce's (same run; target <= 1):", ""]
    for r in rows:
        if r.get("algorithm") in ("qsgd", "bytegrad", "onebit_adam", "powersgd", "topk",
                                  "gtopk", "lgreco") and r.get("mode") in base:
            out.append(f"- {r['mode']} {r['algorithm']}: "
                       f"{r['step_ms_median'] / base[r['mode']]:.2f}")
    out += profiles(rows)
    prof = os.path.join(res, "profile_qsgd.txt")
    if os.path.exists(prof):    # profile_comm.py: the first table, by own time
        lines = open(prof).read().splitlines()
        out += ["", "## cProfile of qsgd's communication thread (tests/gpu/profile_comm.py)", "",
                *lines[:40]]
    nccl = os.path.join(res, "nccl.json")
    out += ["", "## NCCL at world size 1", "",
            "NCCL refuses two ranks on one GPU: its multi-rank path is not checked here.", "",
            "```", open(nccl).read() if os.path.exists(nccl) else "(did not finish)", "```"]
    bench = os.path.join(res, "kernels_gpu.md")
    out += ["", "## Kernels at 1e8 elements", ""]
    out += [open(bench).read() if os.path.exists(bench) else "(did not finish)"]
    for name, what in (("pytest_gpu_kernels.log", "tests/kernels"),
                       ("pytest_gpu.log", "the other tests")):
        log = os.path.join(res, name)
        tail = open(log).read().splitlines()[-12:] if os.path.exists(log) else ["(no log)"]
        out += ["", f"## pytest -m gpu, {what} (tail)", "", "```", *tail, "```"]
    steps = os.path.join(res, "steps.log")
    if os.path.exists(steps):   # run.sh's notes: when each step started, what it skipped
        out += ["", "## Steps", "", "```", *open(steps).read().splitlines(), "```"]
    print("\n".join(out))


if __name__ == "__main__":
    main()
