"""Time training steps the way the step benchmarks do: every rank starts each step together."""
import time

import bagua_mpi as bm


def step_times(model, opt, x, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` steps (forward, a squared-mean loss, backward, ``opt.step``)
    on input ``x``, after ``warmup`` untimed ones (bucket profiling, first allocations, first
    compiles), each started at a barrier."""
    times = []
    for _ in range(warmup + steps):
        bm.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[warmup:]
