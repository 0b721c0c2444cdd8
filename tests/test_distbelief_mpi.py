"""DistBelief (Downpour SGD, Sandblaster L-BFGS) under a real mpiexec (mpi/distbelief_suite.py).

World sizes: the smallest that exercise each behaviour (one shard + one worker, two shards,
several workers), kept to at most 6 ranks because the machine has 2 cores. Every check inside
the suite counts or compares results; nothing asserts a duration.
"""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi

SUITE = "distbelief_suite.py"


@pytest.mark.parametrize("nprocs,n_servers", [(2, 1), (3, 2)])
def test_downpour_one_worker_equals_sequential_adagrad_and_sgd(nprocs, n_servers):
    result = run_mpi(SUITE, nprocs, "exact", str(n_servers), timeout=90)
    assert_mpi_ok(result, f"exact OK: {n_servers} shard(s), Adagrad and SGD bitwise equal, "
                          f"resume exact on {nprocs} ranks")


def test_downpour_shard_state_resumes_exactly_through_an_hdf5_checkpoint():
    pytest.importorskip("bagua_mpi.checkpoint")
    result = run_mpi(SUITE, 3, "checkpoint", "2", timeout=90)
    assert_mpi_ok(result, "checkpoint OK: 2 shard state(s) through HDF5, resume bitwise equal")


def test_downpour_several_workers_reach_the_stated_loss():
    """One job of 4 ranks: 1 shard + 3 workers, then 2 shards + 2 workers (one partial)."""
    result = run_mpi(SUITE, 4, "convex:1", "convex:2", timeout=120)
    assert_mpi_ok(result, "convex OK: 1 shard(s), 3 workers on 4 ranks")
    assert "convex OK: 2 shard(s), 2 workers on 4 ranks" in result.output, result.describe()


def test_downpour_slow_early_and_failing_workers_do_not_stop_the_others():
    result = run_mpi(SUITE, 5, "robust", timeout=90)
    assert_mpi_ok(result, "robust OK")
    assert "RuntimeError: deliberate failure in worker 3's step function" in result.output


def test_downpour_silent_worker_is_declared_lost():
    result = run_mpi(SUITE, 4, "silent", timeout=90)
    assert_mpi_ok(result, "silent OK")
    assert "declared lost" in result.output, result.describe()


def test_a_dead_worker_process_ends_the_whole_job():
    """What does not survive: a process that dies. mpiexec kills the job (no hang)."""
    result = run_mpi(SUITE, 3, "die", timeout=60)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert "UNEXPECTED" not in result.output, result.describe()


@pytest.mark.parametrize("nprocs,n_servers", [(3, 1), (4, 2)])
def test_sandblaster_reaches_the_scipy_optimum_and_resumes(nprocs, n_servers):
    result = run_mpi(SUITE, nprocs, "lbfgs", str(n_servers), timeout=90)
    assert_mpi_ok(result, f"lbfgs OK: {n_servers} shard(s), optimum of scipy L-BFGS-B reached")


def test_sandblaster_straggler_slow_and_failing_workers():
    result = run_mpi(SUITE, 6, "stall", timeout=120)
    assert_mpi_ok(result, "stall OK: every batch completed, fast worker did more")
