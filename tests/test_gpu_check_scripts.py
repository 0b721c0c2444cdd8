"""The GPU check's scripts (``tests/gpu/``) on CPU tensors, so a mistake in them that needs no
GPU to show fails here and not on a lent GPU, whose minutes are few.

``train_all.py --device cpu`` trains through the host paths (no kernel launch, no staging), so
this checks the script's bookkeeping, the stack sampler and the summary, not the device.
"""
import json
import os
import subprocess
import sys
import tarfile

from mpi_harness import REPO, assert_mpi_ok, run_mpi


def test_train_all_profiles_and_summarizes_on_cpu(tmp_path):
    out = tmp_path / "train.jsonl"
    result = run_mpi("../gpu/train_all.py", 2, "--device", "cpu", "--mode", "cpu",
                     "--only", "gradient_allreduce", "topk", "--profile", "10",
                     "--out", str(out), timeout=300)
    assert_mpi_ok(result)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    checks = ["(check) broadcast_optimizer_state", "(check) checkpoint resume"]
    assert [r["algorithm"] for r in rows] == checks + ["gradient_allreduce", "topk"]
    for r in rows[:2]:   # the checks on the device (here, the host), before the training
        assert r["ok"], r["problems"]
    rows = rows[2:]
    for r in rows:
        assert r["ok"], r["problems"]
        assert set(r["allocations_per_bucket"]) == set(r["launches_per_bucket"])
        assert r["first_step_ms"] > 0, r      # the first step's time (what compiling costs)
        assert r["cuda_kernels_per_step"] is None, r   # torch's profiler counts on a GPU only
        # Top-k keeps its buckets' plans; a step then views no tensor and asks for no array
        assert (r["kept_plans"] > 0) == (r["algorithm"] == "topk"), r
        assert r["views_per_step"] == r["new_arrays_per_step"] == 0, r
        profile = r["profile"]
        assert profile["steps"] == 10 and profile["samples"] > 0, profile
        names = [name for name, _ in profile["inclusive"]]
        # the library's frames, not the script's (the exchange's wait is inside backward())
        assert {"optimizer.py:step", "engine.py:synchronize"} & set(names), names
        assert not any(name.startswith("train_all.py") for name in names), names
        assert all(0 < share <= 1 for _, share in profile["inclusive"] + profile["innermost"])
    summary = subprocess.run([sys.executable, str(REPO / "tests/gpu/summarize.py"), str(tmp_path),
                              "cpu", "MPICH", "0"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    assert "## Where the host's time goes" in summary
    assert "| cpu | topk |" in summary
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| mode | algorithm | ok "))
    table = lines[start:lines.index("", start)]     # header, rule and one row per algorithm
    assert "first step ms" in table[0] and len(table) == 6, table   # two checks, two trainings
    assert len({line.count("|") for line in table}) == 1, table   # every row fills the columns
    assert "- cpu topk: " in summary        # its step against gradient_allreduce's


def test_profile_of_the_communication_thread_runs_on_cpu_and_reaches_the_summary(tmp_path):
    """``profile_comm.py`` (the cProfile step of run.sh) on CPU tensors: rank 0 writes the
    communication thread's tables, and the summary shows them."""
    result = run_mpi("../gpu/profile_comm.py", 2, str(tmp_path), "qsgd", "cpu", timeout=300)
    assert_mpi_ok(result, "qsgd")
    text = (tmp_path / "profile_qsgd.txt").read_text()
    assert "## communication thread, by tottime" in text, text[:2000]
    assert "## communication thread, by cumulative" in text
    assert "_run_steps" in text         # the bucket's C_LP_S ran in that thread
    summary = subprocess.run([sys.executable, str(REPO / "tests/gpu/summarize.py"), str(tmp_path),
                              "cpu", "MPICH", "0"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    assert "## cProfile of qsgd's communication thread" in summary


def test_nccl_checks_group_verbs_run_under_gloo():
    """``nccl_check.py``'s direct calls of the group's verbs (step (c): NCCL at world size 1,
    where the transport's shortcuts skip the reductions) under gloo on CPU tensors: the
    script's own logic, and each verb for each dtype of its list."""
    code = ("import sys; sys.path.insert(0, 'tests/gpu'); import nccl_check; "
            "from mpi4py import MPI; from bagua_mpi import process_groups; "
            "print(nccl_check.group_verbs_at_world_size_one("
            "process_groups.group(MPI.COMM_SELF, 'gloo'), 'cpu'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gloo group verbs at world size 1: OK (80 calls over 8 dtypes" in result.stdout, \
        result.stdout


def test_kernel_benchmark_gpu_section_runs_in_the_simulator():
    """``benchmarks/kernels.py``'s GPU section (step (d) of the check) end to end on Numba's
    CUDA simulator at a tiny size: every row with its device, idle-device and host times."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import kernels; "
            "print('\\n'.join(kernels.gpu_section(256, 1)))")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| kernel")]
    assert len(rows) == 14, out.stdout
    assert all(len(row.split("|")) == 8 for row in rows), out.stdout   # six columns each
    assert "registers a thread: not reported" in out.stdout   # the simulator has no counts


def test_kernel_benchmark_reports_each_compiled_kernels_registers(monkeypatch):
    """The GPU section's register line, with stand-ins for compiled CUDA dispatchers (the
    simulator's kernels report none): the largest count over a kernel's compiled argument
    types, and a failing query reported on the line instead of ending the run."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kernels
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from numba_kernels._cuda import minmax

    class Compiled:
        overloads = {"sig": object()}

        def get_regs_per_thread(self):
            return {"float32": 32, "float64": 40}

    class Failing(Compiled):
        def get_regs_per_thread(self):
            raise RuntimeError("no driver")

    monkeypatch.setattr(minmax, "_stand_in", Compiled(), raising=False)
    assert "minmax._stand_in 40" in kernels.register_lines()[0]
    monkeypatch.setattr(minmax, "_stand_in", Failing(), raising=False)
    assert kernels.register_lines() == ["registers a thread: not reported (RuntimeError: "
                                        "no driver)"]


def test_gpu_check_budget_cuts_skips_and_saves(tmp_path):
    """``run.sh``'s time budget (``tests/gpu/budget.sh``): a step's timeout is cut to what is
    left after the summary's 20 s, a step with under 30 s left gets 0 (skipped, and said so in
    steps.log, which the summary shows), and ``save`` packs the results so far into
    $OUT/raw.tar.gz (the device tool brings back only that folder, only what is there when it
    stops a run, and 8 files at most)."""
    res, out = tmp_path / "res", tmp_path / "out"
    res.mkdir()
    out.mkdir()
    (res / "train.jsonl").write_text('{"mode": "cuda-aware", "skipped": "not CUDA-aware"}\n')
    script = f"""
set -u
RES={res}; OUT={out}; BUDGET=100
START=$(( $(date +%s) - 10 ))     # 10 s into 100: 70 s left after the summary's 20
echo "early $(allow 200) $(allow 50)"
START=$(( $(date +%s) - 55 ))     # 25 s left: too little for a step
echo "late $(allow 50)"
skip "(x) a step"
save
status=0
START=$(date +%s)
step 60 "(y) a step that passes" y.log 1 echo fine
echo "after y: $status"
step 60 "(z) a step that fails" z.log 1 bash -c "echo broken; exit 3"
echo "after z: $status"
START=$(( $(date +%s) - 70 ))
step 60 "(w) a late step" w.log 1 echo never
"""
    run = subprocess.run(["bash", "-c", f"source {REPO}/tests/gpu/budget.sh\n{script}"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    words = run.stdout.split()
    early = words.index("early")
    assert 68 <= int(words[early + 1]) <= 70, run.stdout        # cut to what is left
    assert int(words[early + 2]) == 50, run.stdout               # fits: as asked
    assert words[words.index("late") + 1] == "0", run.stdout     # under 30 s: skip
    steps = (res / "steps.log").read_text()
    assert "(x) a step skipped" in steps
    # step: runs the command into its log and shows its tail, a failure sets status and is
    # noted, a step without time is skipped without running
    assert "fine\nafter y: 0" in run.stdout and "\nbroken\n" in run.stdout
    assert "after z: 1" in run.stdout
    assert "(z) a step that fails: rc 3" in steps and "(w) a late step skipped" in steps
    assert not (res / "w.log").exists()
    assert [p.name for p in out.iterdir()] == ["raw.tar.gz"]
    with tarfile.open(out / "raw.tar.gz") as packed:
        assert {"z.log", "y.log", "train.jsonl", "steps.log"} <= set(packed.getnames())
    summary = subprocess.run([sys.executable, str(REPO / "tests/gpu/summarize.py"), str(res),
                              "cpu", "MPICH", "0"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    assert "## Steps" in summary and "(x) a step skipped" in summary



def test_under_mps_starts_the_daemon_for_the_command_and_stops_it(tmp_path):
    """``tests/gpu/under_mps.sh`` (run.sh's MPS row) with a stand-in for
    ``nvidia-cuda-mps-control``: the daemon starts before the command, the command sees the
    daemon's pipe directory, the daemon is told to quit after it (after a failing command
    too), the command's exit status comes back, and with no MPS at all it says so and exits 4
    without running the command."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-cuda-mps-control"
    fake.write_text(f'#!/usr/bin/env bash\nif [ "${{1:-}}" = -d ]; then\n'
                    f'  echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n'
                    f'else read line; echo "$line" >> {calls}; fi\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    command = f'echo "cmd $CUDA_MPS_PIPE_DIRECTORY" >> {calls}; exit 5'
    run = subprocess.run(["bash", str(REPO / "tests/gpu/under_mps.sh"), "bash", "-c", command],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 5, run.stdout + run.stderr
    start, cmd, quit_ = calls.read_text().splitlines()
    assert start.startswith("start /tmp/mps.") and cmd == "cmd " + start.split()[1]
    assert quit_ == "quit"
    assert not os.path.exists(start.split()[1])          # its folder is removed afterwards
    bare = dict(os.environ, PATH="/usr/bin:/bin")
    run = subprocess.run(["bash", str(REPO / "tests/gpu/under_mps.sh"), "bash", "-c", command],
                         env=bare, capture_output=True, text=True, timeout=60)
    assert run.returncode == 4 and "not found" in run.stdout
    assert len(calls.read_text().splitlines()) == 3      # the command did not run


def test_onebit_adam_stability_benchmark_runs_both_ways():
    """``benchmarks/onebit_adam_stability.py`` (why the check's 21.5M row uses lr 1e-4) on a
    small model: with the 1-bit exchange and with its exact stand-in, each prints its line and
    the small model trains through the switch."""
    for average in ("onebit", "exact"):
        result = run_mpi("../../benchmarks/onebit_adam_stability.py", 2, "--width", "64",
                         "--steps", "16", "--warmup", "4", "--lr", "1e-3", "--average", average,
                         timeout=180)
        assert_mpi_ok(result)
        line = next(s for s in result.output.splitlines() if s.startswith("lr "))
        assert f"average {average}" in line and "(step 15)" in line, line
        assert "nan" not in line and "inf" not in line, line
