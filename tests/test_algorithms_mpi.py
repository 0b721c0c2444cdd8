"""BAGUA's primitives and algorithms under a real mpiexec at 2, 3 and 4 ranks."""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_primitives_against_simulation(nprocs):
    assert_mpi_ok(run_mpi("primitives_suite.py", nprocs, timeout=300),
                  f"primitives suite OK on {nprocs} ranks")


def test_hierarchical_primitives_on_two_simulated_nodes():
    assert_mpi_ok(run_mpi("primitives_suite.py", 4, env={"BAGUA_MPI_RANKS_PER_NODE": "2"},
                          timeout=300), "primitives suite OK on 4 ranks")


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_algorithms_train_reach_consensus_and_save_bytes(nprocs):
    assert_mpi_ok(run_mpi("algorithms_suite.py", nprocs, timeout=600),
                  f"algorithms suite OK on {nprocs} ranks")


def test_hierarchical_algorithms_on_two_simulated_nodes():
    assert_mpi_ok(run_mpi("algorithms_suite.py", 4, "--hierarchical", timeout=300,
                          env={"BAGUA_MPI_RANKS_PER_NODE": "2"}),
                  "hierarchical algorithms OK on 4 ranks")
