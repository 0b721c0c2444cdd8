"""Start the repository's single-node Slurm (slurm/local_cluster.sh) and run jobs under srun."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpi_harness import MPI_SUITES, REPO, MPIResult, run_job

SLURM_DIR = os.environ.get("BAGUA_MPI_SLURM_DIR", "/tmp/bagua_mpi_slurm")
SLURM_CONF = os.path.join(SLURM_DIR, "slurm.conf")


SCRIPT = REPO / "slurm" / "local_cluster.sh"
# Whether this process started the local Slurm's daemons (they were not running before): the
# session then stops them at its end (``stop_local_slurm_if_started``, from conftest.py), and
# leaves alone a cluster that a developer or an earlier session keeps up.
_started_here = False


def _controller_running() -> bool:
    return subprocess.run(["pgrep", "-f", f"slurmctld -f {SLURM_CONF}"],
                          capture_output=True).returncode == 0


def start_local_slurm() -> dict:
    """Bring the local Slurm up (installing it when root); skip, naming why, if impossible."""
    global _started_here
    was_running = _controller_running()
    proc = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True,
                          timeout=600)
    _started_here = _started_here or (proc.returncode == 0 and not was_running)
    if proc.returncode == 3:
        pytest.skip("Slurm is not installed and installing it needs root: " + proc.stderr.strip())
    if proc.returncode != 0:
        pytest.fail(f"could not start the local Slurm:\n{proc.stdout}\n{proc.stderr}")
    env = dict(os.environ)
    env["SLURM_CONF"] = SLURM_CONF
    return env


def stop_local_slurm_if_started() -> None:
    """Stop the local Slurm's controller and node daemon if this process started them."""
    global _started_here
    if _started_here:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=60)
        _started_here = False


def slurm_env(base: dict, extra: dict | None = None) -> dict:
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    # the batch scripts run "${PYTHON:-python}": the tests' own interpreter, as run_srun's
    # steps, whether or not its folder is on PATH
    env.setdefault("PYTHON", sys.executable)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(MPI_SUITES)]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra or {})
    return env


def run_srun(base_env: dict, script: str, ntasks: int, *args: str, env: dict | None = None,
             timeout: float = 180.0) -> MPIResult:
    cmd = ["srun", f"--ntasks={ntasks}", "--mpi=pmi2", "--kill-on-bad-exit=1",
           sys.executable, str(MPI_SUITES / script), *args]
    return run_job(cmd, slurm_env(base_env, env), timeout)
