"""``sparse_allreduce_async``: a sparse COO tensor reduced by allgathering its indices and
values (as Horovod), so every rank ends with every rank's entries."""
from __future__ import annotations

import torch

from .. import runtime
from ..ops import Average, ReduceOp, Sum
from ..worker import Handle
from ._core import global_process_set, start, topo_of
from ._handles import synchronize
from ._movement import allgather_run


class SparseAllreduceHandle(Handle):
    """A ``Handle`` that is also what Horovod's ``sparse_allreduce_async`` returns: a function
    to call for the result. ``handle()`` and ``synchronize(handle)`` wait alike."""

    __slots__ = ()

    def __call__(self):
        return synchronize(self)


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Allreduce a sparse COO tensor by allgathering its indices and values (as Horovod).

    ``handle()`` (Horovod's way) or ``synchronize(handle)`` returns a sparse tensor of the same
    size whose (uncoalesced) entries are every rank's entries, divided by the number of ranks
    for Average.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async needs a sparse COO torch tensor, got "
                        f"{type(tensor).__name__}")
    op = ReduceOp.parse(op)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async supports Average and Sum, got {op.name}")
    rt = runtime.get()
    topo = topo_of(rt, process_set)
    t = tensor.detach().coalesce()
    run_i, _ = allgather_run(rt, topo, t.indices().t().contiguous())
    run_v, _ = allgather_run(rt, topo, t.values().contiguous())

    def run():
        indices, _ = run_i()
        values, _ = run_v()
        if op is Average:
            values = values / topo.size
        return torch.sparse_coo_tensor(indices.t(), values, t.size(), check_invariants=False)

    handle = start(rt, run, ("sparse_allreduce", op.name, tuple(t.shape)), (t,), name)
    handle.__class__ = SparseAllreduceHandle  # same layout (no slots of its own): callable
    return handle
