"""Loss scaling (torch.amp.GradScaler) with DistributedOptimizer under a real mpiexec (see
tests/mpi/amp_suite.py): both recipes, an inf or NaN batch on one rank, every algorithm that
exchanges gradients, at 1-3 ranks; each check is its own test."""
import pytest

from mpi_harness import assert_check_passed, run_mpi

import amp_suite

_RUNS = {}


def suite_run(nprocs: int):
    if nprocs not in _RUNS:
        _RUNS[nprocs] = run_mpi("amp_suite.py", nprocs, timeout=300)
    return _RUNS[nprocs]


@pytest.mark.parametrize("nprocs", [1, 2, 3])
@pytest.mark.parametrize("check", list(amp_suite.suite_checks()))
def test_amp(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)
