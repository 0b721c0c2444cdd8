"""What the per-step hyperparameter comparison adds to the first bucket's agreement check.

The first bucket of every step hashes its agreement signature with a digest of the wrapped
optimizer's hyperparameters (``bagua_mpi/algorithms/hyperparameters.py``); before, the same
signature without it was hashed once and then found in a cache. Both are timed here on the
main thread, interleaved, for AdamW with 1, 10 and 100 param groups (a scheduler changes the
learning rate every step, so the digest is always computed afresh). The allreduce that carries
the hash is the same either way and is not timed.

    python benchmarks/hyperparameter_check.py
"""
import statistics
import time

import torch

from bagua_mpi import consistency
from bagua_mpi.algorithms import hyperparameters

SIGNATURE = ("bucket", ("algorithm", "gradient_allreduce"), ("index", 0),
             ("sizes", (21_000_000,)), ("dense", True), ("zero_stage", 0), ("frozen", ()))


def before(optimizer) -> int:
    return consistency.signature_hash(SIGNATURE)


def after(optimizer) -> int:
    signature = SIGNATURE + ((hyperparameters.FIELD,
                              hyperparameters.digest(optimizer.param_groups)),)
    return consistency.signature_hash(signature, cache=False)


def per_call(fn, optimizer, calls: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(optimizer)
    return (time.perf_counter() - start) / calls


def main():
    print("| param groups | before us | after us | added us a step |")
    print("|---:|---:|---:|---:|")
    for groups in (1, 10, 100):
        params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(groups)]
        optimizer = torch.optim.AdamW([{"params": [p]} for p in params], lr=1e-3)
        times = {"before": [], "after": []}
        for _ in range(7):
            for name, fn in (("before", before), ("after", after)):
                times[name].append(per_call(fn, optimizer))
        b, a = (statistics.median(times[k]) * 1e6 for k in ("before", "after"))
        print(f"| {groups} | {b:.2f} | {a:.1f} | {a - b:.1f} |")


if __name__ == "__main__":
    main()
