"""Multi-rank suites under a real mpiexec at several world sizes (see tests/mpi/)."""
import re

import pytest

from mpi_harness import assert_mpi_ok, run_mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_collectives_against_numpy_simulation(nprocs):
    result = run_mpi("collectives_suite.py", nprocs)
    assert_mpi_ok(result, f"collectives suite OK on {nprocs} ranks")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_collectives_hierarchical_default_on_two_simulated_nodes(nprocs):
    result = run_mpi("collectives_suite.py", nprocs,
                     env={"BAGUA_MPI_HIERARCHICAL": "1", "BAGUA_MPI_RANKS_PER_NODE": "2"})
    assert_mpi_ok(result, f"collectives suite OK on {nprocs} ranks")


@pytest.mark.parametrize("nprocs,per_node", [(4, 2), (3, 2), (4, 1)])
def test_topology_and_hierarchical_vs_flat(nprocs, per_node):
    result = run_mpi("topology_suite.py", nprocs,
                     env={"BAGUA_MPI_RANKS_PER_NODE": str(per_node)})
    assert_mpi_ok(result, f"topology suite OK on {nprocs} ranks, {per_node} per node")


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_async_handles(nprocs):
    assert_mpi_ok(run_mpi("async_suite.py", nprocs), f"async suite OK on {nprocs} ranks")


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_mismatch_raises_on_every_rank(nprocs):
    result = run_mpi("faults_suite.py", nprocs, "mismatch", timeout=60)
    assert_mpi_ok(result, f"mismatch OK on {nprocs} ranks")


@pytest.mark.parametrize("nprocs", [1, 3])
def test_bad_arguments_raise_at_once(nprocs):
    result = run_mpi("faults_suite.py", nprocs, "bad-args", timeout=60)
    assert_mpi_ok(result, f"bad-args OK on {nprocs} ranks")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_uncaught_exception_on_one_rank_aborts_the_job(nprocs):
    result = run_mpi("faults_suite.py", nprocs, "raise", timeout=45)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert f"bagua_mpi rank {nprocs - 1}: uncaught exception" in result.output, result.describe()
    assert f"RuntimeError: deliberate failure on rank {nprocs - 1}" in result.output


def test_killed_rank_ends_the_job():
    result = run_mpi("faults_suite.py", 3, "die", timeout=45)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()


def test_stall_watchdog_warns_then_aborts():
    result = run_mpi("faults_suite.py", 3, "stall", timeout=45,
                     env={"BAGUA_MPI_STALL_WARNING_S": "0.5", "BAGUA_MPI_STALL_ABORT_S": "4"})
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert re.search(r"rank [12]: allreduce\(Sum, float32, \(7,\)\) has waited 0\.\d s",
                     result.output), result.describe()
    assert "another rank never joined it. Aborting the job." in result.output, result.describe()
