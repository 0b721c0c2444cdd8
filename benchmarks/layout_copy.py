"""What a bucket pays to take a channels_last model's fresh gradients, per step, old against new.

After ``zero_grad()`` (set_to_none, PyTorch's default) autograd hands each parameter a fresh
gradient with the parameter's strides, and the engine copies it into the parameter's view of
its bucket. With row-major views (before) that copy transposes every convolution weight; with
views in the parameter's layout (now) it is a straight copy. Then one SGD-with-momentum step
reads parameter and gradient together (torch's foreach path on the CPU; on CUDA its fast path
needs equal strides, which this CPU benchmark cannot show). Interleaved rounds, one thread.

    python benchmarks/layout_copy.py
"""
import statistics
import time

import torch

from bagua_mpi.layout import autograd_strides


def resnet50_like_weights():
    """The convolution weights of a ResNet-50 (3x3 and 1x1 at its four widths), channels_last."""
    shapes = [(64, 3, 7, 7)]
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for _ in range(blocks):
            shapes += [(width, width * 4, 1, 1), (width, width, 3, 3), (width * 4, width, 1, 1)]
    return [torch.randn(s).to(memory_format=torch.channels_last) for s in shapes]


def run(params, grads, views, opt, rounds=1):
    start = time.perf_counter()
    for _ in range(rounds):
        with torch.no_grad():
            for view, grad in zip(views, grads):
                view.copy_(grad)
        for p, view in zip(params, views):
            p.grad = view
        opt.step()
    return time.perf_counter() - start


def main():
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(w) for w in resnet50_like_weights()]
    grads = [torch.randn_like(p) for p in params]  # autograd's: the parameters' strides
    numel = sum(p.numel() for p in params)
    flat = {k: torch.zeros(numel) for k in ("row-major", "layout")}
    views = {"row-major": [], "layout": []}
    offset = 0
    for p in params:
        piece = {k: f[offset:offset + p.numel()] for k, f in flat.items()}
        views["row-major"].append(piece["row-major"].view_as(p))
        views["layout"].append(piece["layout"].as_strided(p.shape, autograd_strides(p)))
        offset += p.numel()
    opts = {k: torch.optim.SGD(params, lr=1e-4, momentum=0.9) for k in views}
    times = {k: [] for k in views}
    for k in views:
        run(params, grads, views[k], opts[k])  # warm-up
    for _ in range(15):
        for k in views:
            times[k].append(run(params, grads, views[k], opts[k]))
    old, new = statistics.median(times["row-major"]), statistics.median(times["layout"])
    print(f"{len(params)} channels_last weights, {numel / 1e6:.1f}M elements; copy into the "
          f"bucket + SGD momentum step, median of 15 interleaved rounds, 1 thread:")
    print(f"  row-major views (before): {old * 1e3:.1f} ms")
    print(f"  views in the parameter's layout (now): {new * 1e3:.1f} ms  ({new / old:.2f}x)")


if __name__ == "__main__":
    main()
