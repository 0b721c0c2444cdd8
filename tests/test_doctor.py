"""``python -m bagua_mpi doctor``: the real command at 1 rank and under ``mpiexec -n 2`` (one node,
and two simulated nodes), its JSON, its exit status on a FAIL; and its pieces in-process."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from mpi_harness import REPO, mpiexec_path

from bagua_mpi import consistency, doctor
from bagua_mpi.doctor import FAIL, OK, WARN, Check

HAS_GPU = torch.cuda.is_available()
STATUS_LINE = re.compile(r"^(OK|WARN|FAIL) +(\S.*?)  +(.*)$")
SINGLE_PROCESS_CHECKS = (
    "settings", "bagua_mpi version", "torch version", "mpi4py version", "numba version",
    "h5py version", "numba-cuda version", "MPI library", "MPI thread level",
    "CUDA-aware MPI (library)", "CUDA-aware MPI (used)", "NCCL", "GPUs", "GPU mapping",
    "/dev/shm", "HDF5", "launcher", "Slurm", "backend")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"

    def lines(self) -> list[tuple[str, str, str]]:
        """(status, check, value) of every status line; a fix line belongs to the one above."""
        return [m.groups() for m in map(STATUS_LINE.match, self.stdout.splitlines()) if m]

    def line(self, check: str) -> tuple[str, str]:
        found = [(status, value) for status, name, value in self.lines() if name == check]
        assert len(found) == 1, f"expected one {check!r} line: {self.describe()}"
        return found[0]

    def json(self) -> list[dict]:
        return json.loads(self.stdout)


def clean_env(**extra: str) -> dict:
    """The test's environment without BAGUA_MPI_* or Slurm variables, so every run starts from
    the defaults; plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BAGUA_MPI_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    return env


def run_doctor(*args: str, nprocs: int | None = None, env: dict | None = None,
               timeout: float = 120.0) -> Run:
    """The real command, alone or under mpiexec; stdout and stderr apart (JSON is stdout only)."""
    cmd = [sys.executable, "-m", "bagua_mpi", *args]
    if nprocs is not None:
        cmd = [mpiexec_path(), "-n", str(nprocs)] + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or clean_env(), cwd=REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out:\n{out}\n{err}")
    return Run(proc.returncode, out, err)


_RUNS: dict = {}


def cached(key: str, *args: str, **kwargs) -> Run:
    """Each distinct run once per session: several tests read the same output."""
    if key not in _RUNS:
        _RUNS[key] = run_doctor(*args, **kwargs)
    return _RUNS[key]


def one_rank() -> Run:
    return cached("one rank", "doctor")


def one_rank_json() -> Run:
    return cached("one rank json", "doctor", "--json")


def two_ranks() -> Run:
    return cached("two ranks", "doctor", nprocs=2)


def two_nodes_json() -> Run:
    return cached("two nodes json", "doctor", "--json", nprocs=2,
                  env=clean_env(BAGUA_MPI_RANKS_PER_NODE="1"))


# -- one rank -------------------------------------------------------------------------------

def test_one_rank_exits_zero_without_fail():
    run = one_rank()
    assert run.returncode == 0, run.describe()
    assert not [line for line in run.lines() if line[0] == FAIL], run.describe()


@pytest.mark.parametrize("check", SINGLE_PROCESS_CHECKS)
def test_one_rank_reports(check):
    status, value = one_rank().line(check)
    assert status in (OK, WARN) and value, one_rank().describe()


def test_every_line_is_a_status_line_or_a_fix():
    run = two_ranks()
    for text in run.stdout.splitlines():
        assert STATUS_LINE.match(text) or text.strip().startswith("fix: "), run.describe()
    warn_or_fail = sum(1 for line in run.lines() if line[0] != OK)
    assert run.stdout.count("fix: ") == warn_or_fail, run.describe()


def test_versions_match_the_installed_packages():
    import h5py
    import mpi4py
    import numba

    import bagua_mpi
    run = one_rank()
    for name, module in (("bagua_mpi", bagua_mpi), ("torch", torch), ("mpi4py", mpi4py),
                         ("numba", numba), ("h5py", h5py)):
        assert run.line(f"{name} version") == (OK, module.__version__), run.describe()


def test_mpi_library_and_thread_level():
    from mpi4py import MPI
    run = one_rank()
    status, value = run.line("MPI library")
    assert status == OK
    assert value.startswith(" ".join(MPI.Get_library_version().splitlines()[0].split()))
    status, value = run.line("MPI thread level")
    assert value.split(":")[0] in ("single", "funneled", "serialized", "multiple")
    assert status == (OK if value == "multiple" else WARN), run.describe()


@pytest.mark.skipif(HAS_GPU, reason="checks the answers of a machine without a GPU")
def test_without_a_gpu():
    run = one_rank()
    assert run.line("GPUs") == (OK, "none visible (torch.cuda.is_available() is False)")
    assert run.line("GPU mapping") == (OK, "local rank 0 (single process) -> CPU")
    assert run.line("CUDA-aware MPI (used)") == (OK, "not needed: no GPU visible (not probed)")
    status, value = run.line("numba-cuda version")
    assert status == OK, run.describe()


def test_settings_slurm_hdf5_and_backend():
    import h5py
    run = one_rank()
    assert run.line("settings") == (OK, "all valid; none set (defaults)")
    assert run.line("Slurm") == (OK, "not a Slurm task (no SLURM_PROCID)")
    status, value = run.line("HDF5")
    assert status == OK
    assert ("parallel (MPI-IO)" if h5py.get_config().mpi else "serial") in value
    status, value = run.line("backend")
    assert status == OK and ("auto would choose" in value or "configured backend" in value)


def test_json_lists_every_check_with_its_status_and_fix():
    run = one_rank_json()
    assert run.returncode == 0, run.describe()
    items = run.json()
    assert all(set(item) == {"check", "status", "value", "fix"} for item in items)
    assert {item["check"] for item in items} >= set(SINGLE_PROCESS_CHECKS)
    for item in items:
        assert item["status"] in (OK, WARN, FAIL)
        assert (item["fix"] is None) == (item["status"] == OK), item


def test_wrong_slurm_plugin_is_a_warning(monkeypatch):
    # every task a singleton of its own: the symptom of srun without a working --mpi plugin
    for variable in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(variable)
    for variable, value in (("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_ID", "42")):
        monkeypatch.setenv(variable, value)
    slurm, agreement = doctor.slurm_checks(None)  # this pytest process: a singleton MPI job
    assert slurm == doctor.ok("Slurm", "SLURM_JOB_ID=42 SLURM_NTASKS=2")
    assert agreement.check == "Slurm vs MPI" and agreement.status == WARN
    assert "SLURM_NTASKS=2 but MPI world size is 1" in agreement.value
    # pmi2, and pmix only where it is right: the mpich extra's MPICH aborts under pmix
    assert agreement.fix == ("launch with srun --mpi=pmi2 (--mpi=pmix only where the MPI was "
                             "built with PMIx, e.g. Open MPI), not srun inside mpiexec")


def test_lone_task_of_a_srun_step_fails_with_the_plugin_to_use(monkeypatch):
    """Inside a srun step of 2 tasks (SLURM_STEP_NUM_TASKS, set in steps only), a 1-rank MPI
    job is what srun without a working --mpi plugin starts, and init refuses it: a FAIL with
    the plugin to use, where the same variables without SLURM_STEP_NUM_TASKS (Python run from
    the batch script) stay a WARN."""
    for variable in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(variable)
    for variable, value in (("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"),
                            ("SLURM_STEP_NUM_TASKS", "2")):
        monkeypatch.setenv(variable, value)
    _, agreement = doctor.slurm_checks(None)  # this pytest process: a singleton MPI job
    assert agreement.check == "Slurm vs MPI" and agreement.status == FAIL, agreement
    assert agreement.value == ("SLURM_PROCID=1 but MPI world rank is 0; SLURM_NTASKS=2 but MPI "
                               "world size is 1; SLURM_STEP_NUM_TASKS=2: srun started 2 tasks, "
                               "each an MPI job of 1 rank, so bagua_mpi.init() refuses it")
    assert agreement.fix == ("launch with srun --mpi=pmi2 (--mpi=pmix only where the MPI was "
                             "built with PMIx, e.g. Open MPI)")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert doctor.slurm_checks(None)[1].status == WARN


def test_lone_task_of_a_srun_step_makes_the_doctor_exit_1():
    run = run_doctor("doctor", env=clean_env(SLURM_PROCID="0", SLURM_NTASKS="2",
                                             SLURM_STEP_NUM_TASKS="2", SLURM_JOB_ID="42"))
    status, value = run.line("Slurm vs MPI")
    assert status == FAIL and "SLURM_STEP_NUM_TASKS=2: srun started 2 tasks" in value, \
        run.describe()
    assert "fix: launch with srun --mpi=pmi2 " in run.stdout and run.returncode == 1, \
        run.describe()


def test_launch_script_settings_are_not_taken_for_typos(monkeypatch):
    """A job submitted with BAGUA_MPI_SRUN_MPI or BAGUA_MPI_BIND_GPU (read by the sbatch
    templates) hands them to every rank: only a real unknown name is reported."""
    for variable in [v for v in os.environ if v.startswith("BAGUA_MPI_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("BAGUA_MPI_SRUN_MPI", "pmix")
    monkeypatch.setenv("BAGUA_MPI_BIND_GPU", "/x/slurm/bind_gpu.sh")
    assert [c.check for c in doctor.settings_checks()] == ["settings"]
    monkeypatch.setenv("BAGUA_MPI_CHEK", "0")
    unknown = doctor.settings_checks()[1]
    assert unknown.status == WARN and unknown.value.startswith("BAGUA_MPI_CHEK ("), unknown


def test_agreeing_slurm_is_ok(monkeypatch):
    for variable in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert doctor.slurm_checks(None) == [
        doctor.ok("Slurm", "SLURM_NTASKS=1"),
        doctor.ok("Slurm vs MPI", "SLURM_PROCID/SLURM_NTASKS match MPI")]


# -- FAIL gives a non-zero exit, on every rank, without a crash --------------------------------

@pytest.mark.skipif(HAS_GPU, reason="forcing CUDA-aware MPI is legitimate with a GPU")
@pytest.mark.parametrize("nprocs", [None, 2], ids=["alone", "2 ranks"])
def test_forced_cuda_aware_without_gpu_fails(nprocs):
    run = run_doctor("doctor", nprocs=nprocs, env=clean_env(BAGUA_MPI_CUDA_AWARE="1"))
    assert run.returncode == 1, run.describe()
    status, value = run.line("CUDA-aware MPI (used)")
    assert (status, value) == (FAIL, "forced CUDA-aware without a GPU (BAGUA_MPI_CUDA_AWARE=1)")
    assert "fix: unset BAGUA_MPI_CUDA_AWARE" in run.stdout
    assert "Aborting" not in run.stderr and "Traceback" not in run.stderr, run.describe()


def test_malformed_setting_fails_by_name_under_mpiexec():
    run = run_doctor("doctor", "--json", nprocs=2,
                     env=clean_env(BAGUA_MPI_STALL_ABORT_S="soon", BAGUA_MPI_TYPO="1"))
    assert run.returncode == 1, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    found = {item["check"]: item for item in run.json()}
    bad = found["setting BAGUA_MPI_STALL_ABORT_S"]
    assert bad["status"] == FAIL and "'soon'" in bad["value"]
    assert "BAGUA_MPI_STALL_ABORT_S" in bad["fix"]
    assert found["unknown settings"]["status"] == WARN
    assert "BAGUA_MPI_TYPO" in found["unknown settings"]["value"]
    # init needs valid settings: the multi-rank checks are skipped, and say so
    assert found["bagua_mpi.init"]["status"] == WARN
    assert "topology" not in found


# -- two ranks ------------------------------------------------------------------------------

def test_two_ranks_exit_zero():
    run = two_ranks()
    assert run.returncode == 0, run.describe()
    assert not [line for line in run.lines() if line[0] == FAIL], run.describe()


def test_two_ranks_print_once():
    run = two_ranks()
    assert [name for _, name, _ in run.lines()].count("MPI library") == 1, run.describe()


def test_two_ranks_topology():
    assert two_ranks().line("topology")[0] == OK
    assert two_ranks().line("topology")[1].startswith("2 ranks on 1 node(s), 2 rank(s) per node")


def test_two_ranks_gpu_mapping_per_rank():
    mappings = [value for _, name, value in two_ranks().lines() if name == "GPU mapping"]
    assert len(mappings) == 2, two_ranks().describe()
    assert mappings[0].startswith("local rank 0 (topology)") and mappings[0].endswith("[rank 0]")
    assert mappings[1].startswith("local rank 1 (topology)") and mappings[1].endswith("[rank 1]")


def test_two_ranks_node_shared_buckets():
    from bagua_mpi.node_shared import _SHM_HEADROOM
    st = os.statvfs("/dev/shm")
    room = st.f_bavail * st.f_frsize >= doctor.DEFAULT_BUCKET_BYTES * 2 * _SHM_HEADROOM
    status, value = two_ranks().line("node-shared buckets")
    assert status == (OK if room else WARN)
    assert value.startswith("used" if room else "not used"), two_ranks().describe()


@pytest.mark.parametrize("kind, unit", [("latency", "us"), ("bandwidth", "ms")])
def test_two_ranks_allreduce_check(kind, unit):
    # timings are noisy on a shared 2-core machine: a WARN (far slower than MPI) is allowed
    status, value = two_ranks().line(f"allreduce {kind} (node, 2 ranks)")
    assert status in (OK, WARN)
    number = r"\d+\.\d"
    assert re.search(rf"bagua_mpi {number} {unit}.*MPI {number} {unit}.*\(x\d+\.\d\d\)", value)


def test_two_simulated_nodes_json():
    run = two_nodes_json()
    assert run.returncode == 0, run.describe()
    found = {item["check"]: item for item in run.json()}
    assert found["topology"]["value"].startswith(
        "2 ranks on 2 node(s), simulated by BAGUA_MPI_RANKS_PER_NODE=1, 1 rank(s) per node")
    assert found["node-shared buckets"] == {
        "check": "node-shared buckets", "status": OK, "fix": None,
        "value": "not used: one rank per node (nothing to share)"}
    assert "allreduce latency (across nodes, 2 ranks)" in found
    assert "allreduce bandwidth (across nodes, 2 ranks)" in found
    assert not [name for name in found if "(node," in name or "(world," in name]


# -- the command line -------------------------------------------------------------------------

def test_unknown_subcommand_is_a_usage_error():
    run = run_doctor("docter")
    assert run.returncode == 2, run.describe()
    assert "usage: python -m bagua_mpi" in run.stderr
    assert "invalid choice: 'docter' (choose from 'doctor')" in run.stderr


def test_missing_subcommand_is_a_usage_error(capsys):
    from bagua_mpi.__main__ import main
    with pytest.raises(SystemExit) as stopped:
        main([])
    assert stopped.value.code == 2
    assert "the following arguments are required: command" in capsys.readouterr().err


# -- the pieces, in-process -----------------------------------------------------------------

def test_warn_and_fail_need_a_fix():
    with pytest.raises(ValueError, match="needs a fix"):
        Check("x", WARN, "value")
    with pytest.raises(ValueError, match="OK, WARN or FAIL"):
        Check("x", "MAYBE", "value")


def test_ranks_text():
    assert consistency.ranks_text([3]) == "rank 3"
    assert consistency.ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7-8"


def test_merge_keeps_common_lines_once_and_splits_the_rest():
    same = doctor.ok("MPI library", "X")
    per_rank = [[same, doctor.ok("GPU mapping", f"local rank {r % 2}")] for r in range(4)]
    merged = doctor.merge_ranks(per_rank)
    assert merged == [same, doctor.ok("GPU mapping", "local rank 0 [ranks 0,2]"),
                      doctor.ok("GPU mapping", "local rank 1 [ranks 1,3]")]


def test_merge_summarizes_beyond_max_variants():
    per_rank = [[doctor.ok("/dev/shm", f"{r} GiB")] for r in range(doctor.MAX_VARIANTS + 3)]
    per_rank[-1] = [doctor.warn("/dev/shm", "tiny", "enlarge it")]
    merged = doctor.merge_ranks(per_rank)
    assert len(merged) == doctor.MAX_VARIANTS + 1
    last = merged[-1]
    assert last.status == WARN and last.value.startswith("3 more variants, worst: tiny")


def test_merge_fails_on_differing_versions():
    per_rank = [[doctor.ok("torch version", v)] for v in ("2.5.0", "2.5.0", "2.6.0")]
    merged = doctor.merge_ranks(per_rank)
    assert merged[-1].check == "versions across ranks" and merged[-1].status == FAIL
    assert "torch (2.5.0, 2.6.0)" in merged[-1].value


def fake_topology(local_rank: int, local_size: int):
    return SimpleNamespace(local_rank=local_rank, local_size=local_size)


def test_gpu_mapping_is_local_rank_modulo_gpus():
    gpus = ["GPU A", "GPU B"]
    checks = doctor.gpu_checks(gpus, fake_topology(3, 2))
    assert checks[0] == doctor.ok("GPUs", "2 visible: GPU A, GPU B")
    assert checks[1] == doctor.ok("GPU mapping", "local rank 3 (topology) -> cuda:1 GPU B")


def test_more_ranks_than_gpus_warns():
    mapping = doctor.gpu_checks(["GPU A"], fake_topology(1, 2))[1]
    assert mapping.status == WARN and "2 ranks share 1 GPU(s)" in mapping.value


def test_ranks_that_each_see_their_own_gpu_are_not_taken_for_sharing(monkeypatch):
    """Under init the node's GPU ids decide: two ranks that each see one GPU (device 0) of
    their own are fine, where counting 1 GPU against 2 ranks warned; two that map to one GPU
    are warned about, naming both."""
    from bagua_mpi import backends
    monkeypatch.setattr(backends, "_node_gpus", [("GPU-a", "GPU A"), ("GPU-b", "GPU A")])
    mapping = doctor.gpu_checks(["GPU A"], fake_topology(1, 2))[1]
    assert mapping == doctor.ok("GPU mapping", "local rank 1 (topology) -> cuda:0 GPU A, a GPU "
                                               "no other local rank maps to")
    monkeypatch.setattr(backends, "_node_gpus", [("GPU-a", "GPU A"), ("GPU-a", "GPU A")])
    mapping = doctor.gpu_checks(["GPU A"], fake_topology(1, 2))[1]
    assert mapping.status == WARN and "which local ranks 0-1 share" in mapping.value


def test_a_process_started_by_torchrun_fails_the_launcher_line():
    """Under torchrun each process is a one-rank MPI job (WORLD_SIZE says 4): the launcher line
    FAILs with the command to use, and the doctor exits 1; without WORLD_SIZE it is OK."""
    assert one_rank().line("launcher") == (OK, "MPI started 1 rank(s)")
    run = run_doctor("doctor", env=clean_env(WORLD_SIZE="4", RANK="2", LOCAL_RANK="2"))
    status, value = run.line("launcher")
    assert status == FAIL and "WORLD_SIZE=4: started by torchrun" in value, run.describe()
    assert "mpiexec -n 4" in run.stdout and run.returncode == 1, run.describe()


def test_local_rank_from_launcher_variables(monkeypatch):
    for variable in doctor.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert doctor.local_rank_and_source(None) == (0, "single process")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert doctor.local_rank_and_source(None) == (3, "SLURM_LOCALID")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    for variable in doctor.LOCAL_SIZE_VARIABLES[:-1]:
        monkeypatch.delenv(variable, raising=False)
    assert doctor.local_size_and_source(None) == (4, "SLURM_NTASKS_PER_NODE")


def test_numba_cuda_missing_matters_only_with_a_gpu(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert doctor.numba_cuda_check([]).status == OK
    with_gpu = doctor.numba_cuda_check(["GPU A"])
    assert with_gpu.status == WARN and with_gpu.fix == "pip install 'bagua_mpi[cuda]'"


# -- libNVVM: whether numba.cuda can compile the GPU kernels (stand-ins: no GPU here) ----------

@pytest.fixture
def gpu_with_numba_cuda(monkeypatch):
    """numba-cuda installed (whatever this machine has), and the lookup of libNVVM given by
    the test: ``found(version)`` or ``missing(exception)``; the no-GPU line must not ask."""
    import importlib.metadata

    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.30.4"
                        if name == "numba-cuda" else real_version(name))
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)

    def answer(result):
        def lookup():
            if isinstance(result, Exception):
                raise result
            return result
        monkeypatch.setattr(doctor, "find_libnvvm", lookup)
    return answer


def test_libnvvm_without_a_gpu_is_not_looked_for(gpu_with_numba_cuda):
    gpu_with_numba_cuda(AssertionError("looked for libNVVM without a GPU"))
    assert doctor.nvvm_checks([]) == [doctor.ok(
        "libNVVM (numba-cuda)", "not checked: no GPU visible (only GPU kernels need it)")]


def test_libnvvm_missing_with_a_gpu_warns_with_the_cuda_extra(gpu_with_numba_cuda):
    """torch's CUDA wheels lack libNVVM: the first compressed step would fail to compile, so
    the doctor says so, and names the extra that brings it (numba-cuda[cu12])."""
    class NvvmSupportError(ImportError):
        """numba's own (a stand-in: importing numba.cuda here would pick its target early)."""

    gpu_with_numba_cuda(NvvmSupportError("libNVVM cannot be found.\nlibnvvm.so: cannot open"))
    (check,) = doctor.nvvm_checks(["GPU A"])
    assert check.check == "libNVVM (numba-cuda)" and check.status == WARN, check
    assert "NvvmSupportError: libNVVM cannot be found. libnvvm.so: cannot open" in check.value
    assert "gradient_allreduce runs" in check.value
    assert "pip install 'bagua_mpi[cuda]'" in check.fix and "numba-cuda[cu12]" in check.fix


def test_libnvvm_found_with_a_gpu_is_ok(gpu_with_numba_cuda, monkeypatch):
    gpu_with_numba_cuda("2.0")
    monkeypatch.setattr(doctor, "nvvm_path", lambda: "/opt/cuda/nvvm/lib64/libnvvm.so")
    assert doctor.nvvm_checks(["GPU A"]) == [doctor.ok(
        "libNVVM (numba-cuda)",
        "libNVVM 2.0 loaded by numba.cuda from /opt/cuda/nvvm/lib64/libnvvm.so")]


def test_libnvvm_is_not_looked_for_without_numba_cuda_or_under_the_simulator(
        gpu_with_numba_cuda, monkeypatch):
    """Without numba-cuda its own line WARNs already; under NUMBA_ENABLE_CUDASIM numba.cuda is
    the simulator, whose NVVM is a stub that would always say no."""
    import importlib.metadata

    from numba.core import config as numba_config

    gpu_with_numba_cuda(AssertionError("looked for libNVVM"))
    monkeypatch.setattr(numba_config, "ENABLE_CUDASIM", 1)
    (check,) = doctor.nvvm_checks(["GPU A"])
    assert check.status == OK and "NUMBA_ENABLE_CUDASIM=1" in check.value

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    (check,) = doctor.nvvm_checks(["GPU A"])
    assert check.status == OK and "numba-cuda is not installed" in check.value


def test_libnvvm_lookup_runs_numbas_own_code_without_a_gpu():
    """The real lookup (numba.cuda's ``NVVM()``) with a stand-in GPU, in a child process so
    this one's numba.cuda stays unimported: it answers OK or WARN, quickly, and never
    raises; a machine without a GPU has no CUDA driver to hang in."""
    code = ("import importlib.metadata as m; real = m.version; "
            "m.version = lambda n: '0' if n == 'numba-cuda' else real(n); "
            "from bagua_mpi import doctor; (c,) = doctor.nvvm_checks(['GPU A']); "
            "print(c.status, c.value)")
    env = {k: v for k, v in clean_env().items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(r"(OK libNVVM \S+ loaded by numba\.cuda|WARN numba\.cuda cannot load it)",
                    proc.stdout), proc.stdout + proc.stderr


@pytest.mark.skipif(HAS_GPU, reason="checks the answers of a machine without a GPU")
def test_without_a_gpu_the_doctor_does_not_look_for_libnvvm():
    run = one_rank()
    assert run.line("libNVVM (numba-cuda)") == (
        OK, "not checked: no GPU visible (only GPU kernels need it)"), run.describe()


@pytest.fixture
def decided(monkeypatch):
    """Make ``cuda`` answer ``aware`` (as if decided ``how``) without probing anything."""
    from bagua_mpi import cuda

    def decide(aware: bool, how: str | None, setting: str | None = None):
        monkeypatch.setattr(cuda, "mpi_is_cuda_aware", lambda: aware)
        if how is None:
            monkeypatch.delattr(cuda, "how_decided", raising=False)
        else:
            monkeypatch.setattr(cuda, "how_decided", lambda: how, raising=False)
        if setting is None:
            monkeypatch.delenv("BAGUA_MPI_CUDA_AWARE", raising=False)
        else:
            monkeypatch.setenv("BAGUA_MPI_CUDA_AWARE", setting)
    return decide


def test_forced_cuda_aware_without_a_gpu_fails_in_process(decided):
    decided(True, None, setting="1")
    used = doctor.cuda_aware_checks([])[1]
    assert used == doctor.fail("CUDA-aware MPI (used)",
                               "forced CUDA-aware without a GPU (BAGUA_MPI_CUDA_AWARE=1)",
                               used.fix)
    assert "unset BAGUA_MPI_CUDA_AWARE" in used.fix


def test_forced_off_without_a_gpu_is_fine(decided):
    decided(False, None, setting="0")
    assert doctor.cuda_aware_checks([])[1] == doctor.ok(
        "CUDA-aware MPI (used)", "no (forced by BAGUA_MPI_CUDA_AWARE=0)")


@pytest.mark.parametrize("aware, status", [(True, OK), (False, WARN)])
def test_probe_verdict_with_a_gpu_says_how(decided, aware, status):
    decided(aware, "the MPI library does not say; a device allreduce in a child process ...")
    used = doctor.cuda_aware_checks(["GPU A"])[1]
    assert used.check == "CUDA-aware MPI (used)" and used.status == status
    assert used.value.startswith(("yes" if aware else "no") + " (the MPI library does not say")


def test_probe_verdict_without_how_decided(decided):
    decided(True, None)
    used = doctor.cuda_aware_checks(["GPU A"])[1]
    assert used == doctor.ok("CUDA-aware MPI (used)",
                             "yes (probe: a device buffer through MPI in a child process)")


def test_forcing_on_against_the_library_warns(decided, monkeypatch):
    from bagua_mpi import cuda
    decided(True, "forced by BAGUA_MPI_CUDA_AWARE=1", setting="1")
    monkeypatch.setattr(cuda, "mpi_reports_cuda_support", lambda: False)
    library, used = doctor.cuda_aware_checks(["GPU A"])
    assert library == doctor.ok("CUDA-aware MPI (library)", "no (MPIX_Query_cuda_support)")
    assert used.status == WARN and "library itself reports no CUDA support" in used.value


def test_shm_rule_for_ranks_per_node():
    # the largest gradient that fits is free / (ranks x headroom): node_shared.usable's rule
    check = doctor.shm_checks(fake_topology(0, 4))[0]
    assert check.check == "/dev/shm" and "at 4 ranks per node" in check.value
    assert "rule: free >= bytes x ranks x 1.25" in check.value


def test_a_crashing_probe_is_a_fail_not_a_crash():
    def broken():
        raise RuntimeError("driver gone")
    (check,) = doctor.guarded("GPUs", broken)
    assert check.status == FAIL and "RuntimeError: driver gone" in check.value


def test_render_text_puts_the_fix_under_its_line():
    text = doctor.render_text([doctor.ok("a", "fine"), doctor.fail("bbb", "bad", "do this")])
    assert text.splitlines() == ["OK    a    fine", "FAIL  bbb  bad", "           fix: do this"]


def test_two_ranks_gloo_backend_says_buckets_stay_private():
    run = run_doctor("doctor", "--json", nprocs=2, env=clean_env(BAGUA_MPI_BACKEND="gloo"))
    assert run.returncode == 0, run.describe()
    found = {item["check"]: item for item in run.json()}
    assert found["node-shared buckets"] == {
        "check": "node-shared buckets", "status": OK, "fix": None,
        "value": "not used: gloo carries host payloads (the buckets are MPI's)"}
