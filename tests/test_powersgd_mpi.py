"""PowerSGD (primitive and algorithm) under a real mpiexec, at 1 to 4 ranks (see
tests/mpi/powersgd_suite.py); each check is its own test."""
import pytest

from mpi_harness import assert_check_passed, suite_job

import powersgd_suite

suite_run = suite_job("powersgd_suite.py")


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.parametrize("check", list(powersgd_suite.suite_checks()))
def test_powersgd(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)
