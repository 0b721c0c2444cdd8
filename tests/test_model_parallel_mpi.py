"""DistBelief model parallelism under a real mpiexec (mpi/model_parallel_suite.py).

Partitioned forward/backward against the unpartitioned torch model at 2, 3 and 4 partitions;
Downpour and Sandblaster over partitioned replicas with parameter-server shards. World sizes
are at most 6 ranks (the machine has 2 cores); most of each job's time is starting the ranks.
"""
import pytest

from mpi_harness import assert_mpi_ok, run_mpi

SUITE = "model_parallel_suite.py"


@pytest.mark.parametrize("partitions", [2, 3, 4])
def test_partitioned_forward_backward_equals_the_unpartitioned_model(partitions):
    """One job per partition count; at 2 and 4 the bad cuts are checked in the same job."""
    modes = ["forward", "bad"] if partitions != 3 else ["forward"]
    result = run_mpi(SUITE, partitions, *modes, timeout=120)
    assert_mpi_ok(result, f"forward OK: pipeline, locally connected and fully connected at "
                          f"{partitions} partitions (even and uneven)")
    if partitions != 3:
        assert "bad OK: PartitionError for uncovered units" in result.output, result.describe()


def test_downpour_one_partitioned_replica_equals_sequential_adagrad():
    """4 ranks: 1 replica x 3 partitions + 1 shard, then 1 replica x 2 partitions + 2 shards."""
    result = run_mpi(SUITE, 4, "exact:1", "exact:2", timeout=90)
    assert_mpi_ok(result, "exact OK: 1 replica x 3 partitions, 1 shard(s), bitwise equal to "
                          "sequential Adagrad")
    assert "exact OK: 1 replica x 2 partitions, 2 shard(s), bitwise equal" in result.output, \
        result.describe()


@pytest.mark.parametrize("nprocs,n_servers", [(5, 1), (6, 2)])
def test_downpour_replicas_of_partitions_reach_the_optimum_talking_only_to_their_shards(
        nprocs, n_servers):
    result = run_mpi(SUITE, nprocs, "convex", "2", str(n_servers), timeout=120)
    assert_mpi_ok(result, f"convex OK: 2 replicas x 2 partitions, {n_servers} shards")
    assert "traffic only to own shards" in result.output


@pytest.mark.parametrize("nprocs,n_servers", [(6, 1), (5, 2)])
def test_sandblaster_with_partitioned_replicas_reaches_the_optimum(nprocs, n_servers):
    result = run_mpi(SUITE, nprocs, "sandblaster", "2", str(n_servers), timeout=120)
    replicas = (nprocs - 1 - n_servers) // 2
    assert_mpi_ok(result, f"sandblaster OK: {replicas} replicas x 2 partitions, {n_servers} "
                          f"shards")


def test_a_failing_partition_ends_the_job_instead_of_hanging():
    result = run_mpi(SUITE, 3, "fail", timeout=90)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert "deliberate failure in partition 1" in result.output, result.describe()
    assert "UNEXPECTED" not in result.output, result.describe()
