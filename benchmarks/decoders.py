"""Device time of every stack decoder (``numba_kernels.decompress_many``) on a CUDA GPU.

Each format's payload of n float32 is decoded from a stack of 1 and of 4 identical rows (the
rows summed into one output, as the C_LP_S and allgather exchanges do), into an output kept
across calls. Timing: 20 calls back to back between two CUDA events, best of 3, so the device
never waits for the host. Bandwidth counts the payload rows read plus the float32 output
written, against a device-to-device copy timed the same way.

Usage (from the repository root, on a machine with a GPU):

    python benchmarks/decoders.py [--n 100000000] [--label NAME]

The last column is a checksum of the first million outputs, so that two trees' decoders can be
compared for equal results as well as for time.
"""
import argparse
import warnings

import numpy as np
from numba import cuda

import numba_kernels as nk


def device_ms(fn, calls=20, rounds=3):
    """Best over ``rounds`` of the mean device time of ``calls`` back-to-back calls."""
    fn()
    cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, stop = cuda.event(), cuda.event()
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / calls)
    return max(best, 1e-6)   # the simulator's events report 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=float, default=1e8)
    ap.add_argument("--label", default="decode")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*Grid size")
    n = int(args.n)
    x = cuda.to_device(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    out = cuda.device_array(n, np.float32)
    t_copy = device_ms(lambda: out.copy_to_device(x))
    copy_gbs = 8 * n / t_copy / 1e6
    print(f"{args.label}: device-to-device copy {t_copy:.3f} ms, {copy_gbs:.0f} GB/s (read + write)")
    print("| format | rows | ms | GB/s | % of copy | checksum |\n|---|---:|---:|---:|---:|---:|")
    payloads = {
        "min-max 8-bit, chunk 1024": nk.compress_minmax(x, 8, 1024),
        "min-max 4-bit, chunk 1024": nk.compress_minmax(x, 4, 1024),
        "QSGD 127 levels, chunk 1024": nk.compress_qsgd(x, 127, 1024, seed=1),
        "1-bit, chunk 4096": nk.compress_onebit(x, 4096),
        "fp16": nk.compress_cast(x, "fp16"),
    }
    for name, payload in payloads.items():
        row = payload.buffer.copy_to_host()
        for rows in (1, 4):
            stack = cuda.to_device(np.stack([row] * rows))
            ms = device_ms(lambda: nk.decompress_many(stack, payload.format, out=out))
            gbs = (rows * payload.format.nbytes + 4 * n) / ms / 1e6
            checksum = out.copy_to_host()[:1_000_000].astype(np.float64).sum()
            print(f"| {name} | {rows} | {ms:.3f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% "
                  f"| {checksum:.6e} |", flush=True)


if __name__ == "__main__":
    main()
