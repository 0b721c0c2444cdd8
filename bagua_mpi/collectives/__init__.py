"""Horovod-style collectives on the library's private communicator.

Naming grid (as Horovod): ``op`` returns a new tensor, ``op_`` works in place, ``op_async`` and
``op_async_`` return a ``Handle`` for ``poll``/``synchronize``. Inputs are torch tensors (CPU or
CUDA) or NumPy arrays; outputs are of the same kind and device.

Signatures are Horovod's (``horovod.torch``): the same positional order and keywords
(``average=``, ``name=``, ``compression=``, ``op=``, ``prescale_factor``/``postscale_factor``,
``process_set=``), plus this library's keyword-only extras (``hierarchical=``, ``check=``). For
backward compatibility the second positional argument of the allreduce family and of
reducescatter may also be a reduction op (``allreduce(t, Sum)``). Tensors that require a
gradient go through the differentiable versions in ``_autograd``.

Every operation is built in two halves: argument validation runs at once in the caller (bad
arguments raise ``ValueError``/``TypeError`` synchronously, on the rank that passed them), and a
``run`` closure does the MPI work, either inline or on the communication thread (``worker.py``).
Each ``run`` starts with the cross-rank agreement check (``consistency.py``), so a disagreement
raises ``MismatchError`` on every rank instead of a hang.

Modules, each importing only those listed before it:

* ``_core``: the executor hand-off, operation names, the agreement-check switch, argument checks;
* ``_allreduce_backends``: allreducing one buffer in place with MPI or NCCL, and the rule that
  picks which (``uses_nccl_allreduce``);
* ``_allreduce``: allreduce and grouped allreduce without autograd (fast path included);
* ``_movement``: allgather, broadcast, alltoall, reducescatter without autograd;
* ``_handles`` (poll, synchronize, submit), ``_sparse_allreduce``, ``_objects`` (barrier, object
  collectives), ``_join``;
* ``_autograd``: the differentiable versions, built on ``_allreduce`` and ``_movement``;
* ``_public``: the out-of-place collectives that pick ``_autograd`` or the plain version.

``_complex`` (importing only ``_core``) sends complex tensors as their real views: it wraps
every public collective below, and ``allreduce``/``allreduce_`` call it themselves.
"""
from ..exceptions import BaguaMPIError
from ._allreduce import (allreduce_, allreduce_async, allreduce_async_, grouped_allreduce_,
                         grouped_allreduce_async, grouped_allreduce_async_)
from ._allreduce_backends import hierarchical_allreduce_, join_route, uses_nccl_allreduce
from ._core import global_process_set
from ._handles import poll, submit, synchronize
from ._join import join
from ._movement import (allgather_async, alltoall_async, broadcast_, broadcast_async,
                        broadcast_async_, grouped_allgather_async, grouped_reducescatter_async,
                        reducescatter_async, reducescatter_rows)
from ._objects import allgather_object, barrier, broadcast_object
from ._public import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                      grouped_allreduce, grouped_reducescatter, reducescatter)
from ._sparse_allreduce import sparse_allreduce_async
from ._complex import allreduce_op, complex_as_real, reducescatter_op

# complex tensors travel as their real views; the reducing ones take Sum and Average only
# (allreduce and allreduce_ look for a complex tensor themselves: their small-tensor path is
# latency-bound, and a wrapper's call would cost it 0.5-1 us)
allreduce_async, allreduce_async_ = (complex_as_real(f, allreduce_op)
                                     for f in (allreduce_async, allreduce_async_))
grouped_allreduce, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_ = (
    complex_as_real(f, allreduce_op) for f in (
        grouped_allreduce, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_))
reducescatter, reducescatter_async, grouped_reducescatter, grouped_reducescatter_async = (
    complex_as_real(f, reducescatter_op) for f in (
        reducescatter, reducescatter_async, grouped_reducescatter, grouped_reducescatter_async))
(allgather, allgather_async, grouped_allgather, grouped_allgather_async, broadcast, broadcast_,
 broadcast_async, broadcast_async_, alltoall, alltoall_async) = (
    complex_as_real(f) for f in (
        allgather, allgather_async, grouped_allgather, grouped_allgather_async, broadcast,
        broadcast_, broadcast_async, broadcast_async_, alltoall, alltoall_async))

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier",
    "broadcast_object", "allgather_object", "poll", "synchronize", "submit",
    "hierarchical_allreduce_", "reducescatter_rows", "global_process_set", "BaguaMPIError",
]
