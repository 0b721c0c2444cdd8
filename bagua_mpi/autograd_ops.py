"""Differentiable collectives (as ``horovod.torch``'s): the backward of each is a collective.

``bagua_mpi.allreduce(t)`` and friends come here when ``t.requires_grad`` and grad mode is on.
The gradients are Horovod's, so models written for Horovod train the same:

* allreduce(op, pre, post): backward = allreduce of the gradient with the same op and factors;
* allgather: backward = Average allreduce of the gradient, this rank's rows;
* broadcast: backward = Average allreduce of the gradient on the root, zeros elsewhere;
* alltoall: backward = alltoall of the gradient with the received splits;
* reducescatter: backward = allgather of the gradient, times the set size for Sum, times
  prescale x postscale;
* the grouped forms: the same per tensor.
"""
from __future__ import annotations

import torch

from . import collectives as C
from .ops import Average, ReduceOp, Sum


def _size(process_set) -> int:
    return C._topo(C.runtime.get(), process_set).size


def _rank(process_set) -> int:
    return C._topo(C.runtime.get(), process_set).rank


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, pre, post, process_set, name, hierarchical):
        ctx.args = (op, pre, post, process_set, hierarchical)
        return C.allreduce(tensor.detach(), None, name, None, op, pre, post, process_set,
                           hierarchical=hierarchical)

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps, hier = ctx.args
        return (C.allreduce(grad.contiguous(), None, None, None, op, pre, post, ps,
                            hierarchical=hier), None, None, None, None, None, None)


def allreduce_grad(tensor, op, pre, post, process_set, name, hierarchical):
    return _Allreduce.apply(tensor, op, pre, post, process_set, name, hierarchical)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, pre, post, process_set, name, hierarchical, *tensors):
        ctx.args = (op, pre, post, process_set, hierarchical)
        return tuple(C.grouped_allreduce([t.detach() for t in tensors], None, name, None, op,
                                         pre, post, process_set, hierarchical=hierarchical))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps, hier = ctx.args
        out = C.grouped_allreduce([g.contiguous() for g in grads], None, None, None, op, pre,
                                  post, ps, hierarchical=hier)
        return (None,) * 6 + tuple(out)


def grouped_allreduce_grad(tensors, op, pre, post, process_set, name, hierarchical):
    return list(_GroupedAllreduce.apply(op, pre, post, process_set, name, hierarchical,
                                        *tensors))


def _gather_slices(grad, rows, process_set):
    """Average allreduce of an allgather's gradient, then this rank's rows."""
    reduced = C.allreduce(grad.contiguous(), op=Average, process_set=process_set)
    me = _rank(process_set)
    start = int(sum(rows[:me]))
    return reduced.narrow(0, start, int(rows[me]))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, process_set, name):
        rt = C.runtime.get()
        x = tensor.detach()
        run, d = C._allgather_run(rt, C._topo(rt, process_set), x)
        out, rows = C._dispatch(rt, run, d, False, name=name)
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
        rt = C.runtime.get()
        run, d = C._grouped_allgather_run(rt, C._topo(rt, process_set),
                                          [t.detach() for t in tensors])
        results = C._dispatch(rt, run, d, False, name=name)
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


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, process_set, name):
        ctx.args = (root_rank, process_set)
        return C.broadcast(tensor.detach(), root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        root, ps = ctx.args
        reduced = C.allreduce(grad.contiguous(), op=Average, process_set=ps)
        if C.runtime.rank() != root:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast_grad(tensor, root_rank, process_set, name):
    return _Broadcast.apply(tensor, root_rank, process_set, name)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set, name, with_splits):
        out, received = C.alltoall(tensor.detach(), splits, name, process_set,
                                   return_received_splits=True)
        ctx.args = (received, process_set)
        if with_splits:
            ctx.mark_non_differentiable(received)
            return out, received
        return out

    @staticmethod
    def backward(ctx, grad, *_):
        received, ps = ctx.args
        back = C.alltoall(grad.contiguous(), received, None, ps, return_received_splits=False)
        return back, None, None, None, None


def alltoall_grad(tensor, splits, process_set, name, with_splits):
    return _Alltoall.apply(tensor, splits, process_set, name, with_splits)


def _scatter_back(grad, op, process_set, pre, post):
    gathered = C.allgather(grad.contiguous(), process_set=process_set)
    factor = pre * post * (_size(process_set) if ReduceOp.parse(op) is Sum else 1)
    return gathered * factor if factor != 1 else gathered


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, process_set, pre, post, name):
        ctx.args = (op, process_set, pre, post)
        return C.reducescatter(tensor.detach(), name, None, op, process_set, pre, post)

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
        return tuple(C.grouped_reducescatter([t.detach() for t in tensors], name, None, op,
                                             process_set, pre, post))

    @staticmethod
    def backward(ctx, *grads):
        op, ps, pre, post = ctx.args
        return (None,) * 5 + tuple(_scatter_back(g, op, ps, pre, post) for g in grads)


def grouped_reducescatter_grad(tensors, op, process_set, pre, post, name):
    return list(_GroupedReducescatter.apply(op, process_set, pre, post, name, *tensors))
