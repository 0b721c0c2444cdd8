"""The public out-of-place collectives that have a gradient: ``allreduce``,
``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast``, ``alltoall``,
``reducescatter``, ``grouped_reducescatter``.

Each takes Horovod's arguments, applies ``compression`` around itself, and picks the
differentiable version (``_autograd.py``) for a tensor that requires grad while grad mode is
on, else the plain one (``_allreduce.py``, ``_movement.py``). This module sits above both, so
neither imports it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..ops import Average
from . import _autograd
from ._allreduce import plain_allreduce, plain_grouped_allreduce
from ._complex import allreduce_op, complex_as_real
from ._core import (NO_COMPRESSION, check_list, global_process_set, name_and_op, resolve_op,
                    wants_grad)
from ._movement import (plain_allgather, plain_alltoall, plain_broadcast, plain_grouped_allgather,
                        plain_grouped_reducescatter, plain_reducescatter)


def allreduce(tensor, average=None, name=None, compression=NO_COMPRESSION, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set, *,
              hierarchical=None, check=None):
    """Reduce ``tensor`` over all ranks (of ``process_set``); return the result as a new tensor.

    ``op`` is one of Average (default), Sum, Min, Max, Product, Adasum (Horovod's adaptive
    summation: float tensors, power-of-two rank counts; ``primitives/adasum.py``); the result is
    ``postscale * op(prescale * x_i)``. Average of integer tensors sums, then scales by 1/n and
    truncates toward zero (as Horovod). ``average`` is Horovod's deprecated flag; ``name`` labels
    the operation (timeline, duplicate detection); ``compression`` (``Compression.fp16``...)
    casts before and after. ``hierarchical=True`` uses the two-level algorithm; ``check``
    overrides the agreement check for this call (every rank must pass the same; a
    differentiable call's backward allreduce runs under it too).
    Differentiable: a tensor that requires grad gets the allreduce of its gradient.
    """
    # the small-allreduce path runs through here: the common cases cost no call
    if isinstance(tensor, torch.Tensor) and tensor.is_complex():
        return _complex_allreduce(tensor, average, name, compression, op, prescale_factor,
                                  postscale_factor, process_set, hierarchical=hierarchical,
                                  check=check)
    if op is None and average is None:
        op = Average
    else:
        op = resolve_op(average, op)
    if compression is not NO_COMPRESSION and compression is not None:
        t, ctx = compression.compress(tensor)
        out = allreduce(t, None, name, None, op, prescale_factor, postscale_factor, process_set,
                        hierarchical=hierarchical, check=check)
        return compression.decompress(out, ctx)
    if getattr(tensor, "requires_grad", False) and torch.is_grad_enabled():
        return _autograd.allreduce_grad(tensor, op, prescale_factor, postscale_factor,
                                        process_set, name, hierarchical, check)
    return plain_allreduce(tensor, op, name, prescale_factor, postscale_factor, process_set,
                           hierarchical, check)


_complex_allreduce = complex_as_real(allreduce, allreduce_op)  # its real view, then complex


def grouped_allreduce(tensors: Sequence, average=None, name=None, compression=NO_COMPRESSION,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, *, hierarchical=None,
                      check=None) -> list:
    """Allreduce a list of tensors as one fused message (one per dtype); returns new tensors.
    ``check`` overrides the agreement check for this call, as in ``allreduce``."""
    op = resolve_op(average, op)
    check_list(tensors, "grouped_allreduce")
    if compression is not NO_COMPRESSION and compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        outs = grouped_allreduce([t for t, _ in pairs], None, name, None, op, prescale_factor,
                                 postscale_factor, process_set, hierarchical=hierarchical,
                                 check=check)
        return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]
    if any(wants_grad(t) for t in tensors):
        return _autograd.grouped_allreduce_grad(tensors, op, prescale_factor, postscale_factor,
                                                process_set, name, hierarchical, check)
    return plain_grouped_allreduce(tensors, op, name, prescale_factor, postscale_factor,
                                   process_set, hierarchical, check)


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's tensor along dimension 0 (sizes there may differ by rank).
    Differentiable (backward: average of the gradients, this rank's slice)."""
    if wants_grad(tensor):
        return _autograd.allgather_grad(tensor, process_set, name)
    return plain_allgather(tensor, name, process_set)


def grouped_allgather(tensors: Sequence, name=None, process_set=global_process_set) -> list:
    """``allgather`` of each tensor of a list, in one operation; returns a list."""
    check_list(tensors, "grouped_allgather")
    if any(wants_grad(t) for t in tensors):
        return _autograd.grouped_allgather_grad(tensors, process_set, name)
    return plain_grouped_allgather(tensors, name, process_set)


def broadcast(tensor, root_rank: int = 0, name=None, process_set=global_process_set):
    """Return a copy of ``root_rank``'s tensor on every rank (``root_rank`` is a global rank,
    also with a process set). Differentiable (backward: the root gets the average gradient)."""
    if wants_grad(tensor):
        return _autograd.broadcast_grad(tensor, root_rank, process_set, name)
    return plain_broadcast(tensor, root_rank, name, process_set)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set, *,
             return_received_splits: bool | None = None):
    """Scatter slices of dimension 0 to every rank and gather theirs.

    ``splits[j]`` rows go to rank j (default: equal parts). The result concatenates what each
    rank sent here, in rank order. As Horovod, it is ``(tensor, received_splits)`` when
    ``splits`` is given and the tensor alone otherwise (``return_received_splits`` forces
    either). Differentiable (backward: alltoall of the gradient with the received splits).
    """
    with_splits = splits is not None if return_received_splits is None \
        else bool(return_received_splits)
    if wants_grad(tensor):
        return _autograd.alltoall_grad(tensor, splits, process_set, name, with_splits)
    return plain_alltoall(tensor, splits, name, process_set, with_splits)


def reducescatter(tensor, name=None, compression=NO_COMPRESSION, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over ranks and keep this rank's slice of dimension 0 (see ``reducescatter_rows``).
    Differentiable (backward: allgather of the gradient, as Horovod scales it)."""
    name, op = name_and_op(name, op)
    if compression is not NO_COMPRESSION and compression is not None:
        t, ctx = compression.compress(tensor)
        out = reducescatter(t, name, None, op, process_set, prescale_factor, postscale_factor)
        return compression.decompress(out, ctx)
    if wants_grad(tensor):
        return _autograd.reducescatter_grad(tensor, op, process_set, prescale_factor,
                                            postscale_factor, name)
    return plain_reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor)


def grouped_reducescatter(tensors: Sequence, name=None, compression=NO_COMPRESSION, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    """``reducescatter`` of each tensor of a list, in one operation; returns a list."""
    name, op = name_and_op(name, op)
    check_list(tensors, "grouped_reducescatter")
    if compression is not NO_COMPRESSION and compression is not None:
        pairs = [compression.compress(t) for t in tensors]
        outs = grouped_reducescatter([t for t, _ in pairs], name, None, op, process_set,
                                     prescale_factor, postscale_factor)
        return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]
    if any(wants_grad(t) for t in tensors):
        return _autograd.grouped_reducescatter_grad(tensors, op, process_set, prescale_factor,
                                                    postscale_factor, name)
    return plain_grouped_reducescatter(tensors, name, op, process_set, prescale_factor,
                                       postscale_factor)
