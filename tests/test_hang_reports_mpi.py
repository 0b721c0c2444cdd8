"""Hang reports name names: under a real mpiexec, a rank out of step at op #3 is named, with
the operation it is in or last finished, by every rank waiting in op #3; at the abort every rank
dumps its flight record (``tests/mpi/hang_suite.py``, ``docs/hangs.md``). Plus the pieces
without MPI: the ring buffer and the naming rules."""
import re
import threading
import time

import pytest

from bagua_mpi import flight_recorder as fr
from bagua_mpi.worker import CommWorker
from mpi_harness import run_mpi

CULPRIT = 1  # a middle rank at 4: the report must not just name the last one
THE_OP = "allreduce(Sum, float32, (7,))"  # what every other rank waits in, op #3
LAST_COMMON = "allreduce(Sum, float32, (2,)) [op #2]"
WARN_S, ABORT_S, SLEEP_S = 1.5, 4.5, 3.0  # the sleeper is warned about, never aborted
STALL_EXIT_CODE = 124


def run_case(mode: str, nprocs: int, hang_dir, *extra: str):
    env = {"BAGUA_MPI_STALL_WARNING_S": str(WARN_S), "BAGUA_MPI_STALL_ABORT_S": str(ABORT_S),
           "BAGUA_MPI_HANG_DIR": str(hang_dir)}
    return run_mpi("hang_suite.py", nprocs, mode, str(CULPRIT), *extra, env=env, timeout=60)


def assert_waiters_name_the_culprit(result, nprocs: int, culprit_line: str) -> None:
    """Every other rank warns that it waits in op #3 and names the culprit as ``culprit_line``."""
    for rank in range(nprocs):
        if rank != CULPRIT:
            header = re.escape(f"bagua_mpi rank {rank}: {THE_OP} has waited ")
            assert re.search(header + r"\d+\.\d s for the other ranks \[op #3 here\]",
                             result.output), f"no warning of rank {rank}; {result.describe()}"
    named = f"NOT in it: rank {CULPRIT}: {culprit_line}"
    assert result.output.count(named) >= nprocs - 1, f"{named!r} missing; {result.describe()}"


def assert_every_rank_dumped(result, nprocs: int, hang_dir, culprit_last: tuple) -> None:
    """The job was aborted; each rank's flight record is on stderr and in its file, whose
    newest row is op #3 running for the waiters and ``culprit_last`` (row start, operation)
    for the culprit."""
    assert not result.timed_out and result.returncode == STALL_EXIT_CODE, result.describe()
    assert "another rank never joined it. Aborting the job." in result.output, result.describe()
    (job_dir,) = hang_dir.glob("bagua_mpi-*")
    assert f"flight records of ranks 0-{nprocs - 1}: {job_dir}/rank-<N>.flight" in result.output, \
        result.describe()
    for rank in range(nprocs):
        assert f"bagua_mpi rank {rank} flight record" in result.output, result.describe()
        rows = (job_dir / f"rank-{rank}.flight").read_text().splitlines()
        last = re.sub(r"\s+", " ", rows[-1]).strip()
        start, op = culprit_last if rank == CULPRIT else ("3 running", THE_OP)
        assert last.startswith(start) and last.endswith(op), (rank, rows)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_a_rank_that_skips_the_collective_is_named(nprocs, tmp_path):
    result = run_case("skip", nprocs, tmp_path)
    assert_waiters_name_the_culprit(
        result, nprocs, "not there yet, in its own code (no bagua_mpi operation) for ")
    assert re.search(rf"rank {CULPRIT}: not there yet, in its own code \(no bagua_mpi operation\) "
                     rf"for \d+\.\d s since finishing {re.escape(LAST_COMMON)}", result.output), \
        result.describe()
    assert_every_rank_dumped(result, nprocs, tmp_path, ("2 done", "allreduce(Sum, float32, (2,))"))


@pytest.mark.parametrize("nprocs", [2, 4])
def test_a_rank_in_a_different_collective_is_named(nprocs, tmp_path):
    result = run_case("other", nprocs, tmp_path)
    assert_waiters_name_the_culprit(result, nprocs, "in barrier() [op #3] instead, for ")
    assert "(a different call at the same point of the sequence)" in result.output
    if nprocs > 2:  # the culprit's own report says the majority is elsewhere
        assert (f"ranks 0, 2-{nprocs - 1} all wait in {THE_OP} [op #3]: this rank (rank "
                f"{CULPRIT}) is probably the one out of step") in result.output, result.describe()
    assert_every_rank_dumped(result, nprocs, tmp_path, ("3 running", "barrier()"))


@pytest.mark.parametrize("nprocs", [2, 4])
def test_a_rank_that_sleeps_is_named_and_the_job_finishes(nprocs, tmp_path):
    result = run_case("sleep", nprocs, tmp_path, str(SLEEP_S))
    assert not result.timed_out and result.returncode == 0, result.describe()
    assert f"sleep OK on {nprocs} ranks" in result.output, result.describe()
    assert_waiters_name_the_culprit(
        result, nprocs, "not there yet, in its own code (no bagua_mpi operation) for ")
    assert "Aborting" not in result.output, result.describe()
    assert list(tmp_path.iterdir()) == [], "a clean exit leaves no state files behind"


# -- the pieces, without MPI --------------------------------------------------------------------
def test_the_ring_buffer_keeps_the_newest_operations_with_their_states():
    worker = CommWorker(recorder_size=4)
    for i in range(5):
        worker.run(lambda: None, ("allreduce", "Sum", "float32", (i,)))
    with pytest.raises(ZeroDivisionError):
        worker.run(lambda: 1 / 0, ("divide",))
    gate = threading.Event()
    slow = worker.submit(gate.wait, ("slow",))
    queued = worker.submit(lambda: None, ("queued",))
    deadline = time.monotonic() + 5
    while worker.recorder.running != 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    rows = worker.recorder.entries()
    assert [(seq, fr.STATE_NAMES[state], fr.describe_text(d)) for seq, d, state, *_ in rows] == [
        (5, "done", "allreduce(Sum, float32, (4,))"), (6, "failed", "divide()"),
        (7, "running", "slow()"), (8, "queued", "queued()")]
    table = fr.format_flight_record(0, worker.recorder)
    assert "4 operation(s) remembered (of 4)" in table and "so far  slow()" in table
    gate.set()
    slow.wait(5)
    queued.wait(5)
    assert worker.recorder.last_finished == 8 and worker.recorder.running == 0
    assert worker.drain(5) and worker.recorder.last_finished == 8  # drain is not an operation
    worker.close(5)


def test_no_recorder_when_its_size_is_zero():
    worker = CommWorker(recorder_size=0)
    assert worker.recorder is None and worker.run(lambda: 7, ("x",)) == 7
    assert worker.submit(lambda: 8, ("y",)).wait(5) == 8
    worker.close(5)


def state(running=None, last=None, ago=1.0, written_ago=0.0):
    """A published state: ``running``/``last`` as (seq, kind, text)."""
    now = time.time()

    def op(entry):
        if entry is None:
            return None
        seq, kind, text = entry
        return {"seq": seq, "kind": kind, "op": text, "state": "done", "started": now - ago,
                "ended": None}

    return {"running": op(running), "last": op(last), "since": now - ago,
            "written": now - written_ago}


def test_laggards_are_named_by_where_they_are():
    waits = (5, "allreduce", "allreduce(Sum)")
    states = {
        0: state(running=waits),
        1: state(running=waits),
        2: state(last=(4, "allreduce", "allreduce(Sum)"), ago=3.0),
        3: state(last=(2, "barrier", "barrier()")),
        4: state(running=(5, "barrier", "barrier()")),
        5: state(running=(7, "allgather", "allgather()")),
        6: state(last=(9, "broadcast", "broadcast()"), written_ago=60),
    }
    lines = fr.name_laggards(0, 5, ("allreduce", "Sum"), states, 9, {8: "rank 8 left"},
                             stale_after=10, board_dir="/x")
    assert lines == [
        "waiting in it too: rank 1",
        "NOT in it: rank 2: not there yet, in its own code (no bagua_mpi operation) for 3.0 s "
        "since finishing allreduce(Sum) [op #4]",
        "NOT in it: rank 3: 2 operations behind, in its own code (no bagua_mpi operation) for "
        "1.0 s since finishing barrier() [op #2]",
        "NOT in it: rank 4: in barrier() [op #5] instead, for 1.0 s (a different call at the "
        "same point of the sequence)",
        "NOT in it: rank 5: 2 operations ahead, in allgather() [op #7] for 1.0 s",
        "NOT in it: rank 6: past it (finished op #9), in its own code (no bagua_mpi operation) "
        "for 1.0 s since finishing broadcast() [op #9]",
        "NOT in it: rank 8: rank 8 left",
        "the state of rank 6 is 60 s old: its watchdog thread has not run (process stopped, or "
        "a call holding the GIL?)",
        "no state from rank 7 in /x (never published one, or on another node: set "
        "BAGUA_MPI_HANG_DIR to a directory all nodes share)",
    ]


def test_the_odd_rank_out_is_told_and_ranks_are_listed_short():
    others = (3, "allreduce", "allreduce(Sum)")
    states = {r: state(running=others) for r in (0, 1, 2, 4, 5)}
    states[3] = state(running=(3, "barrier", "barrier()"))
    lines = fr.name_laggards(3, 3, ("barrier",), states, 6)
    assert lines == [
        "NOT in it: ranks 0-2, 4-5: in allreduce(Sum) [op #3] instead, for 1.0 s (a different "
        "call at the same point of the sequence)",
        "ranks 0-2, 4-5 all wait in allreduce(Sum) [op #3]: this rank (rank 3) is probably the "
        "one out of step"]
    assert fr.rank_list([7]) == "rank 7" and fr.rank_list([5, 1, 2, 3, 9]) == "ranks 1-3, 5, 9"


def test_an_unusable_directory_costs_the_reports_not_the_job(tmp_path, caplog):
    from bagua_mpi.watchdog import Watchdog

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    worker = CommWorker(recorder_size=8)
    dog = Watchdog(worker, 0, warn_after=0.2, abort_after=0,
                   board=fr.HangBoard(str(not_a_dir / "job"), 0, 2))
    gate = threading.Event()
    with caplog.at_level("WARNING", logger="bagua_mpi.watchdog"):
        handle = worker.submit(gate.wait, ("allreduce", "Sum"))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("has waited" in r.getMessage()
                                                      for r in caplog.records):
            time.sleep(0.02)
        gate.set()
        handle.wait(5)
    assert dog.board is None and dog._thread.is_alive()
    messages = [r.getMessage() for r in caplog.records]
    assert any("hang reports off, cannot use" in m for m in messages), messages
    assert any("allreduce(Sum) has waited" in m for m in messages), messages
    dog.stop()
    worker.close(5)
