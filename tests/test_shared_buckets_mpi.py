"""Node-shared gradient buckets under a real mpiexec, one test per check and world layout."""
import pytest

from mpi_harness import assert_check_passed, suite_job

import shared_buckets_suite

LAYOUTS = {"2 ranks": (2, None), "3 ranks": (3, None), "4 ranks": (4, None),
           "4 ranks as 2 nodes": (4, "2")}
RUNS = {name: suite_job("shared_buckets_suite.py",
                        env={"BAGUA_MPI_RANKS_PER_NODE": per_node} if per_node else None)
        for name, (_, per_node) in LAYOUTS.items()}


def layout_run(name):
    return RUNS[name](LAYOUTS[name][0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("check", list(shared_buckets_suite.CHECKS))
def test_shared_buckets(check, layout):
    assert_check_passed(layout_run(layout), check)
