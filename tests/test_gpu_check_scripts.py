"""The GPU check's scripts (``tests/gpu/``) on CPU tensors, so a mistake in them that needs no
GPU to show fails here and not on a lent GPU, whose minutes are few.

``train_all.py --device cpu`` trains through the host paths (no kernel launch, no staging), so
this checks the script's bookkeeping, the stack sampler and the summary, not the device.
"""
import json
import os
import subprocess
import sys

from mpi_harness import REPO, assert_mpi_ok, run_mpi


def test_train_all_profiles_and_summarizes_on_cpu(tmp_path):
    out = tmp_path / "train.jsonl"
    result = run_mpi("../gpu/train_all.py", 2, "--device", "cpu", "--mode", "cpu",
                     "--only", "gradient_allreduce", "topk", "--profile", "10",
                     "--out", str(out), timeout=300)
    assert_mpi_ok(result)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["algorithm"] for r in rows] == ["gradient_allreduce", "topk"]
    for r in rows:
        assert r["ok"], r["problems"]
        assert set(r["allocations_per_bucket"]) == set(r["launches_per_bucket"])
        profile = r["profile"]
        assert profile["steps"] == 10 and profile["samples"] > 0, profile
        names = [name for name, _ in profile["inclusive"]]
        assert "optimizer.py:step" in names, names      # the library's frames, not the script's
        assert not any(name.startswith("train_all.py") for name in names), names
        assert all(0 < share <= 1 for _, share in profile["inclusive"] + profile["innermost"])
    summary = subprocess.run([sys.executable, str(REPO / "tests/gpu/summarize.py"), str(tmp_path),
                              "cpu", "MPICH", "0"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    assert "## Where the host's time goes" in summary
    assert "| cpu | topk |" in summary
    assert "- cpu topk: " in summary        # its step against gradient_allreduce's


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
    assert len(rows) == 10, out.stdout
    assert all(len(row.split("|")) == 8 for row in rows), out.stdout   # six columns each
