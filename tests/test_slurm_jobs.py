"""The sbatch templates under the repository's real single-node Slurm: a pre-empted job saves,
requeues itself and resumes from ``latest`` to the same parameters as an uninterrupted run; a
job requeued after its step was killed starts MPI again; the GPU template's own ``srun`` line
starts its ranks; the ``BAGUA_MPI_*`` names the scripts read are no typos to the library."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

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


def submit(env, *args: str) -> str:
    """``sbatch --parsable`` from the repository root (the templates find their helpers from
    the submit directory); the job id."""
    done = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def start_requeued_job_now(env, jobid: str, info, restarts: int = 1) -> None:
    """Wait until the job is requeued for the ``restarts``-th time (pending, its step gone),
    then start it without Slurm's requeue delay (~2 min)."""
    wait_until(lambda: job_fields(env, jobid).get("Restarts") == str(restarts)
               and job_fields(env, jobid).get("JobState") == "PENDING"
               and not steps_of(env, jobid), 120, "the requeue", info)
    # Once the old step's slurmstepd is surely gone: a new step 0 of the same job must not
    # meet the old one's teardown.
    time.sleep(6)
    subprocess.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now"], env=env,
                   capture_output=True, timeout=30)


def wait_for_the_end(env, jobid: str, timeout: float, info) -> str:
    """The job's final state, once it has one."""
    return wait_until(lambda: {"COMPLETED", "FAILED", "CANCELLED"}
                      & {job_fields(env, jobid).get("JobState")}, timeout,
                      "the job to end", info).pop()


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
        start_requeued_job_now(slurm, jobid, info)
        wait_for_the_end(slurm, jobid, 240, info)
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


# Attempts 0 and 1 wait in their step until the test requeues the job, which kills the step:
# MPI_Finalize never runs, and MPICH's /dev/shm segments stay behind, named after the job and
# step ids. Attempt 2 ends.
KILLED_THEN_REQUEUED = """
import os, time
from mpi4py import MPI
attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank() + 1)
print(f"attempt {attempt} rank {comm.Get_rank()} of {comm.Get_size()}: sum {total}", flush=True)
if attempt < 2:
    time.sleep(300)
"""


def test_job_requeued_after_its_step_was_killed_starts_mpi_again(slurm, tmp_path):
    """A requeue keeps the job id and numbers the steps from 0 again, so a restarted step meets
    the killed one's MPICH segments under the same names, and its MPI_Init failed (most times,
    not always: so the step is killed and restarted twice) until the template cleared them
    (slurm/clear_stale_shm.sh, once per node)."""
    script, log = tmp_path / "killed_then_requeued.py", tmp_path / "job.out"
    script.write_text(KILLED_THEN_REQUEUED)
    jobid = submit(slurm, "--job-name=bagua-ci-killed", "--ntasks-per-node=2", "--time=10",
                   f"--output={log}", str(SLURM / "cpu_single_node.sbatch"), str(script))
    text = lambda: log.read_text() if log.exists() else ""  # noqa: E731
    info = lambda: f"job {jobid}: {job_fields(slurm, jobid)}\n--- log ---\n{text()}"  # noqa: E731
    ended = lambda: job_fields(slurm, jobid).get("JobState") in ("COMPLETED",  # noqa: E731
                                                                   "FAILED")
    try:
        for attempt in (0, 1):
            ranks = lambda: re.findall(rf"^attempt {attempt} rank (\d) of 2: sum 3$",  # noqa: E731
                                       text(), re.M)
            wait_until(lambda: len(ranks()) == 2 or ended(), 120,
                       f"both ranks of attempt {attempt}", info)
            assert sorted(ranks()) == ["0", "1"], info()
            # what Slurm does to a job on a failed node: the step is killed, as by
            # --kill-on-bad-exit after a rank's MPI_Abort
            subprocess.run(["scontrol", "requeue", jobid], env=slurm, check=True, timeout=30)
            start_requeued_job_now(slurm, jobid, info, restarts=attempt + 1)
        state = wait_for_the_end(slurm, jobid, 120, info)
    finally:
        subprocess.run(["scancel", jobid], env=slurm, capture_output=True, timeout=30)
    out = text()
    assert state == "COMPLETED", info()
    for restart in (1, 2):
        section = out.partition(f"restart {restart} on")[2].partition("restart ")[0]
        assert re.search(r"clear_stale_shm.sh on \S+: removed [1-9]\d* stale MPICH segment",
                         section), out
    last = out.partition("restart 2 on")[2]
    assert sorted(re.findall(r"^attempt 2 rank (\d) of 2: sum 3$", last, re.M)) == ["0", "1"], out
    assert "step exit code 0" in last, out


# Holds one segment mapped (its descriptor closed) and another open but unmapped, as a rank of a
# live job does after and during MPI_Init.
HOLDER = """
import mmap, sys, time
mapped = open(sys.argv[1], "r+b")
view = mmap.mmap(mapped.fileno(), 0)
mapped.close()
held = open(sys.argv[2], "r+b")
print("holding", flush=True)
time.sleep(120)
"""


def test_clear_stale_shm_removes_unused_segments_and_keeps_used_ones():
    """slurm/clear_stale_shm.sh removes this user's MPICH segments that no process maps or
    holds open, and keeps the others (another job's, on a shared node). The names hold
    non-hex letters: MPICH's own (``%x``) never do, so no live job's segment is touched."""
    tag = f"baguatest{os.getpid()}"
    stale, mapped, held = (Path(f"/dev/shm/mpich_{kind}_{tag}{i}_0")
                           for i, kind in enumerate(("shm", "vci", "shm")))
    for path in (stale, mapped, held):
        path.write_bytes(bytes(4096))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(mapped), str(held)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        done = subprocess.run(["bash", str(SLURM / "clear_stale_shm.sh")], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert (stale.exists(), mapped.exists(), held.exists()) == (False, True, True)
        assert re.search(r"removed [1-9]\d* stale MPICH segment\(s\) of \S+, kept [2-9]",
                         done.stdout), done.stdout
    finally:
        holder.kill()
        holder.wait()
        for path in (stale, mapped, held):
            path.unlink(missing_ok=True)


def test_gpu_template_srun_line_starts_the_ranks(slurm, tmp_path):
    """The GPU template itself, with only ``#SBATCH --gpus-per-node`` dropped (no GPUs here)
    and 1 node x 2 tasks: its srun line (default --mpi, --cpu-bind, bind_gpu.sh) starts the
    example on 2 ranks that train to the end. Its former default, pmix, made the mpich
    extra's MPICH abort in MPI_Init on every rank (step exit code 16). The binding script is
    named by BAGUA_MPI_BIND_GPU, which reaches the ranks and is no unknown setting to them."""
    template = (SLURM / "gpu_multi_node.sbatch").read_text()
    local = tmp_path / "gpu_local.sbatch"
    local.write_text(re.sub(r"^#SBATCH --gpus-per-node=.*\n", "", template, flags=re.M))
    assert local.read_text() != template
    log, env = tmp_path / "job.out", dict(slurm, BAGUA_MPI_BIND_GPU=str(SLURM / "bind_gpu.sh"))
    env.pop("BAGUA_MPI_SRUN_MPI", None)  # the template's own default
    jobid = submit(env, "--job-name=bagua-ci-gpu", "--nodes=1", "--ntasks-per-node=2",
                   "--cpus-per-task=1", "--time=10", f"--output={log}", str(local),
                   "examples/checkpoint_resume.py", "--checkpoint-dir", str(tmp_path / "ckpt"),
                   "--steps", "4", "--save-every", "2", "--inputs", "8", "--hidden", "16",
                   "--batch", "4")
    text = lambda: log.read_text() if log.exists() else ""  # noqa: E731
    info = lambda: f"job {jobid}: {job_fields(env, jobid)}\n--- log ---\n{text()}"  # noqa: E731
    try:
        state = wait_for_the_end(env, jobid, 180, info)
    finally:
        subprocess.run(["scancel", jobid], env=env, capture_output=True, timeout=30)
    out = text()
    assert state == "COMPLETED" and "step exit code 0" in out, info()
    assert "finished at step 4; parameters sha256" in out, out
    assert "Slurm and MPI disagree" not in out and "unknown environment variable" not in out, out


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
    assert os.access(SLURM / "clear_stale_shm.sh", os.X_OK)


def test_restarted_jobs_clear_stale_segments_first():
    """Both templates clear the killed attempt's MPICH segments on every node, once per node,
    before the training step, and only in a restarted job."""
    for name in ("cpu_single_node.sbatch", "gpu_multi_node.sbatch"):
        text = (SLURM / name).read_text()
        guard = text.index('if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then')
        clear = text.index("--ntasks-per-node=1 --mpi=none", guard)
        assert guard < clear < text.index("slurm/clear_stale_shm.sh", clear), name
        assert clear < text.index('"${PYTHON:-python}" "$@"'), name


def test_srun_plugin_default_is_pmi2_in_both_templates():
    """pmi2 by default: the mpich extra's MPICH wheel aborts in MPI_Init under pmix."""
    for name in ("cpu_single_node.sbatch", "gpu_multi_node.sbatch"):
        assert re.findall(r'--mpi="\$\{BAGUA_MPI_SRUN_MPI:-(\w+)\}"',
                          (SLURM / name).read_text()) == ["pmi2"], name


def test_every_documented_srun_of_python_names_its_mpi_plugin():
    """Slurm's default MpiDefault is none, under which srun makes every task an MPI job of one
    rank (init refuses it): each srun of Python in the README, the docs, the examples and the
    templates says which plugin."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted(SLURM.glob("*.sbatch")), *sorted((REPO / "examples").rglob("*.py"))]
    missing = []
    for path in paths:
        for line in path.read_text().replace("\\\n", " ").splitlines():
            for command in re.findall(r"\bsrun\b[^`#\n]*", line):
                if re.search(r"\bpython\b|PYTHON", command) and "--mpi=" not in command:
                    missing.append(f"{path.relative_to(REPO)}: {command.strip()}")
    assert missing == []


def test_every_setting_the_launch_scripts_read_is_known_to_the_library():
    """The BAGUA_MPI_* names in slurm/ (found in the files, not listed by hand) reach the
    ranks in their environment: config.LAUNCHER_ONLY knows each, so neither init nor the
    doctor calls it a typo, and docs/settings.md documents each; and it lists no name that
    slurm/ no longer reads."""
    from bagua_mpi import config

    used = set()
    for path in SLURM.iterdir():
        used |= set(re.findall(r"\bBAGUA_MPI_[A-Z0-9_]+", path.read_text()))
    assert used, "no BAGUA_MPI_ setting found under slurm/"
    assert config.unknown_variables(dict.fromkeys(used, "x")) == []
    launcher_only = used - set(config.KNOWN)
    assert launcher_only == set(config.LAUNCHER_ONLY)
    settings_page = (REPO / "docs" / "settings.md").read_text()
    assert [n for n in sorted(launcher_only) if f"`{n}`" not in settings_page] == []
