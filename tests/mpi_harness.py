"""Launch a script under a real ``mpiexec`` from pytest and report every rank's output.

The multi-rank suites live in ``tests/mpi/``; each is an ordinary Python program run by all
ranks. A failing assertion on any rank is an uncaught exception, which bagua_mpi turns into
``MPI_Abort`` of the whole job, so a wrong answer surfaces as a non-zero exit code here, never as
a hang; a hang anyway is cut by the timeout.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from forkserver import preloaded_command

REPO = Path(__file__).resolve().parent.parent
MPI_SUITES = Path(__file__).resolve().parent / "mpi"
HANG_REPORTS_DIR: str | None = None   # set for the session by conftest.py


def mpiexec_path() -> str:
    """The mpiexec that belongs to this Python's mpi4py (the mpich wheel puts it beside python)."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.fail("no mpiexec found: install the MPI (pip install 'bagua_mpi[mpich]')")
    return found


@dataclass
class MPIResult:
    returncode: int
    output: str
    timed_out: bool

    def describe(self) -> str:
        state = "timed out" if self.timed_out else f"exit code {self.returncode}"
        return f"mpiexec {state}; output of all ranks:\n{self.output}"


def run_mpi(script: str, nprocs: int, *args: str, env: dict | None = None,
            timeout: float = 180.0) -> MPIResult:
    """Run ``tests/mpi/<script>`` on ``nprocs`` ranks; kill the whole job on timeout."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores shared by up to 4 ranks
    # a rank that fails alone inside a collective sequence leaves the others waiting: the
    # watchdog ends such a job well before the harness timeout, naming what was waited for
    full_env.setdefault("BAGUA_MPI_STALL_ABORT_S", "150")
    full_env["PYTHONUNBUFFERED"] = "1"
    if HANG_REPORTS_DIR is not None:
        full_env.setdefault("BAGUA_MPI_HANG_DIR", HANG_REPORTS_DIR)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(MPI_SUITES)] + [p for p in [full_env.get("PYTHONPATH")] if p])
    if env:
        full_env.update(env)
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, str(MPI_SUITES / script), *args]
    return run_job(cmd, full_env, timeout)


def suite_job(script: str, *args: str, env=None, timeout: float = 300.0):
    """``run(nprocs)``: ``tests/mpi/<script>`` on ``nprocs`` ranks, run on first use and kept,
    so that every check the suite reports on its own line can be its own test at the cost of one
    job per world size. ``env`` is a dict, or a function of ``nprocs`` that gives one."""
    def run(nprocs: int) -> MPIResult:
        return run_mpi(script, nprocs, *args, env=env(nprocs) if callable(env) else env,
                       timeout=timeout)
    return functools.cache(run)


def jobs_of_modes(script: str, modes_by_size: dict, timeout: float = 180.0):
    """``run(nprocs)``: the one job, run on first use, that runs ``modes_by_size[nprocs]`` one
    after the other (a suite taking several modes). Tests of the modes look for their own lines
    with ``assert_in_output``; a mode that fails ends the job, and every later mode's test then
    shows its traceback."""
    return functools.cache(lambda nprocs: run_mpi(script, nprocs, *modes_by_size[nprocs],
                                                  timeout=timeout))


def assert_in_output(result: MPIResult, line: str) -> None:
    assert not result.timed_out and line in result.output, result.describe()


def run_mpi_side_by_side(jobs: dict, nprocs: int, **kwargs) -> dict:
    """``{key: run_mpi(script, nprocs, *args, **kwargs)}`` for ``jobs = {key: (script, *args)}``,
    as many jobs at once as the cores hold ``nprocs`` ranks each (at least one). For independent
    jobs of one or two ranks: each waits for its ranks, so on 2 cores two 1-rank jobs side by
    side take about the time of one."""
    at_once = max(1, (os.cpu_count() or 1) // nprocs)
    with ThreadPoolExecutor(at_once) as pool:
        futures = {key: pool.submit(run_mpi, script, nprocs, *args, **kwargs)
                   for key, (script, *args) in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def run_job(cmd: list[str], env: dict, timeout: float) -> MPIResult:
    """Run a launcher command in its own process group; kill the whole group on timeout.
    ``mpiexec python script.py`` jobs get their ranks from preloaded Pythons (``forkserver``)."""
    launched = [str(a) for a in cmd]
    cmd, env = preloaded_command(cmd, env)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        result = MPIResult(proc.returncode, out, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        result = MPIResult(proc.returncode, out, True)
    _log_job(launched, time.monotonic() - started, result)
    return result


def _log_job(cmd: list[str], seconds: float, result: MPIResult) -> None:
    """With ``MPI_HARNESS_JOB_LOG=<file>``, one JSON line per job (its command, the test
    that ran it, its seconds and exit code): where the suite's time goes, job by job
    (``benchmarks/results/ci_time.md``)."""
    path = os.environ.get("MPI_HARNESS_JOB_LOG")
    if path:
        line = {"cmd": cmd, "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                "seconds": round(seconds, 2), "returncode": result.returncode}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def assert_mpi_ok(result: MPIResult, expect_line: str | None = None) -> None:
    assert not result.timed_out and result.returncode == 0, result.describe()
    if expect_line is not None:
        assert expect_line in result.output, result.describe()


def check_lines(output: str) -> dict[str, str]:
    """``{check name: "PASS" or "FAIL ..."}`` from a suite run through ``tests/mpi/checks.py``."""
    found = {}
    for line in output.splitlines():
        if line.startswith("CHECK "):
            _, name, verdict = line.split(" ", 2)
            found[name] = verdict
    return found


def assert_check_passed(result: MPIResult, name: str) -> None:
    """One check of a suite run: passed, or fail with its line and every rank's output."""
    verdict = check_lines(result.output).get(name)
    assert verdict is not None, f"check {name} did not report: {result.describe()}"
    assert verdict == "PASS", f"check {name}: {verdict}\n{result.describe()}"


def library_algorithms() -> set[str]:
    """Names of the algorithms bagua_mpi itself registers (unit tests register their own in
    the pytest process; coverage checks are about the library's)."""
    import bagua_mpi as bm
    from bagua_mpi.algorithms import registry
    return {n for n in bm.algorithms.names()
            if registry._REGISTRY[n].__module__.startswith("bagua_mpi.")}


def skip_unless_mpi_cuda_aware() -> None:
    """Skip the calling test unless the library's own decision says this MPI reads device
    memory: ``MPIX_Query_cuda_support`` first, the child-process probe only where the MPI does
    not say (MPICH 5 hangs on a device buffer rather than failing, so asking the probe first
    stalled ``pytest -m gpu`` on an H100)."""
    from bagua_mpi import cuda
    cuda.set_cuda_aware(None)
    if not cuda.mpi_is_cuda_aware():
        pytest.skip(f"this MPI is not CUDA-aware ({cuda.how_decided()})")
