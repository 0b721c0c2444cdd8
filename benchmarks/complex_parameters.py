"""Step time of a model with complex parameters against its real twin.

A Fourier neural operator block stack (spectral weights complex64 on the first modes, a
pointwise real layer beside each) is trained with ``DistributedOptimizer`` twice per round,
interleaved: once with the spectral weights as complex parameters, once as real parameters
holding the same floats (a trailing dimension of 2, viewed as complex in ``forward``), which is
what a user had to write before complex parameters were accepted. The exchange moves the same
bytes; the complex model's spectral weights sit in buckets of their own. Prints the median step
time of each, and their ratio, per algorithm.

    mpiexec -n 2 python benchmarks/complex_parameters.py [--rounds 5] [--steps 10]
"""
import argparse
import statistics

import torch

import bagua_mpi as bm
from timed_steps import step_times

WIDTH, MODES, POINTS, BLOCKS, BATCH = 64, 16, 128, 4, 16


class Block(torch.nn.Module):
    def __init__(self, as_real: bool):
        super().__init__()
        weight = torch.randn(WIDTH, WIDTH, MODES, dtype=torch.complex64) / WIDTH
        self.as_real = as_real
        self.spectral = torch.nn.Parameter(torch.view_as_real(weight).clone() if as_real
                                           else weight)
        self.pointwise = torch.nn.Conv1d(WIDTH, WIDTH, 1)

    def forward(self, x):
        weight = torch.view_as_complex(self.spectral) if self.as_real else self.spectral
        modes = torch.fft.rfft(x)[..., :MODES]
        mixed = torch.einsum("bim,iom->bom", modes, weight)
        return torch.nn.functional.gelu(torch.fft.irfft(mixed, n=POINTS) + self.pointwise(x))


def build(as_real: bool, algorithm: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(as_real) for _ in range(BLOCKS)))
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                  named_parameters=model.named_parameters(), algorithm=algorithm)
    return model, opt


def step_times_of(model, opt, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(bm.rank())
    x = torch.randn(BATCH, WIDTH, POINTS, generator=g)
    return step_times(model, opt, x, steps, warmup=2)  # bucket profiling, first allocations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--algorithms", default="gradient_allreduce,qsgd,topk")
    args = parser.parse_args()
    bm.init()
    for algorithm in args.algorithms.split(","):
        medians = {"complex": [], "real twin": []}
        for _ in range(args.rounds):
            for label, as_real in (("complex", False), ("real twin", True)):
                model, opt = build(as_real, algorithm)
                medians[label].append(statistics.median(step_times_of(model, opt, args.steps)))
                opt.close()
        if bm.rank() == 0:
            c, r = (statistics.median(medians[k]) for k in ("complex", "real twin"))
            print(f"{algorithm:20s} {bm.size()} ranks: complex {c * 1e3:7.2f} ms, real twin "
                  f"{r * 1e3:7.2f} ms, ratio {c / r:.3f} (medians of {args.rounds} rounds of "
                  f"{args.steps} steps)", flush=True)
    bm.shutdown()


if __name__ == "__main__":
    main()
