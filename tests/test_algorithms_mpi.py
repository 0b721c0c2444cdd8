"""BAGUA's primitives and every registered algorithm under a real mpiexec at 2, 3 and 4 ranks.

The algorithm suite runs once per world size (``suite_job``) and reports each of its checks
on its own line; every check is its own test here, so one failure hides no other.
"""
import pytest

import bagua_mpi as bm
from mpi_harness import assert_check_passed, library_algorithms, suite_job

import algorithms_suite
import primitives_suite


primitives_run = suite_job("primitives_suite.py")
two_node_primitives_run = suite_job("primitives_suite.py", env={"BAGUA_MPI_RANKS_PER_NODE": "2"})


@pytest.mark.parametrize("nprocs", [2, 3, 4])
@pytest.mark.parametrize("check", list(primitives_suite.suite_checks()))
def test_primitives_against_simulation(check, nprocs):
    assert_check_passed(primitives_run(nprocs), check)


@pytest.mark.parametrize("check", list(primitives_suite.suite_checks()))
def test_primitives_on_two_simulated_nodes(check):
    assert_check_passed(two_node_primitives_run(4), check)


suite_run = suite_job("algorithms_suite.py", timeout=900)
hierarchical_run = suite_job("algorithms_suite.py", "--hierarchical",
                             env={"BAGUA_MPI_RANKS_PER_NODE": "2"}, timeout=900)


CHECKS = list(algorithms_suite.suite_checks(hierarchical=False))
HIERARCHICAL_CHECKS = list(algorithms_suite.suite_checks(hierarchical=True))


def test_every_registered_algorithm_is_configured():
    configured = {bm.algorithms.create(a).name for a, _, _ in algorithms_suite.CONFIGS.values()}
    assert library_algorithms() <= configured


@pytest.mark.parametrize("nprocs", [2, 3, 4])
@pytest.mark.parametrize("check", CHECKS)
def test_algorithm(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)


@pytest.mark.parametrize("check", HIERARCHICAL_CHECKS)
def test_hierarchical_algorithm_on_two_simulated_nodes(check):
    assert_check_passed(hierarchical_run(4), check)
