"""L-GreCo under a real mpiexec (see tests/mpi/lgreco_suite.py); each check is its own test,
at 2 and 4 ranks."""
import pytest

from mpi_harness import assert_check_passed, suite_job

import lgreco_suite

suite_run = suite_job("lgreco_suite.py")


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("check", list(lgreco_suite.suite_checks()))
def test_lgreco(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)
