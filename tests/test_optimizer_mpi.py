"""DistributedOptimizer and the engine under a real mpiexec (see tests/mpi/optimizer_suite.py).

The suite runs once per world size (cached below) and reports each of its checks on its own
line (tests/mpi/checks.py); every check is its own test here, so one failure hides no other.
"""
import pytest

from mpi_harness import assert_check_passed, suite_job

import optimizer_suite

# two simulated nodes of 2 ranks, so the hierarchical configurations really are two-level
suite_run = suite_job("optimizer_suite.py", env={"BAGUA_MPI_RANKS_PER_NODE": "2"})


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.parametrize("check", list(optimizer_suite.suite_checks()))
def test_optimizer(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)
