"""Horovod details (issue 24, items 3-6) at 2-4 ranks under a real mpiexec, each check against an
independent oracle (tests/mpi/horovod_details_suite.py): process-set optimizers on ranks outside
the set, generated names and frozen parameters, integer/float16 scaling in reducescatter, names
of operations in flight."""
import functools

import pytest

from mpi_harness import assert_check_passed, run_mpi

CHECKS = {"psopt": ["psopt_named", "psopt_unnamed", "psopt_find_unused"],
          "optdetails": ["optimizer_names", "broadcast_optimizer_state_frozen"],
          "rsint": ["reducescatter_scaling"],
          "names": ["names_all_reuse", "names_one_rank_reuses", "names_distinct"]}


@pytest.fixture(scope="module")
def details_job():
    """Every mode in one job per world size (one interpreter start a rank instead of four)."""
    return functools.cache(lambda nprocs: run_mpi("horovod_details_suite.py", nprocs,
                                                  *sorted(CHECKS), timeout=240))


@pytest.mark.parametrize("mode", sorted(CHECKS))
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_horovod_details(mode, nprocs, details_job):
    result = details_job(nprocs)
    assert_check_passed(result, mode)
    for check in CHECKS[mode]:
        assert f"details {check} OK on {nprocs} ranks" in result.output, result.describe()
