"""DistBelief model parallelism under a real mpiexec (mpi/model_parallel_suite.py).

Partitioned forward/backward against the unpartitioned torch model at 2, 3 and 4 partitions;
Downpour and Sandblaster over partitioned replicas with parameter-server shards. World sizes
are at most 6 ranks (the machine has 2 cores); most of each job's time is starting the ranks.
"""
import pytest

from mpi_harness import assert_in_output, assert_mpi_ok, jobs_of_modes, run_mpi

SUITE = "model_parallel_suite.py"

# The modes that end normally share one job per world size (starting the ranks is most of
# each job's time).
# forward/bad: partitions = ranks; exact:S: 1 replica + S shards; convex/sandblaster:2:S: replicas
# of 2 partitions + S shards.
SHARED_JOBS = {2: ["forward", "bad"],
               3: ["forward"],
               4: ["forward", "bad", "exact:1", "exact:2"],
               5: ["convex:2:1", "sandblaster:2:2"],
               6: ["convex:2:2", "sandblaster:2:1"]}


@pytest.fixture(scope="module")
def shared_job():
    return jobs_of_modes(SUITE, SHARED_JOBS)


@pytest.mark.parametrize("partitions", [2, 3, 4])
def test_partitioned_forward_backward_equals_the_unpartitioned_model(partitions, shared_job):
    """At 2 and 4 partitions the bad cuts are checked as well."""
    result = shared_job(partitions)
    assert_in_output(result, f"forward OK: pipeline, locally connected and fully connected at "
                             f"{partitions} partitions (even and uneven)")
    if partitions != 3:
        assert_in_output(result, "bad OK: PartitionError for uncovered units")


def test_downpour_one_partitioned_replica_equals_sequential_adagrad(shared_job):
    """4 ranks: 1 replica x 3 partitions + 1 shard, then 1 replica x 2 partitions + 2 shards."""
    result = shared_job(4)
    assert_in_output(result, "exact OK: 1 replica x 3 partitions, 1 shard(s), bitwise equal "
                             "to sequential Adagrad")
    assert_in_output(result, "exact OK: 1 replica x 2 partitions, 2 shard(s), bitwise equal")


@pytest.mark.parametrize("nprocs,n_servers", [(5, 1), (6, 2)])
def test_downpour_replicas_of_partitions_reach_the_optimum_talking_only_to_their_shards(
        nprocs, n_servers, shared_job):
    result = shared_job(nprocs)
    assert_in_output(result, f"convex OK: 2 replicas x 2 partitions, {n_servers} shards")
    assert_in_output(result, "traffic only to own shards")


@pytest.mark.parametrize("nprocs,n_servers", [(6, 1), (5, 2)])
def test_sandblaster_with_partitioned_replicas_reaches_the_optimum(nprocs, n_servers,
                                                                    shared_job):
    replicas = (nprocs - 1 - n_servers) // 2
    assert_in_output(shared_job(nprocs), f"sandblaster OK: {replicas} replicas x 2 "
                                         f"partitions, {n_servers} shards")


def test_every_shared_job_ends_cleanly(shared_job):
    """Each job of the modes above exits 0 once its modes are done."""
    for nprocs in SHARED_JOBS:
        assert_mpi_ok(shared_job(nprocs))


def test_a_failing_partition_ends_the_job_instead_of_hanging():
    result = run_mpi(SUITE, 3, "fail", timeout=90)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert "deliberate failure in partition 1" in result.output, result.describe()
    assert "UNEXPECTED" not in result.output, result.describe()
