"""The test forkserver (tests/forkserver) is invisible to a job: the same script under the same
mpiexec, or alone, shows the same argv, directory, environment, sys.path and flags, a collector
that frees the rank's own garbage cycles (the server's objects are frozen), ends with
the same exit status, and leaves no rank behind when the job is killed. The oracle is the same
job started with fresh interpreters (``BAGUA_TEST_FORKSERVER=0``)."""
from __future__ import annotations

import functools
import json
import os
import sys
import time

import pytest

from forkserver import HERE
from mpi_harness import mpiexec_path, run_job

RANKS = 2
LAUNCHERS = {"mpiexec": RANKS, "alone": 1}


def probe(mode: str, preloaded: bool, timeout: float = 60, launcher: str = "mpiexec"):
    env = dict(os.environ, OMP_NUM_THREADS="1", PROBE_VALUE="per-job value",
               BAGUA_TEST_FORKSERVER="1" if preloaded else "0",
               PYTHONPATH=os.pathsep.join(["/nonexistent/probe-path", os.getcwd()]))
    cmd = [sys.executable, str(HERE / "probe.py"), mode]
    if launcher == "mpiexec":
        cmd = [mpiexec_path(), "-n", str(RANKS)] + cmd
    return run_job(cmd, env, timeout)


def lines(output: str, tag: str) -> dict[int, str]:
    found = {}
    for line in output.splitlines():
        if line.startswith(tag + " "):
            _, rank, rest = line.split(" ", 2)
            found[int(rank)] = rest
    return found


@functools.cache
def described(launcher: str) -> dict:
    """The describe probe run by ``launcher``, with fresh (False) and preloaded (True) ranks."""
    return {preloaded: probe("describe", preloaded, launcher=launcher)
            for preloaded in (False, True)}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_preloaded_rank_sees_what_a_fresh_one_sees(launcher):
    runs = described(launcher)
    fresh, preloaded = (lines(runs[p].output, "SAME") for p in (False, True))
    assert sorted(fresh) == list(range(LAUNCHERS[launcher])), runs[False].describe()
    assert preloaded == fresh, runs[True].describe()


def test_preloaded_ranks_of_a_job_differ_in_hash_seed_and_numpy_seed():
    runs = described("mpiexec")
    varies = {rank: json.loads(text) for rank, text in
              lines(runs[True].output, "VARIES").items()}
    assert len(varies) == RANKS, runs[True].describe()
    for key in ("hash", "numpy"):
        assert len({v[key] for v in varies.values()}) == RANKS, (key, varies)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize("mode", ["exit", "raise", "signal"])
def test_the_job_ends_with_the_status_a_fresh_one_ends_with(mode, launcher):
    fresh, preloaded = (probe(mode, p, launcher=launcher) for p in (False, True))
    assert not fresh.timed_out and fresh.returncode != 0, fresh.describe()
    assert (preloaded.timed_out, preloaded.returncode) == (False, fresh.returncode), (
        f"fresh exit {fresh.returncode}; {preloaded.describe()}")
    if mode == "raise":
        assert "probe raised on purpose" in preloaded.output, preloaded.describe()


def test_a_killed_job_leaves_no_preloaded_rank_behind():
    result = probe("hang", True, timeout=15)
    assert result.timed_out, result.describe()
    pids = [int(pid) for pid in lines(result.output, "PID").values()]
    assert len(pids) == RANKS, result.describe()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids), pids


def test_job_log_has_a_line_per_job_naming_its_test(tmp_path, monkeypatch):
    """``MPI_HARNESS_JOB_LOG``: each job appends its command, test, seconds and exit code."""
    log = tmp_path / "jobs.jsonl"
    monkeypatch.setenv("MPI_HARNESS_JOB_LOG", str(log))
    for code in (0, 3):
        run_job([sys.executable, "-c", f"import sys; sys.exit({code})"], dict(os.environ), 60)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["returncode"] for line in lines] == [0, 3]
    assert all(line["cmd"][0] == sys.executable and line["seconds"] >= 0 for line in lines)
    assert all("test_job_log_has_a_line_per_job" in line["test"] for line in lines)
