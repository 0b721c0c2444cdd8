"""Exact top-k selection on the CPU (``numba_kernels._select.select_exact``) from 32 to 4M
elements at density 1%: how long it takes, and with ``--baseline FILE`` the same for another
version of ``numba_kernels/_select.py`` (from a clone of an older commit), called interleaved
with this one on the same data, their outputs checked equal.

Small inputs are what L-GreCo's top-k family selects from: each layer of a bucket on its own,
biases and norms included.

    python benchmarks/select_small.py [--baseline /tmp/old/numba_kernels/_select.py]
"""
import argparse
import statistics
import time

import numpy as np

from numba_kernels import _select
from other_version import load_other_version

SIZES = [32, 1024, 4096, 16384, 32768, 65536, 1 << 20, 1 << 22]


def select(module, x, k):
    """(indices, values, count) of module's exact top-k of x."""
    idx = np.empty(k, np.int64)
    val = np.empty(k, np.float32)
    count = module.select_exact(x, x.size, k, idx, val, x, False, idx, False)
    return idx, val, count


def median_us(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another _select.py to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    modules = {"this tree": _select}
    if args.baseline:
        modules = {"baseline": load_other_version(args.baseline), **modules}
    rng = np.random.default_rng(0)
    names = list(modules)
    print("| elements | k | " + " | ".join(names) +
          (" | this tree / baseline |" if args.baseline else " |"))
    print("|---:|---:|" + "---:|" * (len(names) + bool(args.baseline)))
    for m in SIZES:
        x = rng.standard_normal(m).astype(np.float32)
        x[::5] = x[1]  # a tie run across the threshold's neighbourhood
        k = max(1, m // 100)
        results = [select(mod, x, k) for mod in modules.values()]  # compiles, then checks
        for other in results[1:]:
            for a, b in zip(results[0], other):
                np.testing.assert_array_equal(a, b)
        repeats = max(3, 20_000 // max(1, m // 64))
        times = {name: [] for name in names}
        for _ in range(args.rounds):  # interleaved: each round times every version in turn
            for name, mod in modules.items():
                times[name].append(median_us(lambda: select(mod, x, k), repeats))
        medians = [statistics.median(times[name]) for name in names]
        row = f"| {m} | {k} | " + " | ".join(f"{t:.1f} us" for t in medians)
        if args.baseline:
            row += f" | {medians[1] / medians[0]:.2f}x"
        print(row + " |")
    if args.baseline:
        print("(the two versions' indices, values and counts equal at every size)")


if __name__ == "__main__":
    main()
