"""Differentiable collectives (as ``horovod.torch``'s): the backward of each is a collective.

The public ``allreduce`` and friends (``_public.py``) come here when a tensor requires grad
and grad mode is on. The gradients are Horovod's, so models written for Horovod train the same:

* allreduce(op, pre, post): backward = allreduce of the gradient with the same op and factors;
* allgather: backward = Average allreduce of the gradient, this rank's rows;
* broadcast: backward = Average allreduce of the gradient on the root, zeros elsewhere;
* alltoall: backward = alltoall of the gradient with the received splits;
* reducescatter: backward = allgather of the gradient, times the set size for Sum, times
  prescale x postscale;
* the grouped forms: the same per tensor.

Forwards run the plain collectives (``_allreduce.py``, ``_movement.py``) on detached tensors.
A backward run with ``create_graph=True`` gets gradients that require grad themselves: each
backward then takes the differentiable version of its collective again (as the public
functions would pick it), so higher-order gradients flow through too.
"""
from __future__ import annotations

import torch

from .. import runtime
from ..ops import Average, ReduceOp, Sum
from ._allreduce import plain_allreduce, plain_grouped_allreduce
from ._core import topo_of, wants_grad
from ._movement import (allgather_with_rows, grouped_allgather_with_rows, plain_allgather,
                        plain_alltoall, plain_broadcast, plain_grouped_reducescatter,
                        plain_reducescatter)


def _topo(process_set):
    return topo_of(runtime.get(), process_set)


# -- allreduce ---------------------------------------------------------------------------------

class _Allreduce(torch.autograd.Function):
    """The forward's allreduce and the backward's both run under the call's ``check``."""

    @staticmethod
    def forward(ctx, tensor, op, pre, post, process_set, name, hierarchical, check):
        ctx.args = (op, pre, post, process_set, hierarchical, check)
        return plain_allreduce(tensor.detach(), op, name, pre, post, process_set, hierarchical,
                               check)

    @staticmethod
    def backward(ctx, grad):
        return (_differentiable_allreduce(grad.contiguous(), *ctx.args),) + (None,) * 7


def allreduce_grad(tensor, op, pre, post, process_set, name, hierarchical, check=None):
    return _Allreduce.apply(tensor, op, pre, post, process_set, name, hierarchical, check)


def _differentiable_allreduce(tensor, op, pre, post, process_set, hierarchical, check=None):
    """The allreduce of a backward: differentiable again under ``create_graph=True``."""
    if wants_grad(tensor):
        return allreduce_grad(tensor, op, pre, post, process_set, None, hierarchical, check)
    return plain_allreduce(tensor, op, None, pre, post, process_set, hierarchical, check)


class _GroupedAllreduce(torch.autograd.Function):
    """As ``_Allreduce``, for a list of tensors as one fused message."""

    @staticmethod
    def forward(ctx, op, pre, post, process_set, name, hierarchical, check, *tensors):
        ctx.args = (op, pre, post, process_set, hierarchical, check)
        return tuple(plain_grouped_allreduce([t.detach() for t in tensors], op, name, pre,
                                             post, process_set, hierarchical, check))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps, hier, check = ctx.args
        grads = [g.contiguous() for g in grads]
        if any(wants_grad(g) for g in grads):
            out = grouped_allreduce_grad(grads, op, pre, post, ps, None, hier, check)
        else:
            out = plain_grouped_allreduce(grads, op, None, pre, post, ps, hier, check)
        return (None,) * 7 + tuple(out)


def grouped_allreduce_grad(tensors, op, pre, post, process_set, name, hierarchical, check=None):
    return list(_GroupedAllreduce.apply(op, pre, post, process_set, name, hierarchical, check,
                                        *tensors))


# -- allgather ---------------------------------------------------------------------------------

def _gather_slices(grad, rows, process_set):
    """Average allreduce of an allgather's gradient, then this rank's rows."""
    reduced = _differentiable_allreduce(grad.contiguous(), Average, 1.0, 1.0, process_set, None)
    me = _topo(process_set).rank
    start = int(sum(rows[:me]))
    return reduced.narrow(0, start, int(rows[me]))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, process_set, name):
        out, rows = allgather_with_rows(tensor.detach(), process_set, name)
        ctx.args = (process_set, rows.tolist(), tuple(tensor.shape))
        return out

    @staticmethod
    def backward(ctx, grad):
        ps, rows, shape = ctx.args
        return _gather_slices(grad, rows, ps).reshape(shape), None, None


def allgather_grad(tensor, process_set, name):
    return _Allgather.apply(tensor, process_set, name)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, process_set, name, *tensors):
        results = grouped_allgather_with_rows([t.detach() for t in tensors], process_set, name)
        ctx.args = (process_set, [r.tolist() for _, r in results],
                    [tuple(t.shape) for t in tensors])
        return tuple(o for o, _ in results)

    @staticmethod
    def backward(ctx, *grads):
        ps, rows, shapes = ctx.args
        return (None, None) + tuple(_gather_slices(g, r, ps).reshape(s)
                                    for g, r, s in zip(grads, rows, shapes))


def grouped_allgather_grad(tensors, process_set, name):
    return list(_GroupedAllgather.apply(process_set, name, *tensors))


# -- broadcast ---------------------------------------------------------------------------------

class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, process_set, name):
        ctx.args = (root_rank, process_set)
        return plain_broadcast(tensor.detach(), root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        root, ps = ctx.args
        reduced = _differentiable_allreduce(grad.contiguous(), Average, 1.0, 1.0, ps, None)
        if runtime.rank() != root:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast_grad(tensor, root_rank, process_set, name):
    return _Broadcast.apply(tensor, root_rank, process_set, name)


# -- alltoall ----------------------------------------------------------------------------------

class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set, name, with_splits):
        out, received = plain_alltoall(tensor.detach(), splits, name, process_set,
                                       with_splits=True)
        ctx.args = (received, process_set)
        if with_splits:
            ctx.mark_non_differentiable(received)
            return out, received
        return out

    @staticmethod
    def backward(ctx, grad, *_):
        received, ps = ctx.args
        grad = grad.contiguous()
        if wants_grad(grad):
            back = alltoall_grad(grad, received, ps, None, False)
        else:
            back = plain_alltoall(grad, received, None, ps)
        return back, None, None, None, None


def alltoall_grad(tensor, splits, process_set, name, with_splits):
    return _Alltoall.apply(tensor, splits, process_set, name, with_splits)


# -- reducescatter -----------------------------------------------------------------------------

def _scatter_back(grad, op, process_set, pre, post):
    grad = grad.contiguous()
    if wants_grad(grad):
        gathered = allgather_grad(grad, process_set, None)
    else:
        gathered = plain_allgather(grad, None, process_set)
    factor = pre * post * (_topo(process_set).size if ReduceOp.parse(op) is Sum else 1)
    return gathered * factor if factor != 1 else gathered


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, process_set, pre, post, name):
        ctx.args = (op, process_set, pre, post)
        return plain_reducescatter(tensor.detach(), name, op, process_set, pre, post)

    @staticmethod
    def backward(ctx, grad):
        op, ps, pre, post = ctx.args
        return _scatter_back(grad, op, ps, pre, post), None, None, None, None, None


def reducescatter_grad(tensor, op, process_set, pre, post, name):
    return _Reducescatter.apply(tensor, op, process_set, pre, post, name)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, process_set, pre, post, name, *tensors):
        ctx.args = (op, process_set, pre, post)
        return tuple(plain_grouped_reducescatter([t.detach() for t in tensors], name, op,
                                                 process_set, pre, post))

    @staticmethod
    def backward(ctx, *grads):
        op, ps, pre, post = ctx.args
        return (None,) * 5 + tuple(_scatter_back(g, op, ps, pre, post) for g in grads)


def grouped_reducescatter_grad(tensors, op, process_set, pre, post, name):
    return list(_GroupedReducescatter.apply(op, process_set, pre, post, name, *tensors))
