"""Loss scaling (torch.amp.GradScaler) with DistributedOptimizer under a real mpiexec (see
tests/mpi/amp_suite.py): both recipes, an inf or NaN batch on one rank, every algorithm that
exchanges gradients, ZeRO stages 1 and 2 (an overflow in one rank's slice only), at 1-3 ranks;
each check is its own test."""
import pytest

from mpi_harness import assert_check_passed, library_algorithms, run_mpi, suite_job

import amp_suite

suite_run = suite_job("amp_suite.py")


@pytest.mark.parametrize("nprocs", [1, 2, 3])
@pytest.mark.parametrize("check", list(amp_suite.suite_checks()))
def test_amp(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)


def model_averaging_algorithms() -> list[str]:
    import bagua_mpi as bm
    return [n for n in sorted(library_algorithms()) if bm.algorithms.create(n).averages_models]


@pytest.mark.parametrize("name", model_averaging_algorithms())
def test_model_averaging_step_skipped_on_one_rank_ends_the_job(name):
    """Their gradients stay local, so a scaler skips the bad step on the last rank alone: its
    next backward pass raises MisuseError naming the rank and the algorithm, and the job ends
    at once (the other rank hung in its exchange, or MPI failed on mismatched messages)."""
    result = run_mpi("amp_suite.py", 2, "--model-averaging-skip", name, timeout=120)
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert ("MisuseError: rank 1: parameter" in result.output
            and f"{name} averages the models in step()" in result.output), result.describe()
