"""The communication log under a real mpiexec (``tests/mpi/comm_log_suite.py``,
``docs/comm_log.md``): exact counts and bytes, the straggler named, the table printed at shutdown
by rank 0 only, off by default, and its bus bandwidth against raw mpi4py's in the same job. Plus
the pieces without MPI: bytes from description tuples, bus factors, the straggler rule."""
import re

import pytest

from bagua_mpi import comm_log
from mpi_harness import assert_mpi_ok, run_mpi

ON = {"BAGUA_MPI_COMM_LOG": "1"}
TABLE_HEAD = "bagua_mpi communication log:"


def run_mode(mode: str, nprocs: int, env: dict | None = None):
    result = run_mpi("comm_log_suite.py", nprocs, mode, env=env, timeout=180)
    assert_mpi_ok(result)
    for rank in range(nprocs):
        assert f"OK {mode} rank {rank}" in result.output, result.describe()
    return result


@pytest.mark.parametrize("nprocs", [2, 3])
def test_counts_and_bytes_are_exact_and_rank_0_prints_at_shutdown(nprocs):
    result = run_mode("counts", nprocs, ON)
    assert result.output.count(TABLE_HEAD) == 1, result.describe()  # rank 0 only
    assert re.search(r"^bucket 0 +3 +\d+ ", result.output, re.M), result.describe()


@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_rank_that_arrives_late_is_named(nprocs):
    result = run_mode("straggler", nprocs, ON)
    (row,) = re.findall(r"STRAGGLER (allreduce .*)$", result.output, re.M)
    named = re.search(r" rank 1 +(\d+\.\d+) ms$", row)
    assert named, row  # the sleeper, with the spread
    spread_ms = float(named.group(1))
    assert spread_ms > 15, row  # most of the 30 ms sleep is the others' wait


def test_off_by_default_and_enabled_by_the_api():
    result = run_mode("api", 2)
    # printed once: by comm_log_summary() on rank 0; disabled before shutdown, so not again
    assert result.output.count(TABLE_HEAD) == 1, result.describe()


def test_busbw_matches_raw_mpi4py_on_the_same_size():
    result = run_mode("busbw", 2, ON)
    (log_bw, raw_bw), = re.findall(r"BUSBW log ([\d.]+) raw ([\d.]+) GB/s", result.output, re.M)
    ratio = float(log_bw) / float(raw_bw)
    assert 0.7 <= ratio <= 1.3, result.output  # loose: the test machine is shared and loaded


# -- without MPI ------------------------------------------------------------------------------

def test_bytes_come_from_the_description_tuples():
    assert comm_log.payload_bytes(("allreduce", "Sum", "float32", (10, 3)), 4) == 120
    assert comm_log.payload_bytes(("reducescatter", "Sum", "bfloat16", (8,)), 4) == 16
    assert comm_log.payload_bytes(("allgather", "int64", (2, 3)), 4) == 4 * 48
    assert comm_log.payload_bytes(("broadcast", 0, "uint8", (5,)), 4) == 5
    assert comm_log.payload_bytes(("alltoall", "float64", (4,)), 4) == 32
    assert comm_log.payload_bytes(("bucket", 2, 4096), 4) == 4096
    assert comm_log.payload_bytes(("grouped_allreduce", "Sum", 3), 4) is None
    assert comm_log.payload_bytes(("barrier",), 4) is None


def test_bus_factors_follow_nccl_tests():
    assert comm_log.bus_factor("allreduce", 4) == 1.5
    assert comm_log.bus_factor("bucket", 2) == 1.0
    assert comm_log.bus_factor("allgather", 4) == 0.75
    assert comm_log.bus_factor("reducescatter", 4) == 0.75
    assert comm_log.bus_factor("alltoall", 4) == 0.75
    assert comm_log.bus_factor("broadcast", 4) == 1.0


def test_the_straggler_is_the_rank_with_the_shortest_time():
    assert comm_log.straggler_of({0: 0.030, 1: 0.001, 2: 0.029}) == 1
    assert comm_log.straggler_of({0: 0.0100, 1: 0.0099}) is None  # within noise
    assert comm_log.straggler_of({0: 0.5}) is None


def test_the_log_counts_what_it_is_given_and_skips_its_own_markers():
    log = comm_log.CommLog(2)
    log.record(("allreduce", "Sum", "float32", (4,)), 1.0, 1.5)
    log.record(("allreduce", "Sum", "float32", (8,)), 2.0, 2.5)
    log.record(("bucket", 0, 64), 3.0, 3.25)
    log.record("drain", 0.0, 1.0)
    log.record(comm_log.SUMMARY_DESCRIBE, 0.0, 1.0)
    assert log.stats() == {"allreduce": {"calls": 2, "bytes": 48, "seconds": 1.0},
                           "bucket 0": {"calls": 1, "bytes": 64, "seconds": 0.25}}
    rows = comm_log.summary_rows(log, [log.mean_times(), {"allreduce": 0.1, "bucket 0": 0.25}])
    assert rows[0]["key"] == "allreduce" and rows[0]["straggler"] == 1
    assert rows[0]["algbw"] == pytest.approx(24 / 0.5)
    assert rows[0]["busbw"] == pytest.approx(24 / 0.5)  # 2(n-1)/n = 1 at n = 2
