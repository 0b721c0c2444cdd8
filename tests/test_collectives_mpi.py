"""Multi-rank suites under a real mpiexec at several world sizes (see tests/mpi/)."""
import functools
import re

import pytest

from mpi_harness import assert_check_passed, assert_mpi_ok, run_mpi, suite_job

import async_suite
import collectives_suite
import topology_suite

# basics_suite's checks and the world sizes each runs at; a job per world size runs all of its
# checks (each rank's start, torch's import mostly, is much of a small job's time here)
COLLECTIVES_SIZES, ASYNC_SIZES = [1, 2, 3, 4], [2, 3, 4]
BASICS = {**{f"collectives-{c}": COLLECTIVES_SIZES for c in collectives_suite.CHECKS},
          **{f"async-{c}": ASYNC_SIZES for c in async_suite.CHECKS},
          "mismatch": [2, 3, 4], "bad-args": [1, 3], "nested": [3], "sync-twice": [3]}


@pytest.fixture(scope="module")
def basics_job():
    @functools.cache
    def run(nprocs):
        checks = [name for name, sizes in BASICS.items() if nprocs in sizes]
        return run_mpi("basics_suite.py", nprocs,
                       *[arg for name in checks for arg in ("--check", name)], timeout=300)
    return run


@pytest.mark.parametrize("nprocs", COLLECTIVES_SIZES)
@pytest.mark.parametrize("check", list(collectives_suite.CHECKS))
def test_collectives_against_numpy_simulation(check, nprocs, basics_job):
    assert_check_passed(basics_job(nprocs), f"collectives-{check}")


hierarchical_job = suite_job("collectives_suite.py", env={"BAGUA_MPI_HIERARCHICAL": "1",
                                                          "BAGUA_MPI_RANKS_PER_NODE": "2"})


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("check", list(collectives_suite.CHECKS))
def test_collectives_hierarchical_default_on_two_simulated_nodes(check, nprocs):
    assert_check_passed(hierarchical_job(nprocs), check)


@functools.cache
def topology_job(nprocs, per_node):
    return run_mpi("topology_suite.py", nprocs, env={"BAGUA_MPI_RANKS_PER_NODE": str(per_node)})


@pytest.mark.parametrize("nprocs,per_node", [(4, 2), (3, 2), (4, 1)])
@pytest.mark.parametrize("check", list(topology_suite.CHECKS))
def test_topology_and_hierarchical_vs_flat(check, nprocs, per_node):
    assert_check_passed(topology_job(nprocs, per_node), check)


@pytest.mark.parametrize("nprocs", ASYNC_SIZES)
@pytest.mark.parametrize("check", list(async_suite.CHECKS))
def test_async_handles(check, nprocs, basics_job):
    assert_check_passed(basics_job(nprocs), f"async-{check}")


@pytest.mark.parametrize("nprocs", BASICS["mismatch"])
def test_mismatch_raises_on_every_rank(nprocs, basics_job):
    assert_check_passed(basics_job(nprocs), "mismatch")


@pytest.mark.parametrize("nprocs", BASICS["bad-args"])
def test_bad_arguments_raise_at_once(nprocs, basics_job):
    assert_check_passed(basics_job(nprocs), "bad-args")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_uncaught_exception_on_one_rank_aborts_the_job(nprocs):
    result = run_mpi("faults_suite.py", nprocs, "raise", timeout=45)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert f"bagua_mpi rank {nprocs - 1}: uncaught exception" in result.output, result.describe()
    assert f"RuntimeError: deliberate failure on rank {nprocs - 1}" in result.output


def test_killed_rank_ends_the_job():
    result = run_mpi("faults_suite.py", 3, "die", timeout=45)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()


def test_stall_watchdog_warns_then_aborts():
    result = run_mpi("faults_suite.py", 3, "stall", timeout=45,
                     env={"BAGUA_MPI_STALL_WARNING_S": "0.5", "BAGUA_MPI_STALL_ABORT_S": "4"})
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert re.search(r"rank [12]: allreduce\(Sum, float32, \(7,\)\) has waited 0\.\d s",
                     result.output), result.describe()
    assert "another rank never joined it. Aborting the job." in result.output, result.describe()


@pytest.mark.parametrize("thread_level", ["serialized", "multiple"])
def test_an_operation_still_running_at_shutdown_is_named(thread_level):
    """Rank 0 leaves an asynchronous allreduce the others never call and shuts down with a
    2 s timeout: it aborts the job naming the operation (code 124), where its shutdown went on
    to free the communicators under the running operation (a segmentation fault). Under
    THREAD_SERIALIZED the watchdog cannot ask whether peers left, so this is the only path."""
    result = run_mpi("faults_suite.py", 3, "pending", timeout=90,
                     env={"MPI4PY_RC_THREAD_LEVEL": thread_level,
                          "BAGUA_MPI_STALL_ABORT_S": "300"})
    assert not result.timed_out and result.returncode == 124, result.describe()
    assert re.search(r"bagua_mpi rank 0: allreduce\(Average, float32, \(3,\)\) \[op #2 here\] "
                     r"still runs \d+ s after shutdown began waiting for it; another rank never "
                     r"joined it", result.output), result.describe()


# -- misuse guards: a rank that leaves or fails ends the job promptly, with its message ----------
# (mode, expected exit code or None for "non-zero", lines the output must contain). Three ranks;
# "rank 2" is the last one. The default stall watchdog (600 s) is far beyond the time limits
# below, so passing proves the prompt path, not the watchdog.
JOIN_HINT = "or call bagua_mpi.join() on every rank after its loop"
LEAVING = {
    "sys.exit(3) on one rank": ("exit-code", 3, ["rank 2 exited with code 3 (sys.exit(3))"]),
    "last rank returns": ("return last", None, ["rank 2 reached the end of its program"]),
    "rank 0 returns": ("return 0", None, ["rank 0 reached the end of its program",
                                          "still waits in allreduce(Average, float32, (2,))",
                                          JOIN_HINT]),
    "uneven steps in training": ("uneven", None, [  # ranks 1 and 2 wait; either may abort first
        "rank 0 reached the end of its program, while rank ",
        "still waits in bucket(0, 24), which cannot complete without it", JOIN_HINT]),
    "exception in a user thread": ("thread", 1, [
        "bagua_mpi rank 2: uncaught exception in thread 'data-loader', aborting the job",
        "ValueError: deliberate failure in a worker thread of rank 2"]),
    # a rank that never arrives (outside any collective) is named once the exit timeout passes
    "exit timeout names the late rank": ("late last", 124, [
        "rank 0 reached the end of its program, but rank(s) 2 did not reach shutdown within "
        "3 s (BAGUA_MPI_EXIT_TIMEOUT_S)"]),
    "exit timeout, rank 0 late": ("late 0", 124, [
        "but rank 0 did not reach shutdown within 3 s (BAGUA_MPI_EXIT_TIMEOUT_S)"]),
}
# only for the "late" cases: shorter than the 5 s grace, it would pre-empt the others' message
LATE_ENV = {"BAGUA_MPI_EXIT_TIMEOUT_S": "3"}
# From the moment the rank leaves to the end of the job: the 5 s grace, a watchdog tick, the
# 0.5 s of last words and mpiexec's teardown, with room for a loaded 2-core machine.
LEAVE_BOUND_S = 25.0


@pytest.mark.parametrize("case", list(LEAVING))
def test_a_leaving_or_failing_rank_ends_the_job_promptly(case):
    import time

    mode, code, needles = LEAVING[case]
    result = run_mpi("faults_suite.py", 3, *mode.split(), timeout=120,
                     env=LATE_ENV if mode.startswith("late") else None)
    ended = time.time()
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    if code is not None:
        assert result.returncode == code, result.describe()
    for needle in needles:
        assert needle in result.output, f"{needle!r} missing; {result.describe()}"
    left = re.search(r"rank \d (?:calls sys.exit\(3\)|returns|sleeps) at (\d+\.\d+)",
                     result.output)
    if left:
        assert ended - float(left.group(1)) < LEAVE_BOUND_S, result.describe()


@pytest.mark.parametrize("mode", ["nested", "sync-twice"])
def test_misuse_that_must_not_abort(mode, basics_job):
    """A nested async call raises NestedAsyncError (no deadlock), and synchronize twice is
    safe; the library keeps working after either."""
    assert_check_passed(basics_job(3), mode)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_uneven_steps_end_cleanly_with_join(nprocs):
    """What the hint above advises works: the same uneven loops, then join() on every rank."""
    result = run_mpi("faults_suite.py", nprocs, "uneven-joined", timeout=120)
    assert_mpi_ok(result)
    for r in range(nprocs):
        assert f"uneven-joined OK on rank {r}" in result.output, result.describe()


def test_ranks_that_finish_seconds_apart_exit_cleanly():
    assert_mpi_ok(run_mpi("faults_suite.py", 3, "skew", timeout=120), "skew OK on 3 ranks")
