"""Host microseconds per kernel launch, by the way the kernel is started (needs a CUDA GPU).

A compressed bucket of a small model costs its launches and little else, so this measures
what one launch costs the host:

* ``numba, device arrays``: ``kernel[blocks, threads, stream](*args)`` with Numba device arrays
  made once (Numba types every argument and picks the compiled overload per call);
* ``numba, torch tensors``: the same with torch CUDA tensors, which Numba reads through
  ``__cuda_array_interface__`` per call;
* ``numba_kernels.launch``: the package's launch path (the dispatcher, and the launch count);
* ``as_cuda_array``, ``from_cuda_array_interface`` (no owner, no sync) and
  ``__cuda_array_interface__``: what viewing a torch tensor as a Numba array costs, and which
  part of it is torch's;
* ``torch.as_tensor(numba array)``: the other direction;
* ``torch add_``: a torch kernel, for comparison.

Each row is the median over rounds of the mean host time of LAUNCHES launches (the device is
synchronised between rounds, not inside them).  Usage::

    python benchmarks/launch_overhead.py [--launches 2000] [--rounds 7]
"""
import argparse
import statistics
import time
import warnings

import numba
import numpy as np
import torch
from numba import cuda

from numba_kernels._cuda.launch import launch


@cuda.jit
def _axpy(x, y, a, n):
    i = cuda.grid(1)
    if i < n:
        y[i] += a * x[i]


def measure(fn, launches, rounds):
    fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(launches):
            fn()
        means.append((time.perf_counter() - t0) / launches * 1e6)
        torch.cuda.synchronize()
    return statistics.median(means)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=4096)
    a = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*Grid size")   # a 16-block launch: on purpose
    n = a.n
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    xt = torch.randn(n, device="cuda")
    yt = torch.zeros(n, device="cuda")
    xd, yd = cuda.as_cuda_array(xt), cuda.as_cuda_array(yt)
    blocks = (n + 255) // 256
    rows = {
        "numba, device arrays": lambda: _axpy[blocks, 256, stream](xd, yd, np.float32(0.5), n),
        "numba, torch tensors": lambda: _axpy[blocks, 256, stream](xt, yt, np.float32(0.5), n),
        "numba_kernels.launch": lambda: launch(_axpy, blocks, 256, stream, xd, yd,
                                               np.float32(0.5), n),
        "as_cuda_array (no launch)": lambda: cuda.as_cuda_array(xt),
        "from_cuda_array_interface, no owner, no sync": lambda: cuda.from_cuda_array_interface(
            xt.__cuda_array_interface__, owner=None, sync=False),
        "tensor.__cuda_array_interface__": lambda: xt.__cuda_array_interface__,
        "torch.as_tensor(numba array)": lambda: torch.as_tensor(xd, device="cuda"),
        "torch add_": lambda: yt.add_(xt, alpha=0.5),
    }
    print(f"device: {torch.cuda.get_device_name(0)}; numba {numba.__version__}; "
          f"dispatcher: {type(_axpy).__module__}; {a.launches} launches x {a.rounds} rounds")
    print("| how | host us per call |\n|---|---|")
    us = {}
    for name, fn in rows.items():
        us[name] = measure(fn, a.launches, a.rounds)
        print(f"| {name} | {us[name]:.1f} |")
    print(f"\nnumba_kernels.launch / Numba's dispatcher (device arrays): "
          f"{us['numba_kernels.launch'] / us['numba, device arrays']:.2f}")


if __name__ == "__main__":
    main()
