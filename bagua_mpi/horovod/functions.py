"""Horovod's state helpers: ``broadcast_parameters``, ``broadcast_optimizer_state``."""
from __future__ import annotations

import torch

from .. import collectives
from .. import optimizer as _optimizer


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    ``params``: a ``state_dict()``, ``model.named_parameters()`` (a list or the generator),
    or ``model.parameters()`` (tensors without names, broadcast in the given order). Named
    tensors go in sorted-name order, as Horovod's dict case.
    """
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: kv[0])
    else:
        items = list(params)
        if items and all(isinstance(p, tuple) and len(p) == 2 for p in items):
            if all(isinstance(n, str) for n, _ in items):
                items = sorted(items, key=lambda kv: kv[0])
        elif all(torch.is_tensor(p) for p in items):
            items = [(None, p) for p in items]
        else:
            raise ValueError("broadcast_parameters needs a dict, (name, tensor) pairs or "
                             f"tensors, got {type(params).__name__}")
    handles = [collectives.broadcast_async_(t.data if isinstance(t, torch.nn.Parameter) else t,
                                            root_rank) for _, t in items]
    for h in handles:
        collectives.synchronize(h)


def _inner(optimizer):
    return optimizer.optimizer if isinstance(optimizer, _optimizer.DistributedOptimizer) \
        else optimizer


def initialize_optimizer_state(optimizer) -> bool:
    """Create the state of an optimizer that has none yet, as a first step would (Horovod's
    recipe: zero gradients, one step), but leave the parameters, their gradients and step
    counters as they were, so training continues exactly as without this call.
    Returns whether a state was created. Local: no communication."""
    opt = _inner(optimizer)
    if len(opt.state_dict()["state"]) != 0:
        return False
    saved = []
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                saved.append((p, p.detach().clone(), p.grad))
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        opt.step()
        for p, data, grad in saved:
            p.copy_(data)
            p.grad = grad
    for state in opt.state.values():  # a fresh optimizer would count its first step as 1
        step = state.get("step")
        if torch.is_tensor(step):
            step.zero_()
        elif isinstance(step, (int, float)):
            state["step"] = type(step)(0)
    return True


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters.

    As Horovod: an optimizer without state (none of its parameters has stepped yet) is first
    initialised, on every rank, so every rank ends with the same full state. LBFGS is refused.
    """
    if isinstance(_inner(optimizer), torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (as Horovod)")
    initialize_optimizer_state(optimizer)
    _optimizer.broadcast_optimizer_state(optimizer, root_rank)


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=None):
    """Send a picklable object from ``root_rank`` to all ranks (pickle in transit only)."""
    return collectives.broadcast_object(obj, root_rank, name,
                                        process_set or collectives.global_process_set)


def allgather_object(obj, name=None, process_set=None) -> list:
    return collectives.allgather_object(obj, name, process_set or collectives.global_process_set)
