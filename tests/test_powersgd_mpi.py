"""PowerSGD (primitive and algorithm) under a real mpiexec, at 1 to 4 ranks."""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_powersgd_against_simulation_exact_cases_and_training(nprocs):
    assert_mpi_ok(run_mpi("powersgd_suite.py", nprocs, timeout=300),
                  f"powersgd suite OK on {nprocs} ranks")
