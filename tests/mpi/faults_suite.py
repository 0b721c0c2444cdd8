"""Bad input and faults. ``python faults_suite.py MODE`` on every rank.

Modes:
  mismatch   ranks disagree on shape/dtype/op/root/...: MismatchError on every rank, then the
             library keeps working; prints the time each detection took
  bad-args   invalid arguments raise ValueError/TypeError naming the value, no MPI traffic
  raise      the last rank raises; the job must end non-zero with that rank's traceback
  die        the last rank is killed by SIGKILL; the job must end non-zero
  stall      rank 0 skips a collective; the watchdog must warn, then abort the job
  exit-code  the last rank calls sys.exit(3) while the others call a collective: the job must
             end promptly, non-zero, naming that rank and code
  return R   rank R (a number, or "last") returns from main normally while the others call a
             collective: the job must end promptly, naming rank R
  thread     a thread of the last rank raises: the job must end with that traceback
  nested     an asynchronous call made from the communication thread raises NestedAsyncError
             (no deadlock) on every rank; the library keeps working
  sync-twice synchronize() twice on one handle returns the same result (and error)
  skew       all ranks finish, rank 0 some seconds after the others: a clean exit (code 0)
  late R     rank R (a number, or "last") sleeps a minute after the last collective, outside
             the library; run with a short BAGUA_MPI_EXIT_TIMEOUT_S: the others must give up
             on it and abort, naming it
  uneven     each rank trains 2 + rank steps (uneven data) and returns: the job must end
             promptly, naming the rank that returned and suggesting join()
  uneven-joined  the same loops, then bm.join() on every rank: a clean exit (code 0), with
             each rank's model equal to a NumPy replay of its own steps, whose averages take
             zeros from the ranks already joined
  stall-in-gloo  rank 1 is 30 s late to a bucket's exchange over the gloo group (a peer stalled
             inside an exchange, after its agreement check): the watchdog must abort the job
             with its report (code 124) before gloo's own timeout raises a bare RuntimeError
  pending    rank 0 leaves an asynchronous allreduce that the others never call, and every
             rank calls shutdown(timeout=2): rank 0 must abort the job naming the operation
             (before: its shutdown freed the communicators under the running operation, a
             segmentation fault or gloo's terminate, where the MPI grants no THREAD_MULTIPLE)
  lr NAME    algorithm NAME (one that averages models with ring neighbours' check) whose last
             rank's learning rate halves after step 1: that rank and its ring neighbours raise
             MismatchError before the models are averaged at step 2, uncaught, and the job
             must end
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


def as_if_on_nccl(fn, form="nccl"):
    """``fn()`` on this rank as if its dense allreduces ran on NCCL in ``form`` (``nccl`` or
    ``nccl_hierarchical``; a node whose ``auto`` took NCCL while the others' took MPI): only
    the route is changed, since the agreement check must stop the call before any reduction
    starts."""
    from bagua_mpi.collectives import _allreduce
    saved = _allreduce.reducer_for, _allreduce.join_route
    _allreduce.reducer_for = lambda tensor, topo, reductions: _allreduce.nccl_allreduce_
    _allreduce.join_route = lambda tensor, topo, *args, **kwargs: ("nccl", form)
    try:
        return fn()
    finally:
        _allreduce.reducer_for, _allreduce.join_route = saved


def under_gloo(fn):
    """``fn()`` on this rank under backend gloo (a rank started with
    ``BAGUA_MPI_BACKEND=gloo``): its torch tensors' data movement takes the gloo group."""
    from bagua_mpi import backends
    saved = backends._default
    backends._default = "gloo"
    try:
        return fn()
    finally:
        backends._default = saved


def mode_mismatch(rank, size):
    last = size - 1
    on_nccl = as_if_on_nccl if rank == last else (lambda fn: fn())
    on_gloo = under_gloo if rank == last else (lambda fn: fn())
    cases = {
        "shape": (lambda: bm.allreduce(torch.zeros(3 + rank)), ["shape=(3,)", f"shape=({3 + last},)"]),
        "dtype": (lambda: bm.allreduce(torch.zeros(4, dtype=torch.float64 if rank else torch.float32)),
                  ["dtype=float32", "dtype=float64"]),
        "op": (lambda: bm.allreduce(torch.zeros(4), bm.Max if rank == last else bm.Sum),
               ["op=Max", "op=Sum"]),
        "collective": (lambda: bm.broadcast(torch.zeros(4)) if rank == 0 else bm.allreduce(torch.zeros(4)),
                       ["broadcast(", "allreduce("]),
        # the small-message fast path on one rank, the general path (>= 1 MiB out of place) on
        # the others: both must send the same check record
        "fast_vs_general": (lambda: bm.allreduce(torch.zeros(2 if rank == 0 else 300_000), bm.Sum),
                            ["shape=(2,)", "shape=(300000,)"]),
        "root": (lambda: bm.broadcast(torch.zeros(2), root_rank=rank), ["root=0", f"root={last}"]),
        "allgather": (lambda: bm.allgather(torch.zeros(2, 2 + rank)), ["trailing_shape=(2,)"]),
        "alltoall": (lambda: bm.alltoall(torch.zeros(size, 1, dtype=torch.int32 if rank else torch.int64)),
                     ["dtype=int64", "dtype=int32"]),
        "grouped": (lambda: bm.grouped_allreduce([torch.zeros(2), torch.zeros(1 + rank)]), ["shapes="]),
        "reducescatter": (lambda: bm.reducescatter(torch.zeros(size + rank)), ["reducescatter("]),
        # the library each rank's route takes (a scaling factor keeps it off the fast path)
        "wire": (lambda: on_nccl(lambda: bm.allreduce(torch.zeros(4), bm.Sum,
                                                      prescale_factor=2.0)), ["wire=nccl"]),
        "grouped_wire": (lambda: on_nccl(lambda: bm.grouped_allreduce([torch.zeros(2)])),
                         ["grouped_allreduce(", "wire=nccl"]),
        # every rank on NCCL, the last in its two-level form (groups of the node, not the job)
        "nccl_form": (lambda: as_if_on_nccl(lambda: bm.allreduce(torch.zeros(4), bm.Sum,
                                                                 prescale_factor=2.0),
                                            "nccl_hierarchical" if rank == last else "nccl"),
                      ["wire=nccl_hierarchical", "wire=nccl"]),
        # data movement on a process group on one rank, MPI on the others
        "movement_wire": (lambda: on_gloo(lambda: bm.allgather(torch.zeros(2, 2))),
                          ["allgather(", "wire=gloo"]),
        "reducescatter_wire": (lambda: on_gloo(lambda: bm.reducescatter(torch.zeros(size))),
                               ["reducescatter(", "wire=gloo"]),
        # MPI's two-level form on one rank, flat on the others: their calls never meet
        "hierarchical": (lambda: bm.allreduce(torch.zeros(4), bm.Sum,
                                              hierarchical=rank == last), ["hierarchical=True"]),
        "grouped_hierarchical": (lambda: bm.grouped_allreduce([torch.zeros(2)],
                                                              hierarchical=rank == last),
                                 ["grouped_allreduce(", "hierarchical=True"]),
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
    expect(TypeError, lambda: bm.allreduce(torch.ones(2, dtype=torch.complex64), bm.Max),
           "complex tensors can be summed or averaged", "not reduced with Max")
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


def mode_exit_code(rank, size):
    bm.allreduce(torch.ones(1))
    if rank == size - 1:
        print(f"rank {rank} calls sys.exit(3) at {time.time():.3f}", flush=True)
        sys.exit(3)
    bm.allreduce(torch.ones(1))  # never completes: the job must be torn down
    time.sleep(60)


def mode_return(rank, size, who="last"):
    leaver = size - 1 if who == "last" else int(who)
    bm.allreduce(torch.ones(1))
    if rank == leaver:
        print(f"rank {rank} returns at {time.time():.3f}", flush=True)
        return  # the end of the program; the others still expect it below
    bm.allreduce(torch.ones(2))
    time.sleep(60)


def mode_thread(rank, size):
    import threading

    bm.allreduce(torch.ones(1))
    if rank == size - 1:
        def work():
            raise ValueError(f"deliberate failure in a worker thread of rank {rank}")
        t = threading.Thread(target=work, name="data-loader")
        t.start()
        t.join()
    bm.allreduce(torch.ones(1))  # the others (and this rank) wait here until the abort
    time.sleep(60)


def mode_nested(rank, size):
    def inner_async():
        h = bm.allreduce_async(torch.ones(3), bm.Sum)
        return bm.synchronize(h)  # without the guard: waits for itself for ever

    t0 = time.perf_counter()
    handle = bm.submit(inner_async, ("user-op",))
    text = expect(bm.BaguaMPIError, lambda: bm.synchronize(handle, timeout=30),
                  f"rank {rank}: allreduce(", "user-op", "communication thread",
                  "synchronous form")
    from bagua_mpi.exceptions import NestedAsyncError
    try:
        bm.synchronize(handle)
    except NestedAsyncError:
        pass
    else:
        raise AssertionError("synchronize on the failed handle did not raise NestedAsyncError")
    # the synchronous form, nested on the comm thread, is fine
    nested_sync = bm.submit(lambda: bm.allreduce(torch.ones(3), bm.Sum), ("user-op-sync",))
    assert bm.synchronize(nested_sync, timeout=30).tolist() == [size] * 3
    assert bm.allreduce(torch.ones(1), bm.Sum).item() == size
    if rank == 0:
        print(f"nested OK on {size} ranks in {time.perf_counter() - t0:.2f} s: {text[:90]}",
              flush=True)


def mode_sync_twice(rank, size):
    x = torch.full((4,), float(rank))
    h = bm.allreduce_async(x, bm.Sum)
    first = bm.synchronize(h)
    second = bm.synchronize(h)
    assert second is first and first.tolist() == [size * (size - 1) / 2] * 4
    assert bm.poll(h)
    y = torch.ones(3)
    h = bm.allreduce_async_(y, bm.Sum)
    assert bm.synchronize(h) is bm.synchronize(h) and y.tolist() == [size] * 3
    h = bm.broadcast_async(torch.full((2,), float(rank)), root_rank=0)
    assert bm.synchronize(h).tolist() == bm.synchronize(h).tolist() == [0.0, 0.0]
    bad = bm.submit(lambda: 1 / 0, ("divide",))
    first_err = expect(bm.CommunicationError, lambda: bm.synchronize(bad), "divide")
    assert expect(bm.CommunicationError, lambda: bm.synchronize(bad), "divide") == first_err
    assert bm.allreduce(torch.ones(1), bm.Sum).item() == size
    if rank == 0:
        print(f"sync-twice OK on {size} ranks", flush=True)


def mode_skew(rank, size):
    bm.allreduce(torch.ones(1))
    if rank == 0:
        time.sleep(3)  # e.g. a final evaluation on rank 0: the others wait for it at exit
        print(f"skew OK on {size} ranks", flush=True)


def mode_late(rank, size, who="last"):
    late = size - 1 if who == "last" else int(who)
    bm.allreduce(torch.ones(1))
    if rank == late:
        print(f"rank {rank} sleeps at {time.time():.3f}", flush=True)
        time.sleep(60)  # not in any collective: only the exit timeout can tell


UNEVEN_LR = 0.1


def uneven_loop(rank, steps):
    """``steps`` SGD steps of a linear model on this rank's own data; returns the model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1, bias=False)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=UNEVEN_LR),
                                  named_parameters=model.named_parameters())
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    print(f"rank {rank} returns at {time.time():.3f}", flush=True)
    return model


def mode_uneven(rank, size):
    uneven_loop(rank, 2 + rank)  # no join(): the others wait in their third step's bucket


def mode_uneven_joined(rank, size):
    """The oracle replays this rank's steps in NumPy: at step s the ranks with data (2 + r > s)
    add their gradients, the joined ones zeros, and the sum is divided by the whole world."""
    import numpy as np

    model = uneven_loop(rank, 2 + rank)
    last = bm.join()
    torch.manual_seed(0)
    w = torch.nn.Linear(6, 1, bias=False).weight.detach().double().numpy().ravel()
    for step in range(2 + rank):  # a joined rank steps no more (as in Horovod and DDP)
        grad = np.zeros_like(w)
        for r in range(size):
            if step < 2 + r:
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * r + step))
                x = x.double().numpy()
                grad += x.T @ (2 * (x @ w) / len(x))
        w = w - UNEVEN_LR * grad / size
    got = model.weight.detach().double().numpy().ravel()
    err = float(np.max(np.abs(got - w)))
    if last != size - 1 or not err < 1e-5:
        raise AssertionError(f"rank {rank}: join() returned {last} (want {size - 1}), "
                             f"max error against the replay {err:.2e}")
    print(f"uneven-joined OK on rank {rank}", flush=True)


def mode_stall_in_gloo(rank, size):
    from bagua_mpi import runtime
    from bagua_mpi.transport import Transport
    rt = runtime.get()
    wire = Transport(rt.topo.comm, "gloo")
    t = torch.ones(8)
    rt.worker.run(lambda: wire.allreduce_(t), ("bucket", 0, 32))  # the group is made
    if rank == 1:
        time.sleep(30)
    rt.worker.run(lambda: wire.allreduce_(t), ("bucket", 1, 32))


def mode_pending(rank, size):
    bm.allreduce(torch.ones(3), name="both")
    if rank == 0:
        bm.allreduce_async(torch.ones(3), name="only-rank-0")
    print(f"rank {rank} shuts down", flush=True)
    bm.shutdown(timeout=2)
    time.sleep(30)  # not reached on rank 0; the others wait here to be ended with it


def mode_lr(rank, size, name):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), algorithm=name)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    for step in range(6):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        print(f"rank {rank} stepped {step}", flush=True)
        if step == 1 and rank == size - 1:
            opt.param_groups[0]["lr"] = 0.005
    opt.close()  # not reached: the job ends at step 2


def main():
    bm.init()
    mode = sys.argv[1]
    {"mismatch": mode_mismatch, "bad-args": mode_bad_args, "raise": mode_raise,
     "die": mode_die, "stall": mode_stall, "exit-code": mode_exit_code, "return": mode_return,
     "thread": mode_thread, "nested": mode_nested, "sync-twice": mode_sync_twice,
     "skew": mode_skew, "late": mode_late, "uneven": mode_uneven,
     "uneven-joined": mode_uneven_joined, "pending": mode_pending,
     "stall-in-gloo": mode_stall_in_gloo,
     "lr": mode_lr}[mode](bm.rank(), bm.size(), *sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
