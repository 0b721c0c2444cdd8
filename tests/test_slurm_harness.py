"""The local Slurm that a test session starts stops with the session; one that was up before it
stays up. Each case runs a pytest session of its own on a cluster of its own (its own folder
and ports), so the cluster the other Slurm tests use is not touched."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_harness import REPO

INNER_TEST = '''
from slurm_harness import start_local_slurm


def test_starts_the_cluster():
    start_local_slurm()
'''


def _cluster_env(tmp_path):
    env = dict(os.environ)
    env.update(BAGUA_MPI_SLURM_DIR=str(tmp_path / "slurm"), BAGUA_MPI_SLURMCTLD_PORT="16917",
               BAGUA_MPI_SLURMD_PORT="16918",
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))
    return env


def _controller_running(tmp_path, settle=15.0) -> bool:
    """Whether the cluster's controller runs, once a stop has had ``settle`` seconds to end
    it (it exits a moment after its signal)."""
    conf = tmp_path / "slurm" / "slurm.conf"
    deadline = time.monotonic() + settle
    while True:
        running = subprocess.run(["pgrep", "-f", f"slurmctld -f {conf}"],
                                 capture_output=True).returncode == 0
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def _cluster(tmp_path, action):
    return subprocess.run(["bash", str(REPO / "slurm" / "local_cluster.sh"), action],
                          env=_cluster_env(tmp_path), capture_output=True, text=True,
                          timeout=600)


def _inner_session(tmp_path):
    test = tmp_path / "test_inner.py"
    test.write_text(INNER_TEST)
    # -p conftest: the tests' conftest.py (its session-end hook) as a plugin, since the inner
    # test file lies outside tests/
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-p", "conftest", str(test)], env=_cluster_env(tmp_path),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)


@pytest.mark.parametrize("up_before", [False, True])
def test_a_session_stops_only_the_slurm_it_started(tmp_path, up_before):
    # A fresh cluster numbers its jobs from 1 again: a killed step's MPICH segment left by an
    # earlier cluster's job of the same id would fail MPI_Init, so start clears unused ones.
    # (Non-hex letters in the name: MPICH's own never hold them.)
    stale, stale_left = Path(f"/dev/shm/mpich_shm_baguatest{os.getpid()}_0"), False
    if up_before:
        stale.write_bytes(bytes(4096))
        started = _cluster(tmp_path, "start")
        stale_left = stale.exists()
        stale.unlink(missing_ok=True)
        if started.returncode == 3:
            pytest.skip("Slurm is not installed and installing it needs root")
        assert started.returncode == 0, started.stderr
    try:
        assert not stale_left, "local_cluster.sh start left a stale MPICH segment in /dev/shm"
        inner = _inner_session(tmp_path)
        if "installing it needs root" in inner.stdout:   # -rs prints the skip's reason
            pytest.skip("Slurm is not installed and installing it needs root")
        assert inner.returncode == 0 and "1 passed" in inner.stdout, inner.stdout + inner.stderr
        assert _controller_running(tmp_path, settle=0 if up_before else 15) == up_before, \
            "the session stopped a cluster it did not start" if up_before else \
            "the session left the cluster it started running"
    finally:
        _cluster(tmp_path, "stop")
