"""The sbatch templates under the repository's real single-node Slurm: a pre-empted job saves,
requeues itself and resumes from ``latest`` to the same parameters as an uninterrupted run."""
import os
import re
import subprocess
import sys
import time

import pytest

from mpi_harness import REPO, mpiexec_path
from slurm_harness import slurm_env, start_local_slurm

SLURM = REPO / "slurm"
EXAMPLE_ARGS = ["--steps", "60", "--save-every", "20", "--inputs", "32", "--hidden", "64",
                "--batch", "16"]


@pytest.fixture(scope="module")
def slurm():
    return slurm_env(start_local_slurm())


def job_fields(env, jobid: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", jobid], capture_output=True,
                         text=True, env=env, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def steps_of(env, jobid: str) -> str:
    return subprocess.run(["squeue", "--steps", f"--jobs={jobid}", "--noheader"],
                          capture_output=True, text=True, env=env, timeout=30).stdout.strip()


def wait_until(predicate, timeout: float, what: str, describe=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{describe()}")


def test_preempted_job_saves_requeues_and_resumes(slurm, tmp_path):
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "job.out"
    submit = subprocess.run(
        ["sbatch", "--parsable", "--job-name=bagua-ci-preempt", "--ntasks-per-node=2",
         "--time=10", f"--output={log}", str(SLURM / "cpu_single_node.sbatch"),
         "examples/checkpoint_resume.py", "--checkpoint-dir", str(ckpt_dir),
         "--step-sleep", "0.15", *EXAMPLE_ARGS],
        capture_output=True, text=True, env=slurm, cwd=REPO, timeout=60)
    assert submit.returncode == 0, submit.stderr
    jobid = submit.stdout.strip().split(";")[0]
    text = lambda: log.read_text() if log.exists() else ""  # noqa: E731
    info = lambda: f"job {jobid}: {job_fields(slurm, jobid)}\n--- log ---\n{text()}"  # noqa: E731
    try:
        wait_until(lambda: re.search(r"^step +10 ", text(), re.M), 180, "step 10", info)
        # What Slurm does at --signal=USR1@120, delivered now: to every task of the step.
        subprocess.run(["scancel", "--signal=USR1", jobid], env=slurm, check=True, timeout=30)
        wait_until(lambda: job_fields(slurm, jobid).get("Restarts") == "1"
                   and job_fields(slurm, jobid).get("JobState") == "PENDING"
                   and not steps_of(slurm, jobid), 120, "the requeue", info)
        # A requeued job becomes eligible only after Slurm's requeue delay (~2 min); start it
        # now, once the old step's slurmstepd is surely gone (a new step 0 of the same job must
        # not meet the old one's teardown).
        time.sleep(6)
        subprocess.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now"], env=slurm,
                       capture_output=True, timeout=30)
        wait_until(lambda: job_fields(slurm, jobid).get("JobState") in ("COMPLETED", "FAILED",
                                                                        "CANCELLED"),
                   240, "the resumed job to end", info)
    finally:
        subprocess.run(["scancel", jobid], env=slurm, capture_output=True, timeout=30)
    out = text()
    assert job_fields(slurm, jobid)["JobState"] == "COMPLETED", info()
    saved = int(re.search(r"pre-emption: saved step (\d+) to ", out).group(1))
    assert 10 <= saved < 60, out
    first, _, second = out.partition("restart 1")
    assert "step exit code 75" in first and "requeueing" in first, out
    assert f"resumed from {ckpt_dir}/ckpt-{saved:010d}.h5 at step {saved}" in second, out
    resumed_steps = [int(s) for s in re.findall(r"^step +(\d+) ", second, re.M)]
    assert resumed_steps and min(resumed_steps) > saved, out  # continued, not restarted
    assert "finished at step 60" in second and "step exit code 0" in second, out
    digest = re.search(r"finished at step 60; parameters sha256 ([0-9a-f]{64})", out).group(1)

    # The same training uninterrupted (mpiexec, no sleeps): the same parameters, bit for bit.
    ref = subprocess.run([mpiexec_path(), "-n", "2", sys.executable,
                          str(REPO / "examples" / "checkpoint_resume.py"), "--checkpoint-dir",
                          str(tmp_path / "uninterrupted"), *EXAMPLE_ARGS],
                         capture_output=True, text=True, env=slurm, timeout=180)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    assert f"parameters sha256 {digest}" in ref.stdout, ref.stdout + "\n" + out


def test_gpu_binding_by_local_rank_under_srun(slurm):
    result = subprocess.run(
        ["srun", "--ntasks=3", "--mpi=none", str(SLURM / "bind_gpu.sh"), "bash", "-c",
         'echo "bound $SLURM_LOCALID:$CUDA_VISIBLE_DEVICES"'],
        capture_output=True, text=True, env=dict(slurm, CUDA_VISIBLE_DEVICES="4,5,7"),
        timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(re.findall(r"bound \d:\d", result.stdout)) == ["bound 0:4", "bound 1:5",
                                                                 "bound 2:7"], result.stdout


def test_templates_are_accepted_by_slurm(slurm):
    cpu = (SLURM / "cpu_single_node.sbatch").read_text()
    gpu = (SLURM / "gpu_multi_node.sbatch").read_text()
    for text in (cpu, gpu):
        for directive in ("--signal=USR1@120", "--requeue", "--open-mode=append",
                          "--ntasks-per-node="):
            assert f"#SBATCH {directive}" in text, directive
        assert "--kill-on-bad-exit=1" in text and "scontrol requeue" in text
        assert "REQUEUE_EXIT_CODE=75" in text
    assert "#SBATCH --gpus-per-node=" in gpu and "bind_gpu.sh" in gpu and "--mpi=" in gpu
    for path in ("cpu_single_node.sbatch", "gpu_multi_node.sbatch", "bind_gpu.sh"):
        assert subprocess.run(["bash", "-n", str(SLURM / path)]).returncode == 0, path
    # Slurm parses the CPU template's directives (the GPU one needs GPU nodes).
    test = subprocess.run(["sbatch", "--test-only", "--ntasks-per-node=2",
                           str(SLURM / "cpu_single_node.sbatch"), "x.py"],
                          capture_output=True, text=True, env=slurm, cwd=REPO, timeout=60)
    assert test.returncode == 0 and "to start at" in test.stderr, test.stderr


def test_requeue_exit_code_matches_the_templates():
    from bagua_mpi.preemption import REQUEUE_EXIT_CODE
    assert REQUEUE_EXIT_CODE == 75
    assert os.access(SLURM / "bind_gpu.sh", os.X_OK)
