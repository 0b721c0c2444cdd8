"""CUDA kernels in Numba's simulator, and their compilation for a real GPU.

The simulator must be switched on before numba.cuda is first imported, so it
runs ``sim_kernels.py`` (kernels against their CPU twins) and
``sim_launches.py`` (launch and sync counts) in two subprocesses side by side
with NUMBA_ENABLE_CUDASIM=1; the rest of the suite keeps the real numba.cuda.
The first also records the argument types of every kernel launch of
``sim_kernels.py``, which ``ptx_compile.py`` then compiles to PTX with the real
CUDA compiler where libNVVM is installed (no GPU needed).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@pytest.fixture(scope="module")
def simulator_run(tmp_path_factory):
    """Both simulator files at once, each in its own process: the simulator runs on one core,
    so the two take the time of the longer one."""
    record = tmp_path_factory.mktemp("simulator") / "launches.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBA_KERNELS_RECORD=str(record))
    procs = [subprocess.Popen([sys.executable, "-W", "ignore::RuntimeWarning", "-m", "pytest", "-q",
                               "-p", "no:cacheprovider", str(HERE / name)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("sim_kernels.py", "sim_launches.py")]
    outputs = [proc.communicate(timeout=900) for proc in procs]
    returncode = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(
        procs[0].args, returncode, "".join(out for out, _ in outputs),
        "".join(err for _, err in outputs)), record


def test_kernels_match_cpu_twins_in_simulator(simulator_run):
    proc, record = simulator_run
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" passed") == 2 and "skipped" not in proc.stdout
    assert record.exists()


def _nvvm_available():
    code = ("from numba.cuda.cudadrv import nvvm; import sys; "
            "sys.exit(0 if nvvm.is_available() else 1)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    return proc.returncode == 0


def test_kernels_compile_to_ptx(simulator_run):
    proc, record = simulator_run
    if proc.returncode != 0 or not record.exists():
        pytest.skip("the simulator run failed; see test_kernels_match_cpu_twins_in_simulator")
    if not _nvvm_available():
        pytest.skip("libNVVM not found (install nvidia-cuda-nvcc-cu12 and point CUDA_HOME at it): "
                    "cannot compile the kernels to PTX")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, str(HERE / "ptx_compile.py"), str(record)], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "compiled to PTX" in out.stdout
