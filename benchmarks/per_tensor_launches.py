"""What a grouped allreduce, Adasum's delta optimizer, 1-bit Adam's compressed-stage ``step()``
and PowerSGD's orthonormalization dispatch, and how long they take, for 4 to 256 tensors
(layers) of the same total size.

On a GPU each dispatched operation that computes or copies is at least one kernel launch (a
few microseconds of host time each), so the count is the launch cost a CPU can measure; the
times are CPU tensors' (what a CPU user gets). 1-bit Adam updates host parameters one at a time
(in cache) and device ones in foreach lists, and PowerSGD orthonormalizes host P's in NumPy:
both are counted on the route device tensors take. Run it with two trees (two venvs, each with
one editable install) and compare the lines.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/per_tensor_launches.py
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import bagua_mpi as bm
from bagua_mpi.algorithms import onebit_adam
from bagua_mpi.primitives import lowrank

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests" / "mpi"))
from dispatch_count import DispatchCount  # noqa: E402  (the tests' counter)


def timed(fn, repeats=15):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        bm.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def launches(fn):
    with DispatchCount() as mode:
        fn()
    return mode.launches


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--tensors", default="4,64,256")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    bm.init()
    rows = []
    for n in map(int, args.tensors.split(",")):
        gen = torch.Generator().manual_seed(bm.rank())
        xs = [torch.randn(args.elements // n, generator=gen) for _ in range(n)]
        halves = [x.half() for x in xs]
        params = [torch.nn.Parameter(torch.randn(args.elements // n,
                                                 generator=torch.Generator().manual_seed(i)))
                  for i in range(n)]
        opt = bm.DistributedOptimizer(torch.optim.SGD(params, lr=0.01, foreach=True),
                                      named_parameters=[(f"p{i}", p)
                                                        for i, p in enumerate(params)],
                                      op=bm.Adasum)

        def step():
            for p, x in zip(params, xs):
                p.grad = x
            opt.step()

        adam_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        adam = bm.DistributedOptimizer(
            torch.optim.AdamW(adam_params, lr=1e-4, weight_decay=0.01),
            named_parameters=[(f"p{i}", p) for i, p in enumerate(adam_params)],
            algorithm=bm.algorithms.OneBitAdam(warmup_steps=1))

        def adam_backward():
            adam.zero_grad()
            sum((p * x).sum() for p, x in zip(adam_params, xs)).backward()

        def adam_step():
            adam_backward()
            adam.step()

        def adam_step_counted():
            """The operations of step() alone, on the route device tensors take (host tensors
            are updated one at a time, in cache; a tree without the route counts its own)."""
            adam_backward()
            host_route = getattr(onebit_adam, "_together", None)
            onebit_adam._together = lambda p: True
            try:
                with DispatchCount() as mode:
                    adam.step()
            finally:
                if host_route is not None:
                    onebit_adam._together = host_route
            return mode.launches

        cases = {"grouped Sum float32": lambda: bm.grouped_allreduce(xs, op=bm.Sum),
                 "grouped Sum float16": lambda: bm.grouped_allreduce(halves, op=bm.Sum),
                 "Adasum optimizer step": step}
        for name, fn in cases.items():
            rows.append((n, name, launches(fn), timed(fn)))
        # PowerSGD's orthonormalization of every layer's P (n x 4, the rows summing to the
        # elements), as CUDA tensors take it: every P at once, or (a tree without that) one at
        # a time
        p_rows = max(4, args.elements // (64 * n))
        packed = torch.randn(n * p_rows * 4, generator=gen)
        shapes = tuple((p_rows, 4) for _ in range(n))

        def orthonormalize():
            if hasattr(lowrank, "orthonormalize_packed_"):
                lowrank.orthonormalize_packed_(packed, shapes)
                return
            for k in range(n):
                view = packed[k * p_rows * 4:(k + 1) * p_rows * 4].view(p_rows, 4)
                view.copy_(lowrank.orthonormalize_device(view))

        powersgd_row = (n, "PowerSGD orthonormalization (device route)",
                        launches(orthonormalize), timed(orthonormalize))
        for _ in range(3):  # 1-bit Adam's warm-up step, then its compressed stage
            adam_step()
        rows.append((n, "1-bit Adam step (compressed stage; device route counted)",
                     adam_step_counted(), timed(adam_step)))
        adam.close()
        opt.close()
        rows.append(powersgd_row)
    if bm.rank() == 0:
        for n, name, count, ms in rows:
            print(f"{args.label} | {n} tensors | {name} | {count} operations | {ms:.2f} ms")


if __name__ == "__main__":
    main()
