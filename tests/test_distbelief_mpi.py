"""DistBelief (Downpour SGD, Sandblaster L-BFGS) under a real mpiexec (mpi/distbelief_suite.py).

World sizes: the smallest that exercise each behaviour (one shard + one worker, two shards,
several workers), kept to at most 6 ranks because the machine has 2 cores. Every check inside
the suite counts or compares results; nothing asserts a duration.
"""
import pytest

from mpi_harness import assert_in_output, assert_mpi_ok, jobs_of_modes, run_mpi

SUITE = "distbelief_suite.py"

# The modes that end normally share one job per world size (starting the ranks is most of a
# small job's time here).
SHARED_JOBS = {2: ["exact:1"],
               3: ["exact:2", "checkpoint:2", "lbfgs:1"],
               4: ["convex:1", "convex:2", "lbfgs:2", "silent"]}


@pytest.fixture(scope="module")
def shared_job():
    return jobs_of_modes(SUITE, SHARED_JOBS)


@pytest.mark.parametrize("nprocs,n_servers", [(2, 1), (3, 2)])
def test_downpour_one_worker_equals_sequential_adagrad_and_sgd(nprocs, n_servers, shared_job):
    assert_in_output(shared_job(nprocs), f"exact OK: {n_servers} shard(s), Adagrad and SGD "
                                         f"bitwise equal, resume exact on {nprocs} ranks")


def test_downpour_shard_state_resumes_exactly_through_an_hdf5_checkpoint(shared_job):
    pytest.importorskip("bagua_mpi.checkpoint")
    assert_in_output(shared_job(3), "checkpoint OK: 2 shard state(s) through HDF5, resume "
                                    "bitwise equal")


def test_downpour_several_workers_reach_the_stated_loss(shared_job):
    """4 ranks: 1 shard + 3 workers, then 2 shards + 2 workers (one partial)."""
    result = shared_job(4)
    assert_in_output(result, "convex OK: 1 shard(s), 3 workers on 4 ranks")
    assert_in_output(result, "convex OK: 2 shard(s), 2 workers on 4 ranks")


def test_every_shared_job_ends_cleanly(shared_job):
    """Each job of the modes above exits 0 once its modes are done."""
    for nprocs in SHARED_JOBS:
        assert_mpi_ok(shared_job(nprocs))


def test_downpour_slow_early_and_failing_workers_do_not_stop_the_others():
    result = run_mpi(SUITE, 5, "robust", timeout=90)
    assert_mpi_ok(result, "robust OK")
    assert "RuntimeError: deliberate failure in worker 3's step function" in result.output


def test_downpour_silent_worker_is_declared_lost(shared_job):
    result = shared_job(4)
    assert_in_output(result, "silent OK")
    assert_in_output(result, "declared lost")


def test_a_dead_worker_process_ends_the_whole_job():
    """What does not survive: a process that dies. mpiexec kills the job (no hang)."""
    result = run_mpi(SUITE, 3, "die", timeout=60)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert "UNEXPECTED" not in result.output, result.describe()


@pytest.mark.parametrize("nprocs,n_servers", [(3, 1), (4, 2)])
def test_sandblaster_reaches_the_scipy_optimum_and_resumes(nprocs, n_servers, shared_job):
    assert_in_output(shared_job(nprocs), f"lbfgs OK: {n_servers} shard(s), optimum of scipy "
                                         f"L-BFGS-B reached")


def test_sandblaster_straggler_slow_and_failing_workers():
    result = run_mpi(SUITE, 6, "stall", timeout=120)
    assert_mpi_ok(result, "stall OK: every batch completed, fast worker did more")
