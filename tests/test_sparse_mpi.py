"""Top-k and gTop-k under a real mpiexec, including world sizes that are not powers of two."""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi


@pytest.mark.parametrize("nprocs", [2, 3, 4, 5])
def test_sparse_allreduces_against_simulation_and_training(nprocs):
    assert_mpi_ok(run_mpi("sparse_suite.py", nprocs, timeout=300),
                  f"sparse suite OK on {nprocs} ranks")
