"""ZeRO stages 1 and 2 under a real mpiexec (see tests/mpi/zero_suite.py).

The suite runs once per world size (cached) and each of its checks is its own test. The
checkpoint chain crosses world sizes and stages (2 ranks stage 2 -> 3 ranks unsharded -> 2
ranks stage 1) and must stay on the uninterrupted single-process trajectory to 1e-6.
"""
import re

import pytest

from mpi_harness import assert_check_passed, assert_mpi_ok, run_mpi, suite_job

import zero_suite

# simulated nodes of 2 ranks: 4 ranks are two nodes (two-level sharding), 3 are uneven
suite_run = suite_job("zero_suite.py", env={"BAGUA_MPI_RANKS_PER_NODE": "2"}, timeout=400)


@pytest.mark.parametrize("nprocs", [2, 3, 4])
@pytest.mark.parametrize("check", list(zero_suite.suite_checks()))
def test_zero(check, nprocs):
    assert_check_passed(suite_run(nprocs), check)


def phase(nprocs: int, *args: str) -> tuple[float, str]:
    result = run_mpi("zero_suite.py", nprocs, "--phase", "checkpoint", *args, timeout=200)
    assert_mpi_ok(result)
    found = re.search(r"^PHASE .* max_rel_diff=([0-9.e+-]+)$", result.output, re.M)
    assert found, result.describe()
    return float(found.group(1)), result.output


def test_checkpoints_cross_world_sizes_and_stages(tmp_path):
    """Sharded -> unsharded -> sharded, 2 -> 3 -> 2 ranks: the logical optimizer state
    reshards and training continues on the uninterrupted trajectory (float64, 1e-6)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    diffs = [phase(2, "--stage", "2", "--save", a, "--last", "3")[0],
             phase(3, "--stage", "0", "--load", a, "--save", b, "--last", "6")[0],
             phase(2, "--stage", "1", "--load", b, "--last", "9")[0]]
    assert max(diffs) < 1e-6, diffs


def test_error_feedback_of_another_partition_is_reset_with_a_warning(tmp_path):
    """Compressed stage 2 saved at 2 ranks loads at 3: the error feedback (per-rank, of the old
    partition) is reset with a warning naming it; model and optimizer state load."""
    a = str(tmp_path / "a")
    phase(2, "--stage", "2", "--algorithm", "qsgd", "--error-feedback", "--save", a, "--last", "3")
    _, out = phase(3, "--stage", "2", "--algorithm", "qsgd", "--error-feedback", "--load", a,
                   "--last", "5")
    assert re.search(r"per-rank state of algorithm 'qsgd' \(worker_error\) .* was reset",
                     out), out
    assert "steps=3-5" in out, out  # the step count went on from the checkpoint
