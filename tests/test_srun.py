"""The foundation under a real ``srun --mpi=pmi2`` (the repository's single-node Slurm)."""
import functools
import re
import sys

import pytest

from mpi_harness import assert_check_passed, assert_mpi_ok, run_job
from slurm_harness import run_srun, slurm_env, start_local_slurm

import collectives_suite


@pytest.fixture(scope="module")
def slurm():
    return start_local_slurm()


@pytest.fixture(scope="module")
def collectives_job(slurm):
    return functools.cache(lambda ntasks: run_srun(slurm, "collectives_suite.py", ntasks))


@pytest.mark.parametrize("ntasks", [2, 4])
@pytest.mark.parametrize("check", list(collectives_suite.CHECKS))
def test_collectives_under_srun(collectives_job, check, ntasks):
    result = collectives_job(ntasks)
    assert_check_passed(result, check)
    assert "Slurm and MPI disagree" not in result.output, result.describe()


def test_uncaught_exception_aborts_the_srun_job(slurm):
    result = run_srun(slurm, "faults_suite.py", 3, "raise", timeout=90)
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert "bagua_mpi rank 2: uncaught exception" in result.output, result.describe()
    assert "RuntimeError: deliberate failure on rank 2" in result.output


def test_stalled_collective_aborts_the_srun_job(slurm):
    result = run_srun(slurm, "faults_suite.py", 3, "stall", timeout=90,
                      env={"BAGUA_MPI_STALL_WARNING_S": "0.5", "BAGUA_MPI_STALL_ABORT_S": "3"})
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert re.search(r"rank [12]: allreduce\(Sum, float32, \(7,\)\) has waited 3\.\d s",
                     result.output), result.describe()


def test_srun_without_an_mpi_plugin_is_refused_by_name(slurm):
    """srun --mpi=none (Slurm's default MpiDefault) makes each task an MPI job of one rank:
    init raises on every task, naming the step's task count and the plugin to use, instead of
    letting each train alone."""
    result = run_job(["srun", "--ntasks=2", "--mpi=none", sys.executable, "-c",
                      "import bagua_mpi as bm; bm.init()"], slurm_env(slurm), 120)
    assert not result.timed_out and result.returncode != 0, result.describe()
    for task in (0, 1):
        assert (f"bagua_mpi.init() on Slurm task SLURM_PROCID={task}: MPI sees a job of 1 rank, "
                f"but SLURM_STEP_NUM_TASKS=2") in result.output, result.describe()
    assert "Launch with srun --mpi=pmi2" in result.output, result.describe()


def test_mismatch_under_srun(slurm):
    assert_mpi_ok(run_srun(slurm, "faults_suite.py", 3, "mismatch", timeout=90),
                  "mismatch OK on 3 ranks")
