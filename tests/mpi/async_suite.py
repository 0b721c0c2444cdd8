"""Asynchronous handles: progress while the main thread computes, ordering, buffer ownership.

``checks.run_suite`` runs every ``check_*`` function below (or those named by ``--check``) and
reports each on its own line.
"""
import gc
import sys
import time

import torch

import bagua_mpi as bm
from checks import run_suite
from simulate import assert_same, rank_input, reduce_all


def busy_python(seconds: float) -> int:
    """Pure-Python work that holds the GIL as a training loop's Python side would."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += sum(i * i for i in range(200))
    return n


def check_progress_while_computing(rank, size):
    """The handle completes while the main thread is still busy, before synchronize()."""
    x = rank_input(1, rank, (1 << 20,), "float32")
    expected = reduce_all([rank_input(1, r, (1 << 20,), "float32") for r in range(size)], "sum")
    bm.barrier()
    h = bm.allreduce_async(x, bm.Sum)
    done_during_compute = False
    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline:
        busy_python(0.01)
        if bm.poll(h):
            done_during_compute = True
            break
    assert done_during_compute, "allreduce made no progress while the main thread computed"
    assert_same(bm.synchronize(h), expected, "async result")


def check_many_in_flight_and_order(rank, size):
    """Many handles in flight, a synchronous call in between, waited in reverse order."""
    shapes = [(1000 + 17 * i,) for i in range(24)]
    inputs = [[rank_input(100 + i, r, s, "float32") for i, s in enumerate(shapes)]
              for r in range(size)]
    handles = [bm.allreduce_async(inputs[rank][i], bm.Sum) for i in range(len(shapes))]
    mid = bm.allreduce(torch.tensor([float(rank)]), bm.Sum)  # queues behind the async ones
    assert mid.item() == sum(range(size))
    for i in reversed(range(len(shapes))):
        expected = reduce_all([inputs[r][i] for r in range(size)], "sum")
        assert_same(bm.synchronize(h := handles[i]), expected, f"in flight {i}")
        assert bm.poll(h)


def check_handle_owns_buffers(rank, size):
    """Dropping every user reference while the operation runs must not corrupt it."""
    handles = []
    for i in range(8):
        x = rank_input(200 + i, rank, (50_000,), "float64")
        handles.append(bm.allreduce_async(x, bm.Sum))
        del x
    gc.collect()
    for i, h in enumerate(handles):
        expected = reduce_all([rank_input(200 + i, r, (50_000,), "float64")
                               for r in range(size)], "sum")
        assert_same(bm.synchronize(h), expected, f"owned buffer {i}")


def check_errors_arrive_through_handles(rank, size):
    """An agreement failure inside an async op is raised by synchronize() on every rank."""
    h = bm.allreduce_async(torch.zeros(rank + 2))  # every rank a different shape
    try:
        bm.synchronize(h)
    except bm.MismatchError as exc:
        assert f"shape=({size + 1},)" in str(exc) and "rank 0" in str(exc), str(exc)
    else:
        raise AssertionError("mismatched async allreduce did not raise")
    # and the library keeps working afterwards
    assert bm.allreduce(torch.ones(1), bm.Sum).item() == size


def check_custom_submit(rank, size):
    """Algorithms can queue their own MPI sequences, ordered with the collectives."""
    comm = bm.runtime.get().topo.comm
    h1 = bm.allreduce_async(torch.ones(4), bm.Sum)
    h2 = bm.submit(lambda: comm.allreduce(rank), ("custom-allreduce",))
    assert bm.synchronize(h2) == sum(range(size))
    assert bm.synchronize(h1).tolist() == [float(size)] * 4


# every check_ function above, by name (``progress-while-computing``, ...)
CHECKS = {name.removeprefix("check_").replace("_", "-"): fn
          for name, fn in list(globals().items()) if name.startswith("check_")}


if __name__ == "__main__":
    sys.exit(run_suite(CHECKS))
