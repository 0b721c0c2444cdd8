"""L-GreCo under a real mpiexec (see tests/mpi/lgreco_suite.py)."""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi


@pytest.mark.parametrize("nprocs", [2, 4])
def test_lgreco_decisions_training_and_state(nprocs):
    assert_mpi_ok(run_mpi("lgreco_suite.py", nprocs, timeout=300),
                  f"lgreco suite OK on {nprocs} ranks")
