"""``torch.optim.Optimizer``'s hook API on the wrappers, which do not run its ``__init__``.

``DistributedOptimizer`` derives from ``torch.optim.Optimizer`` for ``isinstance`` checks and
owns the user's optimizer instead of being one, so the tables that ``Optimizer.__init__``
creates, and the wrapping of ``step`` that runs them, were missing:
``opt.register_step_post_hook(fn)`` raised ``AttributeError``. Here:

* ``HookTable``: each of torch's six per-instance tables, created empty on first use, so
  torch's own ``register_*_hook`` methods (and their removable handles) work unchanged, on
  every subclass;
* ``runs_step_hooks``: wraps a wrapper's ``step`` as torch wraps an optimizer's: pre-hooks
  get ``(optimizer, args, kwargs)`` (``args`` starting with the optimizer) and may return new
  ``(args, kwargs)``; post-hooks get the same after the step. Nested calls (a subclass's
  ``step`` calling ``super().step()``) run them once. Torch's global step hooks run where they
  always did, in the wrapped optimizer's own ``step``;
* ``step_in_place_of``: where the wrapped optimizer's ``step`` is not called (ZeRO; 1-bit
  Adam's compressed stage), its own step hooks and an LR scheduler's record of the step, as if
  it had been;
* ``state_dict_hooks`` / ``load_state_dict_hooks``: run the state-dict tables around the
  wrapper's own ``state_dict`` and ``load_state_dict``, as torch's methods do.

The hooks see the wrapper (its ``param_groups`` are the wrapped optimizer's) and, for the step
hooks, run around the whole distributed step: after the exchange has averaged the gradients
(which the step's last backward pass normally finished) and, for the algorithms that average
models, after that exchange too.
"""
from __future__ import annotations

import functools
from collections import OrderedDict

TABLES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
          "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
          "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
_RUNNING = "_running_step_hooks"


class HookTable:
    """A per-instance ``OrderedDict`` created on first access (a non-data descriptor: once
    created, the instance's own attribute is found first)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj.__dict__.setdefault(self.name, OrderedDict())


def runs_step_hooks(step):
    """``step`` with the instance's step pre- and post-hooks around it (see the module)."""
    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        if self.__dict__.get(_RUNNING):
            return step(self, *args, **kwargs)
        self.__dict__[_RUNNING] = True
        try:
            return run_step_hooks(self, step, (self, *args), kwargs)
        finally:
            self.__dict__[_RUNNING] = False
    return wrapper


def run_step_hooks(optimizer, step, args: tuple, kwargs: dict):
    """``step(*args, **kwargs)`` with ``optimizer``'s per-instance step hooks around it, as
    torch runs them around an optimizer's own ``step`` (``args`` starts with ``optimizer``)."""
    for hook in tuple(optimizer._optimizer_step_pre_hooks.values()):
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"a step pre-hook must return None or a tuple of "
                                   f"(new_args, new_kwargs), got {result!r}")
            args, kwargs = result
    out = step(*args, **kwargs)
    for hook in tuple(optimizer._optimizer_step_post_hooks.values()):
        hook(optimizer, args, kwargs)
    return out


def step_in_place_of(optimizer, step, closure=None):
    """``step(optimizer, closure)`` standing in for ``optimizer.step(closure)``, which is never
    called (ZeRO steps another optimizer over this rank's slices; 1-bit Adam's compressed stage
    updates the parameters itself): ``optimizer``'s own step
    hooks run around it, and an LR scheduler built on ``optimizer`` learns that it stepped.
    Torch's scheduler reads that from the flag its wrapper of ``optimizer.step`` sets; without
    it, its first ``step()`` warned that the optimizer had not stepped."""
    out = run_step_hooks(optimizer, step, (optimizer,) if closure is None
                         else (optimizer, closure), {})
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True
    return out


def state_dict_hooks(state_dict):
    """``state_dict`` with the instance's state-dict pre-hooks before it and post-hooks after
    it (a post-hook may return a replacement)."""
    @functools.wraps(state_dict)
    def wrapper(self):
        for hook in tuple(self._optimizer_state_dict_pre_hooks.values()):
            hook(self)
        result = state_dict(self)
        for hook in tuple(self._optimizer_state_dict_post_hooks.values()):
            replaced = hook(self, result)
            if replaced is not None:
                result = replaced
        return result
    return wrapper


def load_state_dict_hooks(load_state_dict):
    """``load_state_dict`` with the instance's pre-hooks (which may return a replacement
    state dict) before it and post-hooks after it."""
    @functools.wraps(load_state_dict)
    def wrapper(self, state_dict):
        for hook in tuple(self._optimizer_load_state_dict_pre_hooks.values()):
            replaced = hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        load_state_dict(self, state_dict)
        for hook in tuple(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)
    return wrapper
