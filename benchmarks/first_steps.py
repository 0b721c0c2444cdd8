"""The first steps of a fresh process, one by one: what a job pays once (buckets built at the
end of the first backward, an algorithm's setup, Numba's first loads) beside what every step
pays. The model is ``sparse.py``'s small transformer; ranks have their own data.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/first_steps.py powersgd [--steps 8]

Rank 0 prints each step's milliseconds, for a first optimizer and then a second one in the same
process (which finds everything loaded).
"""
import argparse
import time

import numpy as np
import torch

import bagua_mpi as bm
from sparse import TinyLM, markov_source, sample_sequences


def first_steps(algorithm: str, steps: int, source) -> list[float]:
    torch.manual_seed(0)
    model = TinyLM.build(2048, 64, 33)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  algorithm=algorithm)
    rng = np.random.default_rng([bm.rank(), 7])
    times = []
    for _ in range(steps):
        x = torch.from_numpy(sample_sequences(source, 16, 33, rng))
        bm.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 2048),
                                          x[:, 1:].reshape(-1)).backward()
        opt.step()
        times.append((time.perf_counter() - start) * 1e3)
    opt.close()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("algorithm", help="a registered algorithm's name")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    bm.init()
    torch.set_num_threads(1)
    source = markov_source(2048, 4, seed=1)
    for which in ("first optimizer", "second optimizer"):
        times = first_steps(args.algorithm, args.steps, source)
        if bm.rank() == 0:
            print(f"{args.algorithm}, {which}: " + ", ".join(f"{t:.1f}" for t in times) + " ms")
    bm.shutdown()


if __name__ == "__main__":
    main()
