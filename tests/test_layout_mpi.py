"""Parameters laid out channels_last under a real mpiexec (see tests/mpi/layout_suite.py):
every registered algorithm against a row-major twin holding the same elements in the same
order, gradient_allreduce against one process, ZeRO's state, and the refusals; each check is
its own test, at 1-3 ranks."""
import pytest

from mpi_harness import assert_check_passed, suite_job

import layout_suite

suite_run = suite_job("layout_suite.py")


@pytest.mark.parametrize("nprocs", [1, 2, 3])
@pytest.mark.parametrize("check", list(layout_suite.suite_checks()))
def test_layout(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)
