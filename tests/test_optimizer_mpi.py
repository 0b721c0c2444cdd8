"""DistributedOptimizer and the engine under a real mpiexec (see tests/mpi/optimizer_suite.py).

The suite runs once per world size (cached below) and reports each of its checks on its own
line (tests/mpi/checks.py); every check is its own test here, so one failure hides no other.
"""
import pytest

from mpi_harness import assert_check_passed, run_mpi, suite_job

import optimizer_suite

# two simulated nodes of 2 ranks, so the hierarchical configurations really are two-level
suite_run = suite_job("optimizer_suite.py", env={"BAGUA_MPI_RANKS_PER_NODE": "2"})


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.parametrize("check", list(optimizer_suite.suite_checks()))
def test_optimizer(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)


@pytest.mark.parametrize("nprocs", [2, 3, 4])
@pytest.mark.parametrize("name", optimizer_suite.RING_CHECKED)
def test_ring_neighbours_with_differing_hyperparameters_end_the_job(name, nprocs):
    """The last rank's learning rate halves after step 1 (``faults_suite.py lr``). Before the
    models are averaged at step 2, that rank and its ring neighbours raise ``MismatchError``
    naming the values; uncaught, it ends the job (at 4 ranks rank 1, next to neither, learns
    of it through the abort). No rank finishes step 2."""
    last = nprocs - 1
    neighbours = {2: "rank 0", 3: "ranks 0-1", 4: "ranks 0,2"}[nprocs]
    result = run_mpi("faults_suite.py", nprocs, "lr", name, timeout=90)
    assert not result.timed_out and result.returncode != 0, result.describe()
    for needle in (f"rank {last}: the wrapped optimizer's hyperparameters differ from those of "
                   f"its ring neighbour{'s' if nprocs > 2 else ''} ({neighbours}) at step 2 "
                   "(checked before the models are averaged; the last local step used them)",
                   f"param group 0 'lr': 0.01 on rank {last - 1}; 0.005 on rank {last}",
                   f"rank {last} stepped 1"):
        assert needle in result.output, f"{needle!r} missing; {result.describe()}"
    assert "stepped 2" not in result.output, result.describe()
