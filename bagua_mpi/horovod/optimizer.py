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
* ``sparse_as_dense``: accepted; gradients are communicated dense either way.
* ``process_set``: data parallelism inside the set's sub-communicator (``ps.topology``),
  passed to the wrapped class as ``process_set=``.
* ``op=Adasum`` is refused (``ValueError``).
"""
from __future__ import annotations

import inspect
import warnings

from .. import optimizer as _base
from ..compression import Compression, Compressor
from ..ops import Average
from ..process_sets import ProcessSet, global_process_set


def _is_compression(value) -> bool:
    if value is None or isinstance(value, Compressor):
        return True
    if isinstance(value, str):
        return value.lower() in ("none", "fp16", "bf16")
    name = getattr(value, "__name__", type(value).__name__).lower()
    return "compress" in name or "fp16" in name or "bf16" in name or "none" in name


class DistributedOptimizer(_base.DistributedOptimizer):
    __doc__ = _base.DistributedOptimizer.__doc__

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step: int = 1, op=Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 sparse_as_dense: bool = False, process_set=global_process_set, **kwargs):
        if not _is_compression(compression):
            # bagua_mpi's own positional order: (optimizer, named_parameters, algorithm, ...)
            if "algorithm" in kwargs:
                raise TypeError("algorithm given twice (positionally and by keyword)")
            kwargs["algorithm"] = compression
            compression = kwargs.pop("compression", Compression.none)
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
        named = list(named_parameters) if named_parameters is not None else None
        super().__init__(optimizer, named, compression=compression,
                         backward_passes_per_step=backward_passes_per_step, op=op,
                         gradient_predivide_factor=gradient_predivide_factor, **kwargs)
        # Horovod's public arguments, readable as attributes.
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.num_groups = num_groups
        self.groups = groups
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        if named is None:
            named = [(f"allreduce.noname.{i}", p) for g in optimizer.param_groups
                     for i, p in enumerate(g["params"])]
        self._parameter_names = {p: n for n, p in named}

    def step(self, closure=None):
        if getattr(self, "_synchronized", False) and not getattr(self, "_skip_sync", False):
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                          "optimizer.synchronize(): the gradients are not communicated twice, "
                          "but use skip_synchronize() to say so (as in Horovod)", UserWarning,
                          stacklevel=2)
        return super().step(closure)
