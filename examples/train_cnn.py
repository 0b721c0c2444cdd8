"""A small CNN on generated images, with a progress bar and a loss plot (no downloads).

    mpiexec -n 4 python examples/train_cnn.py [--steps 150] [--plot cnn_loss.png]

Each image is 16x16 pixels of noise with one shape drawn at a random place: a horizontal bar,
a vertical bar, a diagonal or a hollow square (the four classes). Every rank generates its own
shard from seeded generators; the optimizer is wrapped in ``bagua_mpi.DistributedOptimizer``.
Rank 0 shows a tqdm progress bar with the loss averaged over ranks, then evaluates on fresh
images and writes the loss curve to a PNG with matplotlib.

Needs the ``examples`` extra: ``pip install "bagua_mpi[examples]"`` (tqdm, matplotlib).
"""
from __future__ import annotations

import argparse
import sys

import torch

import bagua_mpi as bm

SIZE = 16
CLASSES = ("horizontal bar", "vertical bar", "diagonal", "square")


def make_images(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy images with one random shape each, and their class labels."""
    labels = torch.randint(len(CLASSES), (n,), generator=gen)
    images = 0.3 * torch.randn(n, 1, SIZE, SIZE, generator=gen)
    corners = torch.randint(1, SIZE - 7, (n, 2), generator=gen)
    for i, (label, (r, c)) in enumerate(zip(labels.tolist(), corners.tolist())):
        img = images[i, 0]
        if label == 0:
            img[r + 3, c:c + 6] += 1.0
        elif label == 1:
            img[r:r + 6, c + 3] += 1.0
        elif label == 2:
            idx = torch.arange(6)
            img[r + idx, c + idx] += 1.0
        else:
            img[r, c:c + 6] += 1.0
            img[r + 5, c:c + 6] += 1.0
            img[r:r + 6, c] += 1.0
            img[r:r + 6, c + 5] += 1.0
    return images, labels


class SmallCNN(torch.nn.Module):
    def __init__(self, classes: int = len(CLASSES)):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.head = torch.nn.Linear(16 * (SIZE // 4) ** 2, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--algorithm", default="gradient_allreduce")
    parser.add_argument("--plot", default="cnn_loss.png", help="where rank 0 writes the PNG")
    parser.add_argument("--no-progress", action="store_true", help="plain lines, no bar")
    args = parser.parse_args()
    try:
        from tqdm import tqdm
        import matplotlib
    except ImportError as exc:
        sys.exit(f"this example needs tqdm and matplotlib ({exc}): "
                 "pip install 'bagua_mpi[examples]'")

    bm.init()
    rank, size = bm.rank(), bm.size()
    torch.manual_seed(0)
    model = SmallCNN()
    bm.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  algorithm=args.algorithm)
    gen = torch.Generator().manual_seed(1234 + rank)  # this rank's shard of the data
    losses = torch.zeros(args.steps)
    bar = tqdm(total=args.steps, desc=f"CNN on {size} ranks", unit="step",
               disable=rank != 0 or args.no_progress)
    for step in range(args.steps):
        x, y = make_images(args.batch, gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses[step] = loss.detach()
        bar.update(1)
        if step % 10 == 0 or step == args.steps - 1:
            mean = bm.allreduce(loss.detach()).item()
            bar.set_postfix(loss=f"{mean:.3f}")
            if args.no_progress and rank == 0:
                print(f"step {step:4d}  loss {mean:.4f}", flush=True)
    bar.close()

    losses = bm.allreduce(losses)  # the mean over ranks of every step's loss
    model.eval()
    with torch.no_grad():
        x, y = make_images(512, torch.Generator().manual_seed(99_000 + rank))
        correct = (model(x).argmax(1) == y).sum()
    accuracy = bm.allreduce(correct.double(), op=bm.Sum).item() / (512 * size)
    if rank == 0:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, args.steps + 1), losses.numpy(), lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (mean over ranks)")
        ax.set_yscale("log")
        ax.set_title(f"SmallCNN, {size} ranks x {args.batch} images, {args.algorithm}")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"final loss {losses[-10:].mean():.4f}, accuracy on fresh images "
              f"{accuracy:.3f}, loss plot {args.plot}", flush=True)
    opt.close()
    bm.shutdown()


if __name__ == "__main__":
    main()
