"""Bridges between a torch model and the flat NumPy vectors the shards hold.

    flat = flat_parameters(model)                  # initial vector for worker 0's init=
    step_fn = model_step_fn(model, loss_fn)        # for DownpourWorker.run / run_downpour
    load_flat(model, final_vector)                 # after gather_vector at the end
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch


def _params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    return params


def flat_parameters(model: torch.nn.Module, dtype=np.float32) -> np.ndarray:
    """A copy of the trainable parameters as one vector, in ``model.parameters()`` order."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).cpu() for p in _params(model)]
                         ).numpy().astype(dtype, copy=True)


def load_flat(model: torch.nn.Module, flat: np.ndarray) -> None:
    """Copy a flat vector into the model's trainable parameters (in place)."""
    params = _params(model)
    numel = sum(p.numel() for p in params)
    if np.shape(flat) != (numel,):
        raise ValueError(f"the model has {numel} trainable parameters, got a vector of shape "
                         f"{np.shape(flat)}")
    src = torch.from_numpy(np.array(flat, copy=True))
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(src[offset:offset + n].view_as(p))
            offset += n


def model_step_fn(model: torch.nn.Module,
                  loss_fn: Callable[[torch.nn.Module, int], torch.Tensor]):
    """A Downpour ``step_fn`` from ``loss_fn(model, step) -> scalar loss tensor``.

    Each call loads the worker's current copy into the model, runs ``loss_fn`` and backward,
    and returns ``(loss, flat gradient)``; parameters that got no gradient count as zero.
    """
    params = _params(model)

    def step_fn(flat: np.ndarray, step: int):
        load_flat(model, flat)
        for p in params:
            p.grad = None
        loss = loss_fn(model, step)
        loss.backward()
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])
        return float(loss.detach()), grad.cpu().numpy().astype(flat.dtype, copy=False)

    return step_fn
