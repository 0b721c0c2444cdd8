"""DistributedOptimizer and the engine under a real mpiexec (see tests/mpi/optimizer_suite.py)."""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_distributed_training_equals_single_process(nprocs):
    # two simulated nodes of 2 ranks, so the hierarchical configurations really are two-level
    result = run_mpi("optimizer_suite.py", nprocs, env={"BAGUA_MPI_RANKS_PER_NODE": "2"},
                     timeout=300)
    assert_mpi_ok(result, f"optimizer suite OK on {nprocs} ranks")
