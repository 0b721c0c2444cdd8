"""Process sets (Horovod's ``ProcessSet``): collectives over a subset of the ranks.

A registered process set owns an MPI sub-communicator of the library's communicator, split into
node-local / cross-node communicators like the global one: ``ps.topology`` is a
``bagua_mpi.topology.Topology`` over it (``None`` on ranks outside the set), which is what
``DistributedOptimizer(process_set=...)`` and the collectives' ``process_set=`` use.

    ps = bagua_mpi.add_process_set([0, 2])      # collective: every rank calls it
    if ps.included():
        bagua_mpi.allreduce(t, process_set=ps)  # only ranks 0 and 2 take part
    bagua_mpi.remove_process_set(ps)            # collective again

Ranks are ranks of the library's communicator (``bagua_mpi.rank()``); ``root_rank`` arguments
stay global ranks, as in Horovod. ``init(process_sets=[...])`` registers sets at start-up
(also from mpi4py communicators); ``add_process_set`` works at any time (no
``HOROVOD_DYNAMIC_PROCESS_SETS`` needed). ``node_local_process_set()`` and
``cross_node_process_set()`` give the sets of the ranks on this node and of the ranks with this
local rank on every node.
"""
from __future__ import annotations

import weakref

from mpi4py import MPI

from . import process_groups, runtime, topology

_registry: dict[int, "_Entry"] = {}  # process_set_id -> entry (this rank's view)
_by_ranks: dict[tuple, int] = {}
_next_id = 1
_node_id: int | None = None
_hook_installed = False
_special: dict[str, "ProcessSet"] = {}
_objects: "weakref.WeakSet[ProcessSet]" = weakref.WeakSet()  # registered user objects


class _Entry:
    __slots__ = ("ranks", "topology")

    def __init__(self, ranks: tuple, topo):
        self.ranks = ranks
        self.topology = topo


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Build it from a list of ranks or an mpi4py communicator, then register it with
    ``init(process_sets=[...])`` or ``add_process_set``; until then ``process_set_id`` is None.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.ranks = None
        self.mpi_comm = None
        self.topology = None
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet needs a list of ranks or an mpi4py communicator, got "
                             f"{ranks_or_comm!r}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be integers, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks!r}")
        self.ranks = ranks

    def size(self):
        """Number of ranks in the set (None while not registered)."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This rank's index in the set (None while not registered, -1 outside the set)."""
        if self.process_set_id is None:
            return None
        me = runtime.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self):
        """Whether this rank belongs to the set (None while the ranks are unknown)."""
        if self.ranks is None:
            return None
        return runtime.rank() in self.ranks

    @property
    def comm(self):
        """The set's MPI communicator on member ranks (library traffic only), else None."""
        return None if self.topology is None else self.topology.comm

    def __repr__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __str__ = __repr__


class _GlobalProcessSet(ProcessSet):
    """All ranks: the library's own communicator (valid between ``init`` and ``shutdown``)."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self):
        return list(range(runtime.size())) if runtime.is_initialized() else []

    @ranks.setter
    def ranks(self, value):
        pass

    @property
    def topology(self):
        return runtime.get().topo

    @topology.setter
    def topology(self, value):
        pass

    def size(self):
        return runtime.size()

    def rank(self):
        return runtime.rank()

    def included(self):
        return True


global_process_set = _GlobalProcessSet()


def topology_of(ps) -> topology.Topology:
    """The topology a collective with ``process_set=ps`` runs on; ``ValueError`` otherwise."""
    if not isinstance(ps, ProcessSet):
        raise TypeError(f"process_set must be a bagua_mpi.ProcessSet, got {ps!r}")
    if ps.process_set_id == 0:  # the same ranks as the global set
        return runtime.get().topo
    if ps.process_set_id is None or ps.process_set_id not in _registry:
        raise ValueError(f"{ps} is not registered: pass it to init(process_sets=[...]) or "
                         f"add_process_set() first")
    topo = _registry[ps.process_set_id].topology
    if topo is None:
        raise ValueError(f"rank {runtime.rank()} is not in {ps}: only its members may call "
                         f"collectives on it")
    return topo


def set_rank_of(ps, global_rank: int) -> int:
    """Index in ``ps`` of global rank ``global_rank`` (a root); ``ValueError`` if not a member."""
    topology_of(ps)
    ranks = list(range(runtime.size())) if ps.process_set_id == 0 \
        else _registry[ps.process_set_id].ranks
    if global_rank not in ranks:
        raise ValueError(f"root_rank {global_rank} is not in {ps}")
    return ranks.index(global_rank)


def _ranks_of_comm(comm, rt) -> tuple:
    group = comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                          rt.topo.comm.Get_group())
    finally:
        group.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError("the communicator of a ProcessSet has ranks outside bagua_mpi's "
                         "communicator")
    return tuple(sorted(ranks))


def _build_topology(rt, ranks: tuple):
    """Collective over the library's communicator: the sub-communicator of ``ranks`` and its
    node split (nodes as in the global topology, simulated ones included)."""
    global _node_id
    topo = rt.topo
    if _node_id is None:  # the global rank of my node's leader names my node
        _node_id = topo.intra.bcast(topo.rank if topo.local_rank == 0 else None, root=0)
    member = topo.rank in ranks
    sub = topo.comm.Split(0 if member else MPI.UNDEFINED, key=topo.rank)
    if not member:
        return None
    intra = sub.Split(color=_node_id, key=sub.Get_rank())
    inter = sub.Split(color=intra.Get_rank(), key=sub.Get_rank())
    leaders = inter if intra.Get_rank() == 0 else None
    return topology.Topology(sub, intra, inter, leaders, topo.thread_level,
                             topo.simulated_ranks_per_node)


def _register(sets: list, *, duplicates_error: bool) -> None:
    """Register ``sets`` (collective: every rank passes its own list, possibly different sets
    built from communicators); all ranks create the union of distinct sets in one order."""
    rt = runtime.get()
    size = rt.topo.size
    _install_hook()
    mine = []
    for ps in sets:
        if not isinstance(ps, ProcessSet) or isinstance(ps, _GlobalProcessSet):
            raise TypeError(f"expected a ProcessSet, got {ps!r}")
        if ps.ranks is None:
            ps.ranks = list(_ranks_of_comm(ps.mpi_comm, rt))
        bad = [r for r in ps.ranks if not 0 <= r < size]
        if bad or not ps.ranks:
            raise ValueError(f"{ps}: ranks must be a non-empty subset of 0..{size - 1}")
        mine.append(tuple(ps.ranks))

    def run():
        global _next_id
        everyone = rt.topo.comm.allgather(mine)
        order = []
        for lists in everyone:
            for ranks in lists:
                if ranks not in order:
                    order.append(ranks)
        existing = [r for r in order if r in _by_ranks or r == tuple(range(size))]
        if existing and duplicates_error:
            raise ValueError(f"a process set with ranks {list(existing[0])} exists already")
        for ranks in order:
            if ranks in _by_ranks or ranks == tuple(range(size)):
                continue
            pid = _next_id
            _next_id += 1
            _registry[pid] = _Entry(list(ranks), _build_topology(rt, ranks))
            _by_ranks[ranks] = pid

    rt.worker.run(run, ("add_process_set",))
    seen = set()
    for ps in sets:
        ranks = tuple(ps.ranks)
        pid = 0 if ranks == tuple(range(size)) else _by_ranks[ranks]
        if pid in seen and pid != 0:  # a second object for the same set: invalid (Horovod)
            ps.process_set_id = None
            continue
        seen.add(pid)
        _objects.add(ps)
        ps.process_set_id = pid
        ps.topology = rt.topo if pid == 0 else _registry[pid].topology


def add_process_set(process_set) -> ProcessSet:
    """Register a new process set (a ``ProcessSet`` or a list of ranks) and return it.

    Collective: every rank calls it with the same ranks. A set with the same ranks as an
    existing one raises ``ValueError`` (as Horovod).
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise ValueError("add_process_set needs a list of ranks (as Horovod, a set built from "
                         "an MPI communicator can only be registered by init(process_sets=))")
    _register([process_set], duplicates_error=True)
    return process_set


def remove_process_set(process_set) -> bool:
    """Unregister a process set and free its communicators (collective: every rank calls it).
    False for the global set or a set that is not registered."""
    pid = getattr(process_set, "process_set_id", None)
    if pid is None or pid == 0 or pid not in _registry:
        return False
    rt = runtime.get()
    entry = _registry.pop(pid)
    _by_ranks.pop(tuple(entry.ranks), None)
    for key, ps in list(_special.items()):
        if ps.process_set_id == pid:
            del _special[key]
    process_set.process_set_id = None
    process_set.topology = None
    if entry.topology is not None:
        topo = entry.topology
        process_groups.forget((topo.comm, topo.intra, topo.inter))  # leaders: inter or None
        rt.worker.run(topo.free, ("remove_process_set",))
    return True


def node_local_process_set() -> ProcessSet:
    """The ranks on this node (collective on first use; one set per node)."""
    return _special_set("node", lambda t: t.intra)


def cross_node_process_set() -> ProcessSet:
    """The ranks with this rank's local rank, one per node (collective on first use)."""
    return _special_set("cross", lambda t: t.inter)


def _special_set(key: str, comm_of) -> ProcessSet:
    ps = _special.get(key)
    if ps is None:
        rt = runtime.get()
        ps = ProcessSet(list(_ranks_of_comm(comm_of(rt.topo), rt)))
        _register([ps], duplicates_error=False)
        if ps.process_set_id is None:  # same ranks as a set the user registered: reuse it
            pid = _by_ranks.get(tuple(ps.ranks), 0)
            ps.process_set_id = pid
            ps.topology = rt.topo if pid == 0 else _registry[pid].topology
        _special[key] = ps
    return ps


def registered() -> dict[int, list[int]]:
    """process_set_id -> ranks of every registered set (the global set is 0)."""
    out = {0: global_process_set.ranks}
    out.update({pid: list(e.ranks) for pid, e in _registry.items()})
    return out


def init_process_sets(process_sets) -> None:
    """``init(process_sets=...)``: a list of ``ProcessSet`` or ``"dynamic"`` (a no-op here)."""
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, ProcessSet):
        process_sets = [process_sets]
    _register(list(process_sets), duplicates_error=False)


def _install_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        runtime.on_shutdown(_reset)
        _hook_installed = True


def _reset() -> None:
    """At shutdown: free every set's communicators (collective, like the shutdown itself)."""
    global _next_id, _node_id, _hook_installed
    entries = list(_registry.values())
    for ps in list(_objects):  # ids restart at the next init: stale objects must not match
        ps.process_set_id = None
        ps.topology = None
    _objects.clear()
    _registry.clear()
    _by_ranks.clear()
    _special.clear()
    _next_id, _node_id, _hook_installed = 1, None, False
    if runtime.is_initialized():
        rt = runtime.get()

        def free():
            for e in entries:
                if e.topology is not None and not MPI.Is_finalized():
                    e.topology.free()
        rt.worker.run(free, ("free_process_sets",))

