"""Per-layer views of a bucket, for algorithms that treat each parameter on its own
(L-GreCo's per-layer levels, PowerSGD's matrices) instead of the bucket as one vector."""
from __future__ import annotations

import torch

from .. import collectives
from ..ops import Sum


def host_layer_grads(bucket):
    """Yield (layer index, gradient as a contiguous 1-D host float32 tensor, tensor to copy
    the result back into, or None when the gradient itself is reduced in place).

    In-place when the gradient already is host float32 and contiguous (a slice of the
    flattened bucket, or a parameter's own ``.grad``); otherwise staged through a host float32
    copy (half precision, CUDA, non-contiguous), which ``copy_back`` returns.
    """
    for k, (layer, p) in enumerate(zip(bucket.indices, bucket.params)):
        if bucket.flat_grad is not None:
            off = bucket.offsets[k]
            grad = bucket.flat_grad[off:off + p.numel()]
        else:
            grad = p.grad.detach()
        flat = grad.reshape(-1)
        if flat.dtype == torch.float32 and not flat.is_cuda and flat.is_contiguous() \
                and flat.data_ptr() == grad.data_ptr():
            yield layer, flat, None
        else:
            yield layer, flat.to(device="cpu", dtype=torch.float32).contiguous(), grad


def copy_back(layers) -> None:
    """Write staged results (from ``host_layer_grads``) back into the gradients."""
    for _, g, target in layers:
        if target is not None:
            target.copy_(g.view_as(target))


def dense_allreduce_(tensors: list[torch.Tensor], ctx, wire) -> None:
    """Average (per ``ctx``'s pre/postscale) several host tensors in one float32 allreduce."""
    if not tensors:
        return
    fused = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    collectives.allreduce_(fused, Sum, prescale_factor=ctx.prescale,
                           postscale_factor=ctx.postscale, hierarchical=False, check=False)
    wire.allreduce(fused.numel() * fused.element_size(), ctx.topo.size)
    if fused is not tensors[0]:
        offset = 0
        for t in tensors:
            t.copy_(fused[offset:offset + t.numel()])
            offset += t.numel()
