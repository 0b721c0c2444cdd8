"""Data-parallel training of an MLP on synthetic data: the README's main job.

    mpiexec -n 4 python examples/train_mlp.py [--steps 50] [--hidden 1024] [--batch 64]
                                              [--algorithm gradient_allreduce] [--optimizer auto]
                                              [--device auto] [--plot mlp_loss.png]
                                              [--progress auto]

Each rank generates its own shard of a fixed synthetic regression problem (no downloads); the
optimizer is wrapped in ``bagua_mpi.DistributedOptimizer``, whose communication algorithm is
chosen with ``--algorithm`` (``--list-algorithms`` shows the registered ones). The optimizer is
SGD with momentum, or Adam for the algorithms built on Adam (onebit_adam). Each rank trains on
its GPU where torch sees one (``--device``), else on the CPU. Rank 0 shows the
progress (``bagua_mpi.progress``: a tqdm bar on a terminal, plain lines in a log) with the loss
averaged over ranks, then a summary (throughput, time spent waiting for communication, bytes
sent per step) and writes the loss curve to a PNG. tqdm and matplotlib (the ``examples``
extra) are optional here: without them, plain lines and no plot.
"""
from __future__ import annotations

import argparse

import torch

import bagua_mpi as bm
from bagua_mpi.progress import Progress, plot_loss_curve


def make_model(inputs: int, hidden: int, layers: int, outputs: int) -> torch.nn.Module:
    blocks, width = [], inputs
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    blocks.append(torch.nn.Linear(width, outputs))
    return torch.nn.Sequential(*blocks)


# the learning rate each optimizer gets unless --lr is given
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3}


def optimizer_kind(algorithm: str, requested: str) -> str:
    """'sgd' or 'adam': what ``--optimizer`` asked for, or with 'auto' what the algorithm needs
    (1-bit Adam replaces Adam's step and wraps only Adam or AdamW)."""
    if requested != "auto":
        return requested
    return "adam" if algorithm == "onebit_adam" else "sgd"


def make_optimizer(kind: str, params, lr: float | None) -> torch.optim.Optimizer:
    lr = DEFAULT_LR[kind] if lr is None else lr
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def training_device(requested: str) -> torch.device:
    """This rank's device. ``cuda`` (and ``auto`` where torch sees a GPU) takes visible device
    local rank % count and makes it current: the rank's own GPU whether each rank sees all of
    the node's GPUs or only its own (``slurm/bind_gpu.sh``)."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA GPU on rank "
                         f"{bm.rank()}; use --device cpu or auto")
    index = bm.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def synthetic_batch(step: int, rank: int, batch: int, inputs: int, teacher: torch.nn.Module):
    """A batch of this rank's data shard: inputs from a seeded RNG (on the CPU, so every device
    trains on the same data), targets from a teacher on the model's device."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(batch, inputs, generator=gen).to(next(teacher.parameters()).device)
    with torch.no_grad():
        y = teacher(x)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=None,
                        help=f"learning rate (default: {DEFAULT_LR['sgd']} for SGD, "
                             f"{DEFAULT_LR['adam']} for Adam)")
    parser.add_argument("--algorithm", default="gradient_allreduce")
    parser.add_argument("--optimizer", default="auto", choices=["auto", "sgd", "adam"],
                        help="auto: Adam for onebit_adam, else SGD with momentum 0.9")
    parser.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: this rank's GPU where torch sees one, else the CPU")
    parser.add_argument("--list-algorithms", action="store_true")
    parser.add_argument("--plot", default="mlp_loss.png",
                        help="where rank 0 writes the loss curve PNG ('' for none)")
    parser.add_argument("--progress", default="auto", choices=["auto", "bar", "plain"],
                        help="a bar on a terminal and plain lines elsewhere, or either always")
    args = parser.parse_args()
    if args.list_algorithms:
        print("\n".join(bm.algorithms.names()))
        return

    bm.init()
    device = training_device(args.device)
    torch.manual_seed(0)  # same initial model everywhere; broadcast keeps it so regardless
    model = make_model(args.inputs, args.hidden, args.layers, 1).to(device)
    teacher = make_model(args.inputs, 64, 1, 1).to(device)
    bm.broadcast_parameters(model.state_dict(), root_rank=0)
    bm.broadcast_parameters(teacher.state_dict(), root_rank=0)
    kind = optimizer_kind(args.algorithm, args.optimizer)
    optimizer = bm.DistributedOptimizer(
        make_optimizer(kind, model.parameters(), args.lr),
        named_parameters=model.named_parameters(), algorithm=args.algorithm,
        compression=args.compression)
    n_params = sum(p.numel() for p in model.parameters())
    if bm.rank() == 0:
        print(f"{bm.size()} ranks, MLP with {n_params / 1e6:.2f}M parameters, "
              f"{args.batch} samples per rank per step"
              + (f", on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
              flush=True)

    # every 10 steps the loss is averaged over ranks (one tiny allreduce) for the display
    with Progress(args.steps, samples_per_step=args.batch * bm.size(), optimizer=optimizer,
                  every=10, reduce_loss=bm.allreduce, mode=args.progress,
                  desc=f"MLP on {bm.size()} ranks") as progress:
        for step in range(args.steps):
            x, y = synthetic_batch(step, bm.rank(), args.batch, args.inputs, teacher)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # gradient buckets are communicated while backward runs
            optimizer.step()
            progress.step(loss)
    if args.plot:  # the same on every rank: all of them take part in the allreduce
        losses = bm.allreduce(progress.losses())  # every step's loss, averaged over ranks
        if bm.rank() == 0:
            write_plot(args, losses)
    optimizer.close()
    bm.shutdown()


def write_plot(args, losses: torch.Tensor) -> None:
    """Rank 0's loss curve PNG; skipped with a note where matplotlib is not installed (the
    main job runs with the core dependencies alone)."""
    title = (f"MLP {args.layers}x{args.hidden}, {bm.size()} ranks x {args.batch} samples, "
             f"{args.algorithm}")
    try:
        path = plot_loss_curve(args.plot, losses.tolist(), title=title,
                               ylabel="MSE (mean over ranks)")
    except ImportError:
        print("no loss plot: matplotlib is not installed (pip install 'bagua_mpi[examples]')",
              flush=True)
        return
    print(f"loss plot {path}", flush=True)


if __name__ == "__main__":
    main()
