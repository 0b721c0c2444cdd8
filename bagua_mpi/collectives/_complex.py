"""Complex tensors in the collectives: each travels as its real view (``torch.view_as_real``,
a trailing dimension of 2 holding the real and imaginary parts), as torch.distributed sends them.

Moving data (broadcast, allgather, alltoall) needs nothing more. Sum and Average are the same
on the parts as on the complex numbers, so the allreduce and reducescatter families take them;
Min, Max and Product are not (and Adasum is defined for real vectors), so those raise
``TypeError`` naming the operation. Results come back complex: a new tensor is viewed as
complex, an in-place operation returns the tensor it was given, and an asynchronous one's
handle returns either when synchronized. Real tensors pass straight through (one type check).
"""
from __future__ import annotations

import functools
import inspect

import torch

from ..ops import ReduceOp
from ..worker import Handle
from ._core import chosen_op, name_and_op

_SUMMABLE = ("Sum", "Average")


def _complex(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_complex()


def _any_complex(tensor) -> bool:
    if isinstance(tensor, (list, tuple)):
        return any(_complex(t) for t in tensor)
    return _complex(tensor)


def _as_real(tensor):
    if isinstance(tensor, (list, tuple)):
        return type(tensor)(_as_real(t) for t in tensor)
    return torch.view_as_real(tensor) if _complex(tensor) else tensor


def _restore(result, given):
    """``result`` of the call on the real views, as the caller's tensors would have it."""
    if isinstance(result, Handle):
        return result.then(lambda r: _restore(r, given))
    if isinstance(given, (list, tuple)):
        return [_restore(r, g) for r, g in zip(result, given)]
    if isinstance(result, tuple):  # alltoall's (tensor, received splits)
        return (_restore(result[0], given),) + result[1:]
    if not _complex(given):
        return result
    if result.data_ptr() == given.data_ptr() and result.dim() == given.dim() + 1:
        return given  # in place: the real view of the caller's own tensor
    return torch.view_as_complex(result)


def allreduce_op(arguments) -> object:
    """The op an allreduce-family call asks for (its bound arguments), as the call resolves it."""
    return chosen_op(arguments.get("average"), arguments.get("op"))


def reducescatter_op(arguments) -> object:
    """The op a reducescatter-family call asks for (its bound arguments)."""
    return name_and_op(arguments.get("name"), arguments.get("op", "Average"))[1]


def complex_as_real(fn, op_of=None):
    """``fn`` (a collective whose first argument is a tensor or a list of them) taking complex
    tensors as their real views; ``op_of`` (``allreduce_op``/``reducescatter_op``) names the
    reduction a call asks for, for the collectives that reduce."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(tensor, *args, **kwargs):
        if not _any_complex(tensor):
            return fn(tensor, *args, **kwargs)
        if op_of is not None:
            bound = signature.bind(tensor, *args, **kwargs).arguments
            op = op_of(bound)
            try:
                op_name = ReduceOp.parse(op).name
            except ValueError:
                op_name = None  # fn raises its own error for an unknown op
            if op_name is not None and op_name not in _SUMMABLE:
                raise TypeError(f"{fn.__name__}: complex tensors can be summed or averaged "
                                f"(their real and imaginary parts apart), not reduced with "
                                f"{op_name}")
        return _restore(fn(_as_real(tensor), *args, **kwargs), tensor)

    return call
