"""Horovod details (issue 24, items 3-6) at 2-4 ranks under a real mpiexec, each check against an
independent oracle (tests/mpi/horovod_details_suite.py): process-set optimizers on ranks outside
the set, generated names and frozen parameters, integer/float16 scaling in reducescatter, names
of operations in flight."""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi

CHECKS = {"psopt": ["psopt_named", "psopt_unnamed"],
          "optdetails": ["optimizer_names", "broadcast_optimizer_state_frozen"],
          "rsint": ["reducescatter_scaling"],
          "names": ["names_all_reuse", "names_one_rank_reuses", "names_distinct"]}


@pytest.mark.parametrize("mode", sorted(CHECKS))
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_horovod_details(mode, nprocs):
    result = run_mpi("horovod_details_suite.py", nprocs, mode, timeout=120)
    assert_mpi_ok(result, f"horovod details {mode} OK on {nprocs} ranks")
    for check in CHECKS[mode]:
        assert f"details {check} OK on {nprocs} ranks" in result.output, result.describe()
