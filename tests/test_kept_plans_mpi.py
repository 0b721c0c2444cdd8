"""Exchange plans kept across steps, under a real mpiexec (see tests/mpi/kept_plans_suite.py);
each check is its own test, at 1-3 ranks."""
import pytest

from mpi_harness import assert_check_passed, suite_job

import kept_plans_suite

suite_run = suite_job("kept_plans_suite.py")


@pytest.mark.parametrize("nprocs", [1, 2, 3])
@pytest.mark.parametrize("check", list(kept_plans_suite.suite_checks()))
def test_kept_plans(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)
