"""Start MPI test ranks from preloaded Pythons instead of fresh interpreters.

``preloaded_command(cmd, env)`` rewrites ``[mpiexec ...] <python> script.py ...`` so that what
runs is ``stub.py``, which has the rank forked from a server that imported torch once. The job is
still a real mpiexec job: same PMI, stdio, environment, argv, exit codes and signals; only the
interpreter's start-up is shared (see server.py for how).

Honesty of the shared start-up:
- each rank slot (rank mod ``SLOTS``) has its own server, so ranks of one job differ in hash seed
  as fresh interpreters do, and a rank-dependent ``set`` order still shows;
- a server is keyed by every variable its imports read while loading (``IMPORT_TIME``
  prefixes): a job with another ``NUMBA_ENABLE_CUDASIM`` or ``OMP_NUM_THREADS`` gets its own;
- ``BAGUA_TEST_FORKSERVER=0`` turns it off, and the README's main job, the doctor and the Slurm
  jobs always start fresh interpreters.
"""
from __future__ import annotations

import atexit
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SLOTS = 4
IMPORT_TIME = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "NUMBA_", "TORCH_",
               "PYTORCH_", "CUDA_", "NVIDIA_", "HDF5_", "MALLOC_", "LD_", "LC_", "LANG", "TMPDIR")
START_TIMEOUT_S = 120

_lock = threading.Lock()
_servers: dict[tuple, tuple[str, list[subprocess.Popen]]] = {}


def enabled(env: dict) -> bool:
    # Linux only: the stub lists its descriptors in /proc and the rank uses prctl
    return sys.platform == "linux" and env.get("BAGUA_TEST_FORKSERVER", "1") != "0"


def preloaded_command(cmd: list[str], env: dict) -> tuple[list[str], dict]:
    """``(cmd, env)`` with this Python's script replaced by the stub, when ``cmd`` is
    ``[mpiexec [options]] sys.executable script.py [args]``; otherwise unchanged (without
    mpiexec the one rank initializes MPI as a singleton, as ``python script.py`` does)."""
    if not enabled(env) or sys.executable not in cmd:
        return cmd, env
    at = cmd.index(sys.executable)
    if at > 0 and Path(cmd[0]).name != "mpiexec":
        return cmd, env  # srun, bash, ...: not ours to change
    if at + 1 >= len(cmd) or not cmd[at + 1].endswith(".py"):
        return cmd, env  # python -m / -c / options: left to a fresh interpreter
    directory = _servers_for(env)
    stub_env = dict(env, BAGUA_TEST_FORKSERVER_DIR=directory,
                    BAGUA_TEST_FORKSERVER_SLOTS=str(SLOTS))
    return cmd[:at] + [sys.executable, "-S", "-E", str(HERE / "stub.py")] + cmd[at + 1:], stub_env


def _servers_for(env: dict) -> str:
    # PYTHONPATH is applied in the rank (server.become), so jobs with their own share servers
    key = tuple(sorted((k, v) for k, v in env.items()
                       if k.startswith(IMPORT_TIME) and k != "PYTHONPATH"))
    with _lock:
        if key not in _servers:
            _servers[key] = _start(dict(key))
        return _servers[key][0]


def _start(import_env: dict) -> tuple[str, list[subprocess.Popen]]:
    directory = tempfile.mkdtemp(prefix="bagua_mpi_forkserver_")
    env = dict(import_env, PATH=os.environ.get("PATH", ""))
    log = open(os.path.join(directory, "servers.log"), "w")
    servers = [subprocess.Popen([sys.executable, str(HERE / "server.py"),
                                 os.path.join(directory, f"slot{slot}.sock")],
                                env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True)
               for slot in range(SLOTS)]
    log.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    for server in servers:
        ready, _, _ = select.select([server.stdout], [], [], max(0, deadline - time.monotonic()))
        if not ready or server.stdout.readline().strip() != "ready":
            for other in servers:
                other.kill()
            raise RuntimeError(f"test forkserver did not report ready: it exited or took over "
                               f"{START_TIMEOUT_S} s (log: {directory}/servers.log):\n"
                               + Path(directory, "servers.log").read_text())
    atexit.register(_stop, directory, servers)
    return directory, servers


def _stop(directory: str, servers: list[subprocess.Popen]) -> None:
    for server in servers:
        server.kill()
        server.wait()
    shutil.rmtree(directory, ignore_errors=True)
