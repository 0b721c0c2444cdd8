"""What an elastic ``commit()`` costs now that it also keeps the algorithm's state.

``TorchState.commit()`` copies the models and optimizers (and, with a ``DistributedOptimizer``,
the algorithm's state: top-k's error feedback is one float per parameter) so that a restore
can bring them back. Per round, interleaved on the 21M-parameter MLP of the step-time benchmark
(Linear 1024->4096->4096->10, SGD with momentum, top-k at density 0.01):

* ``baseline``: a ``TorchState`` over the model and the wrapped ``torch.optim`` optimizer,
  which is what a commit copied before (no algorithm state);
* ``ours``: a ``TorchState`` over the model and the ``DistributedOptimizer``;
* ``step``: one training step, for scale.

Prints the median of each, the ratio ours / baseline and a commit's share of a step.

``--zero-stage 2``: Adam sharded, plain gradient averaging. What a commit copies of the
optimizer, interleaved: the gathered logical state (``copy.deepcopy(opt.state_dict())``, what a
commit copied before) against this rank's slices (``opt.local_state_dict()``, what it copies
now): the time and the bytes of each.

    mpiexec -n 2 python benchmarks/elastic_commit.py [--rounds 7] [--zero-stage 2]
"""
import argparse
import copy
import statistics
import time

import torch

import bagua_mpi as bm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--zero-stage", type=int, default=0)
    args = parser.parse_args()
    bm.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 10))
    if args.zero_stage:
        sharded_snapshots(model, args)
        bm.shutdown()
        return
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  algorithm=bm.algorithms.create("topk", density=0.01))
    g = torch.Generator().manual_seed(bm.rank())
    x, y = torch.randn(16, 1024, generator=g), torch.randint(0, 10, (16,), generator=g)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(2):  # bucket profiling, first allocations, the optimizer's momenta
        step()
    states = {"baseline": bm.elastic.TorchState(model, opt.optimizer, epoch=0),
              "ours": bm.elastic.TorchState(model, opt, epoch=0)}
    times = {"baseline": [], "ours": [], "step": []}
    for _ in range(args.rounds):
        bm.barrier()
        start = time.perf_counter()
        step()
        times["step"].append(time.perf_counter() - start)
        for name, state in states.items():
            bm.barrier()
            start = time.perf_counter()
            state.commit()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    if bm.rank() == 0:
        print(f"ranks {bm.size()}, rounds {args.rounds}, medians in ms")
        print(f"step {median['step']:.1f}  commit: baseline {median['baseline']:.1f}  "
              f"ours {median['ours']:.1f}  ours/baseline {median['ours'] / median['baseline']:.2f}"
              f"  ours/step {median['ours'] / median['step']:.2f}")
    opt.close()
    bm.shutdown()


def tensor_bytes(tree) -> int:
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def sharded_snapshots(model, args) -> None:
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                  named_parameters=model.named_parameters(),
                                  zero_stage=args.zero_stage)
    g = torch.Generator().manual_seed(bm.rank())
    x, y = torch.randn(16, 1024, generator=g), torch.randint(0, 10, (16,), generator=g)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ways = {"gathered": lambda: copy.deepcopy(opt.state_dict()),
            "local": lambda: copy.deepcopy(opt.local_state_dict())}
    times, sizes = {name: [] for name in ways}, {}
    for _ in range(args.rounds):
        for name, take in ways.items():
            bm.barrier()
            start = time.perf_counter()
            sizes[name] = tensor_bytes(take())
            times[name].append(time.perf_counter() - start)
    if bm.rank() == 0:
        median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"ranks {bm.size()}, zero_stage {args.zero_stage}, rounds {args.rounds}")
        print(f"gathered {median['gathered']:.1f} ms {sizes['gathered'] / 1e6:.1f} MB  "
              f"local {median['local']:.1f} ms {sizes['local'] / 1e6:.1f} MB  "
              f"local/gathered time {median['local'] / median['gathered']:.2f}")
    opt.close()


if __name__ == "__main__":
    main()
