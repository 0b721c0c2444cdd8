"""Bad input and faults. ``python faults_suite.py MODE`` on every rank.

Modes:
  mismatch   ranks disagree on shape/dtype/op/root/...: MismatchError on every rank, then the
             library keeps working; prints the time each detection took
  bad-args   invalid arguments raise ValueError/TypeError naming the value, no MPI traffic
  raise      the last rank raises; the job must end non-zero with that rank's traceback
  die        the last rank is killed by SIGKILL; the job must end non-zero
  stall      rank 0 skips a collective; the watchdog must warn, then abort the job
"""
import os
import signal
import sys
import time

import torch

import bagua_mpi as bm


def expect(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, f"{needle!r} not in error message: {text}"
        return text
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def mode_mismatch(rank, size):
    last = size - 1
    cases = {
        "shape": (lambda: bm.allreduce(torch.zeros(3 + rank)), ["shape=(3,)", f"shape=({3 + last},)"]),
        "dtype": (lambda: bm.allreduce(torch.zeros(4, dtype=torch.float64 if rank else torch.float32)),
                  ["dtype=float32", "dtype=float64"]),
        "op": (lambda: bm.allreduce(torch.zeros(4), bm.Max if rank == last else bm.Sum),
               ["op=Max", "op=Sum"]),
        "collective": (lambda: bm.broadcast(torch.zeros(4)) if rank == 0 else bm.allreduce(torch.zeros(4)),
                       ["broadcast(", "allreduce("]),
        "root": (lambda: bm.broadcast(torch.zeros(2), root_rank=rank), ["root=0", f"root={last}"]),
        "allgather": (lambda: bm.allgather(torch.zeros(2, 2 + rank)), ["trailing_shape=(2,)"]),
        "alltoall": (lambda: bm.alltoall(torch.zeros(size, 1, dtype=torch.int32 if rank else torch.int64)),
                     ["dtype=int64", "dtype=int32"]),
        "grouped": (lambda: bm.grouped_allreduce([torch.zeros(2), torch.zeros(1 + rank)]), ["shapes="]),
        "reducescatter": (lambda: bm.reducescatter(torch.zeros(size + rank)), ["reducescatter("]),
    }
    times = {}
    for name, (fn, needles) in cases.items():
        bm.barrier()
        t0 = time.perf_counter()
        msg = expect(bm.MismatchError, fn, f"rank {last}", "rank 0", *needles)
        times[name] = time.perf_counter() - t0
        assert isinstance(bm.MismatchError(msg), bm.BaguaMPIError)
        # the communicator is still healthy afterwards
        assert bm.allreduce(torch.ones(1), bm.Sum).item() == size
    gathered = bm.allgather_object(sorted(times))
    assert all(g == sorted(cases) for g in gathered), "not every rank saw every mismatch"
    if rank == 0:
        print(f"mismatch OK on {size} ranks; detection ms: "
              + ", ".join(f"{k}={v * 1e3:.1f}" for k, v in times.items()), flush=True)


def mode_bad_args(rank, size):
    x = torch.ones(4)
    expect(ValueError, lambda: bm.broadcast(x, root_rank=size), f"got {size}")
    expect(ValueError, lambda: bm.broadcast(x, root_rank=-1), "got -1")
    expect(ValueError, lambda: bm.broadcast_object(1, root_rank="0"), "got '0'")
    expect(ValueError, lambda: bm.alltoall(torch.ones(size, 2), splits=[1] * (size + 1)),
           f"{size} integers")
    expect(ValueError, lambda: bm.alltoall(torch.ones(size, 2), splits=[size + 1] + [0] * (size - 1)),
           f"sum to dimension 0 ({size})")
    expect(ValueError, lambda: bm.alltoall(torch.ones(size, 2), splits=[-1, size + 1] + [0] * (size - 2))
           if size >= 2 else bm.alltoall(torch.ones(1), splits=[-1]), "non-negative")
    if size > 1:
        expect(ValueError, lambda: bm.alltoall(torch.ones(size + 1)), "divisible")
    expect(TypeError, lambda: bm.allreduce(torch.ones(2, dtype=torch.complex64)), "complex64")
    expect(TypeError, lambda: bm.allreduce(torch.ones(2, dtype=torch.uint32)), "uint32")
    expect(TypeError, lambda: bm.allreduce([1.0, 2.0]), "list")
    expect(TypeError, lambda: bm.allreduce(torch.ones(2, dtype=torch.bool)), "Average")
    expect(TypeError, lambda: bm.allreduce(torch.ones(2, dtype=torch.bool), bm.Sum), "bool")
    expect(ValueError, lambda: bm.allreduce(x, "mean"), "'mean'")
    expect(ValueError, lambda: bm.allreduce(x, prescale_factor=float("nan")), "nan")
    expect(TypeError, lambda: bm.allreduce(torch.ones(2, dtype=torch.bool), bm.Max,
                                           postscale_factor=2.0), "bool")
    expect(ValueError, lambda: bm.grouped_allreduce([]), "non-empty")
    expect(TypeError, lambda: bm.synchronize("handle"), "str")
    # nothing above reached MPI: the ranks are still in step
    assert bm.allreduce(torch.ones(1), bm.Sum).item() == size
    if rank == 0:
        print(f"bad-args OK on {size} ranks", flush=True)


def mode_raise(rank, size):
    bm.allreduce(torch.ones(1))
    if rank == size - 1:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    bm.allreduce(torch.ones(1))  # the others wait here until the job is torn down
    time.sleep(60)


def mode_die(rank, size):
    bm.allreduce(torch.ones(1))
    if rank == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    bm.allreduce(torch.ones(1))
    time.sleep(60)


def mode_stall(rank, size):
    bm.allreduce(torch.ones(1))
    if rank == 0:
        time.sleep(60)  # never joins the next collective
    bm.allreduce(torch.ones(7), bm.Sum)


def main():
    bm.init()
    mode = sys.argv[1]
    {"mismatch": mode_mismatch, "bad-args": mode_bad_args, "raise": mode_raise,
     "die": mode_die, "stall": mode_stall}[mode](bm.rank(), bm.size())


if __name__ == "__main__":
    sys.exit(main())
