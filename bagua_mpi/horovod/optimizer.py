"""``DistributedOptimizer`` with Horovod's signature, over bagua_mpi's optimizer.

Horovod: ``DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
groups=None, sparse_as_dense=False, process_set=global_process_set)``. This subclass takes
exactly that (positionally too), maps it onto ``bagua_mpi.optimizer.DistributedOptimizer``
(whose extra keywords, ``algorithm=``, ``bucket_size_mb=``..., pass through) and adds
Horovod's public attributes and its warning for ``step()`` after ``synchronize()``.

* ``num_groups=k`` / ``groups=k``: about k fused buckets (bucket size = parameter bytes / k);
  ``groups=[[p, ...], ...]`` (explicit groups) is approximated the same way with
  k = len(groups) and a warning: buckets follow gradient readiness, not the given groups.
* ``sparse_as_dense``: as Horovod: False (default) exchanges sparse gradients sparse (an
  allgather of every rank's rows, coalesced; ``p.grad`` stays sparse), True densifies them.
* ``process_set``: data parallelism inside the set's sub-communicator (``ps.topology``),
  passed to the wrapped class as ``process_set=`` (with ``profile_order=False``: the engine
  agrees a profiled order on the global communicator). A rank outside the set gets a
  ``LocalDistributedOptimizer``: plain local steps, no communication (as Horovod).
* ``named_parameters``: checked as Horovod, before anything needs ``init()``; without it the
  names are ``allreduce.noname.<group>.<index>``.
* ``op=Adasum`` gives an ``AdasumDistributedOptimizer`` (a subclass), with the semantics of
  Horovod's ``_DistributedAdasumOptimizer``: Adasum combines the *deltas* of a local
  optimizer step, not the gradients. ``step()`` runs the wrapped optimizer on this rank's own
  gradients (its state, e.g. momentum, stays local), takes ``delta = new - start`` of every
  trainable parameter, reduces the deltas with ``grouped_allreduce(op=Adasum)`` (each
  parameter on its own, as Horovod's per-tensor coefficients) and sets every parameter to
  ``start + adasum(delta)``. Power-of-two rank counts only (``NotImplementedError`` at wrap
  time otherwise, where Horovod raises at the first allreduce); ``gradient_predivide_factor``
  must be 1 (``ValueError``, as Horovod). Unlike Horovod: the deltas are exchanged in
  ``step()`` (not overlapped with backward), ``skip_synchronize()`` is accepted (Horovod
  raises; ``synchronize()`` does nothing in both), a ``process_set`` of power-of-two size
  works (Horovod refuses non-global sets), and the bagua extras (``algorithm=``, bucket and
  overlap options) are refused.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import torch

from .. import collectives, optimizer_hooks, runtime
from .. import optimizer as _base
from ..compression import Compression, Compressor
from ..engine import ownership
from ..algorithms import UnsupportedOptionError
from ..ops import Adasum, Average, ReduceOp
from ..process_sets import ProcessSet, global_process_set


def _not_compression(value) -> TypeError:
    """The third positional argument is Horovod's ``compression``, never guessed to be
    bagua_mpi's ``algorithm`` (which is keyword-only here)."""
    return TypeError(f"DistributedOptimizer's third argument is Horovod's compression, got "
                     f"{value!r}: pass bagua_mpi's algorithm by keyword (algorithm=...)")


def _is_compression(value) -> bool:
    if value is None or isinstance(value, Compressor):
        return True
    if isinstance(value, str):
        return value.lower() in ("none", "fp16", "bf16")
    name = getattr(value, "__name__", type(value).__name__).lower()
    return "compress" in name or "fp16" in name or "bf16" in name or "none" in name


def _named_parameters(optimizer, named_parameters) -> list:
    """Horovod's checks of ``named_parameters``, in its order and before anything needs
    ``init()``: (name, tensor) tuples, unique names, every optimizer parameter named. Without
    it, the names are Horovod's ``allreduce.noname.<group>.<index>`` (unique across groups and
    the same on every rank)."""
    if named_parameters is None:
        return [(f"allreduce.noname.{g}.{i}", p) for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters()")
    seen, dups = set(), []
    for n, _ in named:
        if n in seen and n not in dups:
            dups.append(n)
        seen.add(n)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(map(str, dups)))
    named_ids = {id(p) for _, p in named}
    unnamed = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {len(unnamed)} optimizer "
                         f"parameters were not named (first: shape {tuple(unnamed[0].shape)})")
    return named


def _outside(process_set) -> bool:
    """Whether this rank wraps an optimizer for a registered process set it is not in."""
    return (isinstance(process_set, ProcessSet) and process_set is not global_process_set
            and process_set.process_set_id not in (None, 0) and runtime.is_initialized()
            and process_set.included() is False)


def _is_adasum(op) -> bool:
    try:
        return ReduceOp.parse(op) is Adasum
    except ValueError:
        return False


class DistributedOptimizer(_base.DistributedOptimizer):
    __doc__ = _base.DistributedOptimizer.__doc__

    # (the same parameters as __init__, which is what inspect.signature shows)
    def __new__(cls, optimizer, named_parameters=None, compression=Compression.none,
                backward_passes_per_step: int = 1, op=Average,
                gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                sparse_as_dense: bool = False, process_set=global_process_set, **kwargs):
        if cls is DistributedOptimizer and _outside(process_set):
            cls = LocalDistributedOptimizer  # Horovod: outside the set, plain local steps
        elif cls is DistributedOptimizer and _is_adasum(op):
            cls = AdasumDistributedOptimizer  # Horovod's factory picks its Adasum class too
        return super().__new__(cls)

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step: int = 1, op=Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 sparse_as_dense: bool = False, process_set=global_process_set, **kwargs):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
        if not _is_compression(compression):
            raise _not_compression(compression)
        named = _named_parameters(optimizer, named_parameters)  # as Horovod: before init()
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError(f"num_groups must be a non-negative integer, got {num_groups!r}")
        if groups is not None:
            if isinstance(groups, int) and not isinstance(groups, bool):
                if groups <= 0:
                    raise ValueError(f"groups must be positive, got {groups!r}")
                num_groups = groups
            elif isinstance(groups, (list, tuple)) and all(isinstance(g, (list, tuple))
                                                           for g in groups):
                known = {id(p) for g in optimizer.param_groups for p in g["params"]}
                for g in groups:
                    for p in g:
                        if id(p) not in known:
                            raise ValueError("groups= lists a tensor that is not a parameter "
                                             "of the optimizer")
                num_groups = len(groups)
                warnings.warn("DistributedOptimizer(groups=[...]): explicit groups are "
                              f"approximated by {num_groups} buckets in gradient-ready order",
                              UserWarning, stacklevel=2)
            else:
                raise ValueError("groups must be an integer or a list of lists of parameters, "
                                 f"got {groups!r}")
        if num_groups > 0 and "bucket_size_mb" not in kwargs:
            nbytes = sum(p.numel() * p.element_size() for g in optimizer.param_groups
                         for p in g["params"] if p.requires_grad)
            kwargs["bucket_size_mb"] = max(nbytes / num_groups / 2 ** 20, 1e-6)
        if not isinstance(sparse_as_dense, bool):
            raise ValueError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
        if process_set is not global_process_set and process_set is not None:
            if not isinstance(process_set, ProcessSet):
                raise TypeError(f"process_set must be a ProcessSet, got {process_set!r}")
            if "process_set" not in inspect.signature(_base.DistributedOptimizer).parameters:
                raise ValueError("DistributedOptimizer(process_set=...) needs the optimizer's "
                                 "process_set support (not in this version)")
            kwargs["process_set"] = process_set
            # The engine's profiled bucket order is agreed on the global communicator, which
            # the ranks outside the set do not join: buckets in reverse declaration order
            # (Horovod's assumption) need no agreement.
            kwargs.setdefault("profile_order", False)
        super().__init__(optimizer, named, compression=compression,
                         backward_passes_per_step=backward_passes_per_step, op=op,
                         gradient_predivide_factor=gradient_predivide_factor,
                         sparse_as_dense=sparse_as_dense, **kwargs)
        _keep_arguments(self, backward_passes_per_step, op, gradient_predivide_factor,
                        num_groups, groups, sparse_as_dense, process_set)
        self._parameter_names = {p: n for n, p in named}

    @optimizer_hooks.runs_step_hooks
    def step(self, closure=None):
        if self._synchronized and self._engine.synchronized_for_step() and not self._skip_sync:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                          "optimizer.synchronize(): the gradients are not communicated twice, "
                          "but use skip_synchronize() to say so (as in Horovod)", UserWarning,
                          stacklevel=2)
        return super().step(closure)


class _AdasumAlgorithm:
    """What checkpoints read of an optimizer's algorithm (``name``, ``config()``)."""

    name = "adasum"

    def config(self) -> dict:
        return {"name": self.name}


class _UnbucketedOptimizer(DistributedOptimizer):
    """What the two optimizers without the bucketed engine share (Adasum's and the local one
    of a rank outside the process set): no hooks and no buckets, so nothing happens during
    backward; Horovod's arguments checked and kept as attributes; the checkpoint hooks."""

    def _set_up(self, optimizer, named_parameters, compression, backward_passes_per_step,
                op, gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                process_set, algorithm) -> list:
        """Check the arguments every form checks and keep Horovod's public ones; returns the
        (name, parameter) pairs."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
        if isinstance(optimizer, _base.DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer")
        if not _is_compression(compression):
            raise _not_compression(compression)
        named = _named_parameters(optimizer, named_parameters)
        _check_passes(backward_passes_per_step)
        self.optimizer = optimizer
        self.compression = Compression.parse(compression)
        self.algorithm = algorithm
        self.timeline = None
        self.overlap = False
        self.steps = 0
        self._synchronized = self._skip_sync = False
        _keep_arguments(self, backward_passes_per_step, op, gradient_predivide_factor,
                        num_groups, groups, sparse_as_dense, process_set)
        return named

    def _take_over(self) -> None:
        """Close the bucketed optimizers still hooked on these parameters, as a new
        bucketed one does (``engine/ownership.py``): their hooks would exchange the
        gradients this optimizer steps on."""
        wrapped = [p for g in self.optimizer.param_groups for p in g["params"]]
        ownership.close_replaced(ownership.open_over(wrapped), wrapped,
                                 by=f"the {type(self).__name__}")

    def synchronize(self) -> None:
        """Nothing to wait for: nothing is exchanged during backward."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    @contextlib.contextmanager
    def no_sync(self):
        yield  # backward never communicates here

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def abandon_iteration(self) -> None:
        self._synchronized = False  # backward exchanged nothing: nothing else to drop

    def set_backward_passes_per_step(self, passes: int) -> None:
        _check_passes(passes)
        self.backward_passes_per_step = passes  # gradients accumulate in .grad meanwhile

    @optimizer_hooks.load_state_dict_hooks
    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)
        _base.match_state_layouts(self.optimizer)  # as the bucketed class: fused Adam needs it

    def algorithm_state_dict(self) -> dict:
        return {"config": self.algorithm.config(), "steps": self.steps, "state": {}}

    def load_algorithm_state_dict(self, state: dict) -> None:
        if state.get("config", {}).get("name") != self.algorithm.name:
            raise ValueError(f"algorithm state of {state.get('config', {}).get('name')!r} "
                             f"cannot be loaded into {self.algorithm.name!r}")
        self.steps = int(state["steps"])

    @property
    def buckets(self):
        return None

    def close(self) -> None:
        pass


def _check_passes(passes) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes!r}")


class AdasumDistributedOptimizer(_UnbucketedOptimizer):
    """``DistributedOptimizer(op=Adasum)``: Horovod's delta optimizer (see the module docstring).

    Nothing is communicated during backward: ``step()`` takes a local optimizer step, then
    combines every parameter's delta over the ranks with Adasum and applies the result.
    """

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step: int = 1, op=Adasum,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 sparse_as_dense: bool = False, process_set=global_process_set, **kwargs):
        from ..primitives import adasum
        if process_set is None:
            process_set = global_process_set
        named = self._set_up(optimizer, named_parameters, compression, backward_passes_per_step,
                             Adasum, gradient_predivide_factor, num_groups, groups,
                             sparse_as_dense, process_set, _AdasumAlgorithm())
        if kwargs:
            raise ValueError(f"op=Adasum runs Horovod's delta optimizer: "
                             f"{', '.join(sorted(kwargs))} do not apply to it")
        complex_names = [name for name, p in named if p.is_complex()]
        if complex_names:
            raise UnsupportedOptionError(
                f"op=Adasum is not supported with complex parameters ({len(complex_names)}: "
                f"{', '.join(complex_names[:3])}{', ...' if len(complex_names) > 3 else ''}): "
                "Adasum's dot products are defined for real vectors; use op=Average, which "
                "trains them")
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor not supported with op != Average "
                             "(as Horovod)")
        if not isinstance(sparse_as_dense, bool):
            raise ValueError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
        rt = runtime.get()
        if process_set is global_process_set:
            topo = rt.topo
        else:
            if not isinstance(process_set, ProcessSet):
                raise TypeError(f"process_set must be a ProcessSet, got {process_set!r}")
            topo = process_set.topology
            if topo is None:
                raise ValueError(f"rank {rt.topo.rank} is not in {process_set!r}: only its "
                                 f"ranks may wrap an optimizer for it")
        adasum.check_size(topo.size)
        params, names, self._frozen = _base._trainable_parameters(optimizer, named)
        self._groups = _base.WrappedGroups(optimizer)
        _base.check_models_agree(names, params,
                                 None if process_set is global_process_set else topo)
        self._params = params
        self._parameter_names = dict(zip(params, names))
        self._take_over()

    @optimizer_hooks.runs_step_hooks
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rank = runtime.get().topo.rank
        self._groups.check_unchanged(rank)
        self._frozen.check_untrained(rank)
        # foreach operations: on a GPU a few launches each however many parameters, where an
        # operation per parameter made the step's launches grow with the model's tensors
        params = [p.detach() for p in self._params]
        with torch.no_grad():
            starts = [torch.empty_like(p) for p in params]
            if params:
                torch._foreach_copy_(starts, params)
            self.optimizer.step()
            deltas = torch._foreach_sub(params, starts) if params else []
        if deltas:
            deltas = collectives.grouped_allreduce(deltas, None, None, self.compression, Adasum,
                                                   process_set=self.process_set)
            with torch.no_grad():
                torch._foreach_add_(starts, deltas)  # deltas keep their parameters' dtypes
                torch._foreach_copy_(params, starts)
        self.steps += 1
        return loss

    def communication_stats(self) -> dict:
        raise NotImplementedError("communication_stats() counts the bucketed engine's traffic; "
                                  "op=Adasum exchanges its deltas through grouped_allreduce")

    @property
    def backend(self) -> str:
        return "mpi (Adasum; CUDA deltas staged through host memory)"

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, op=Adasum, "
                f"compression={self.compression!r})")


class LocalDistributedOptimizer(_UnbucketedOptimizer):
    """``DistributedOptimizer(..., process_set=ps)`` on a rank outside ``ps`` (as Horovod).

    Nothing is communicated, ever: no hooks, no buckets, no model check; ``step()`` is the
    wrapped optimizer's own step on this rank's gradients and ``synchronize()`` does nothing.
    The arguments are checked as on the members (names, ``backward_passes_per_step``...).
    """

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step: int = 1, op=Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 sparse_as_dense: bool = False, process_set=global_process_set, **kwargs):
        op = ReduceOp.parse(op)
        named = self._set_up(optimizer, named_parameters, compression, backward_passes_per_step,
                             op, gradient_predivide_factor, num_groups, groups,
                             sparse_as_dense, process_set, _LocalAlgorithm())
        if gradient_predivide_factor != 1.0 and op is not Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average "
                             "(as Horovod)")
        self._parameter_names = {p: n for n, p in named}
        self._take_over()

    @optimizer_hooks.runs_step_hooks
    def step(self, closure=None):
        self._synchronized = False
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.steps += 1
        return loss

    def communication_stats(self) -> dict:
        return {"bytes_sent": 0, "steps": self.steps, "bytes_per_step": 0.0,
                "shared_memory_bytes": 0, "wait_seconds": 0.0, "launches_per_bucket": {},
                "syncs_per_bucket": {}, "allocations_per_bucket": {}}

    @property
    def backend(self) -> str:
        return "none (this rank is outside the optimizer's process set)"

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, local: outside "
                f"{self.process_set!r})")


class _LocalAlgorithm(_AdasumAlgorithm):
    name = "local"


def _keep_arguments(opt, backward_passes_per_step, op, gradient_predivide_factor, num_groups,
                    groups, sparse_as_dense, process_set) -> None:
    """Horovod's public arguments, readable as attributes (every form keeps them)."""
    opt.backward_passes_per_step = backward_passes_per_step
    opt.op = op
    opt.gradient_predivide_factor = gradient_predivide_factor
    opt.num_groups = num_groups
    opt.groups = groups
    opt.sparse_as_dense = sparse_as_dense
    opt.process_set = process_set
