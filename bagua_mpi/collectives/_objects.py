"""Collectives without tensors: ``barrier`` and the picklable-object collectives
(``broadcast_object``, ``allgather_object``). They run on the executor like the others, in
program order with any pending asynchronous work."""
from __future__ import annotations

from .. import runtime
from ._core import agree, global_process_set, root_of, topo_of


def barrier(process_set=global_process_set) -> None:
    """Block until every rank (of ``process_set``) reaches this point (behind any pending
    asynchronous work)."""
    rt = runtime.get()
    topo = topo_of(rt, process_set)

    def run():
        agree(topo.comm, ("barrier",))
        topo.comm.Barrier()

    rt.worker.run(run, ("barrier",))


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=global_process_set):
    """Send a picklable object from ``root_rank`` to all ranks (pickle in transit only)."""
    rt = runtime.get()
    topo = topo_of(rt, process_set)
    root = root_of(rt, root_rank, process_set)

    def run():
        agree(topo.comm, ("broadcast_object", ("root", root)))
        return topo.comm.bcast(obj, root=root)

    return rt.worker.run(run, ("broadcast_object", root))


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """List of every rank's object, in rank order."""
    rt = runtime.get()
    topo = topo_of(rt, process_set)

    def run():
        agree(topo.comm, ("allgather_object",))
        return topo.comm.allgather(obj)

    return rt.worker.run(run, ("allgather_object",))
