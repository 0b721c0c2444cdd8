"""torch.distributed process groups over the ranks of an MPI communicator, bootstrapped by MPI.

``srun``/``mpiexec`` stay the only launchers: rank 0 of the communicator starts a ``TCPStore``
on a free port and broadcasts its address with mpi4py, and every rank builds the group
(``ProcessGroupNCCL`` for device payloads, ``ProcessGroupGloo`` for host ones) directly over
that store. ``torch.distributed``'s global default group is left alone, so a user's own
``init_process_group`` does not clash with the library's.

Groups are made once per (library, communicator), on first use: the first call is collective
over the communicator, which holds because every use is inside a collective over it (a peer
exchange counts: every rank calls it, one without peers that step too). Each
group keeps its communicator alive, so the ``id`` that keys it cannot be reused while it lives.
A NCCL group makes its NCCL communicator as it is built; every group takes the job's stall
limit as its timeout (``set_timeout``); point-to-point transfers go out in batches
(``ProcessGroup.point_to_point``).
"""
from __future__ import annotations

import datetime
import socket
import threading

from . import config
from .exceptions import CommunicationError

LIBRARIES = ("nccl", "gloo")
STORE_CONNECT_S = 60.0  # how long a rank tries to reach rank 0's store before the group fails

_lock = threading.Lock()
_groups: dict = {}  # (library, id of the MPI communicator) -> ProcessGroup
made = 0  # groups made in this process (a test reads it: one per communicator and library)
_timeout = datetime.timedelta(minutes=10)  # set_timeout
NEVER = datetime.timedelta(days=3650)  # a stall limit of 0 ("never") as a group's timeout


class StoreUnreachableError(CommunicationError):
    """A process group's ranks could not meet in rank 0's store: no address of rank 0's host
    serves the other hosts, or some ranks could not reach it. Raised on every rank of the
    group, naming the address and the ranks; ``BAGUA_MPI_STORE_ADDR`` sets the address."""


def set_timeout(seconds: float) -> None:
    """Groups made from now on give an operation the job's stall limit ``seconds`` plus a
    margin before they fail (0: never). ``init`` passes the stall abort
    (``BAGUA_MPI_STALL_ABORT_S``). A NCCL collective returns to the host at once and waits
    on the device, so the library's watchdog, which watches the host, never sees it hang:
    torch's NCCL watchdog, which ends the process, must keep the job's limit. A gloo operation
    blocks the host, where the library's watchdog sees it: its own timeout (torch's default
    30 minutes) must not cut a longer limit short, and at the limit itself gloo's bare error
    reached the exception hook before the watchdog's abort, with its hang report and flight
    records, which takes the watchdog's next tick and the other ranks' dumps (a few seconds):
    hence the margin."""
    global _timeout
    _timeout = (datetime.timedelta(seconds=seconds + timeout_margin(seconds)) if seconds > 0
                else NEVER)


def timeout_margin(seconds: float) -> float:
    """Seconds a group waits past the job's stall limit ``seconds``: the watchdog's abort
    first (at least 10 s, 5% of long limits)."""
    return max(10.0, 0.05 * seconds)


class ProcessGroup:
    """A torch.distributed process group of ``library`` over the ranks of ``comm``; the verbs
    take contiguous torch tensors the library can read and block until they are usable on
    torch's current stream (NCCL: stream order, not a host wait)."""

    def __init__(self, comm, library: str):
        import torch
        import torch.distributed as dist

        global made
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        # the thread's current GPU (torch without CUDA: a stand-in for NCCL in the tests)
        device = (torch.device("cuda", torch.cuda.current_device())
                  if library == "nccl" and torch.cuda.is_available() else torch.device("cpu"))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.store = _meet_in_store(comm, library)  # kept alive: the group's rendezvous
        self.device = device
        # the same on every rank of the group and apart from every other live group's: the
        # order groups are shut down in (``_close``)
        self.order = (str(getattr(self.store, "host", "")), int(getattr(self.store, "port", 0)))
        # a store of its own per group (rank 0 of each group serves it): no prefix clash
        prefixed = dist.PrefixStore(f"bagua_mpi/{library}/", self.store)
        self.comm = comm
        if library == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, self.rank, self.size, _timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = _timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.size, options)
            # NCCL's communicator for the group, made now while every rank is here: a batch
            # of point-to-point transfers between some of the ranks may then use it, where as
            # the group's first operation it would need all of them (gTop-k's tree and
            # odd-sized random pairings leave ranks out)
            self.allreduce_(torch.zeros(1, device=device))
        made += 1

    def close(self, finish: bool = True) -> None:
        """Shut the group's library down (``_close``): with ``finish``, after the work queued
        on its device; else at once (torch's ``abort``, as a failing process's exit)."""
        if finish and self.device.type == "cuda":
            import torch
            torch.cuda.synchronize(self.device)
        # both are torch's since 2.2; a build without them leaves it to the destructor
        stop = getattr(self.pg, "shutdown" if finish else "abort", None)
        if stop is not None:
            stop()

    def allreduce_(self, tensor, op: str = "sum") -> None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, REDUCE_OPS[op])
        self.pg.allreduce([tensor], opts).wait()

    def reduce_(self, tensor, root: int = 0) -> None:
        import torch.distributed as dist

        opts = dist.ReduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.rootRank = root
        opts.rootTensor = 0
        self.pg.reduce([tensor], opts).wait()

    def broadcast_(self, tensor, root: int = 0) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()

    def alltoall(self, send, recv, send_splits=(), recv_splits=()) -> None:
        """Block k of ``send`` goes to rank k, block j of ``recv`` came from j: equal blocks,
        or ``send_splits``/``recv_splits`` elements per rank (dimension 0)."""
        self.pg.alltoall_base(recv, send, list(recv_splits), list(send_splits)).wait()

    def allgather(self, send, recv) -> None:
        """``recv`` (size x ``send``'s elements) <- every rank's ``send`` in rank order."""
        self.pg._allgather_base(recv, send).wait()

    def reduce_scatter(self, send, recv, op: str = "sum") -> None:
        """``recv`` <- ``op`` over ranks of block ``rank`` of their ``send`` (equal blocks).
        One call for NCCL and gloo alike, so CI's gloo jobs run the call NCCL gets."""
        import torch.distributed as dist

        opts = dist.ReduceScatterOptions()
        opts.reduceOp = getattr(dist.ReduceOp, REDUCE_OPS[op])
        self.pg._reduce_scatter_base(recv, send, opts).wait()

    def send(self, tensor, dest: int, tag: int) -> None:
        self.point_to_point([(tensor, dest)], [], tag)

    def recv(self, tensor, source: int, tag: int) -> None:
        self.point_to_point([], [(tensor, source)], tag)

    def exchange(self, send, recvs: list, peers: list[int], tag: int) -> None:
        """``send`` to every rank in ``peers``, ``recvs[i]`` from ``peers[i]``, all at once."""
        self.point_to_point([(send, peer) for peer in peers], list(zip(recvs, peers)), tag)

    def point_to_point(self, sends: list, recvs: list, tag: int) -> None:
        """Every ``(tensor, peer)`` of ``sends`` sent and of ``recvs`` received as one batch,
        waited on together, so the order of the transfers cannot deadlock and none waits
        for another.

        NCCL (a backend that coalesces): one group call (``_start_coalescing`` ..
        ``_end_coalescing``) on the group's own communicator. torch runs a lone NCCL send or
        receive on a two-rank communicator of its own for that pair of ranks, so gTop-k's
        tree would make about 2 log2(P) of them per rank and random peers up to P - 1, each
        with its own set-up time and buffers. gloo (no coalescing): every transfer is posted
        before any is waited on."""
        if not sends and not recvs:
            return
        if self.pg.supports_coalescing:  # (a Backend's binding takes no device: the batch's)
            self.pg._start_coalescing()
            for tensor, peer in recvs:
                self.pg.recv([tensor], peer, tag)
            for tensor, peer in sends:
                self.pg.send([tensor], peer, tag)
            self.pg._end_coalescing().wait()
            return
        works = [self.pg.recv([tensor], peer, tag) for tensor, peer in recvs]
        works += [self.pg.send([tensor], peer, tag) for tensor, peer in sends]
        for work in works:
            work.wait()


# ReduceOp member names; torch resolves them when a verb runs (import kept lazy)
REDUCE_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX", "product": "PRODUCT"}


def _meet_in_store(comm, library: str):
    """Every rank of ``comm`` connected to one ``TCPStore``, which rank 0 serves; collective.

    1. rank 0 picks the address (``_host_address``) and starts the store on a free port;
    2. the address goes out with mpi4py;
    3. every other rank connects, for at most ``STORE_CONNECT_S``;
    4. the ranks agree on who failed: a store that some rank cannot reach fails every rank
       alike with ``StoreUnreachableError`` (one rank's torch error after minutes, while the
       others waited in NCCL's set-up, would otherwise be the first sign)."""
    import torch.distributed as dist

    host = _host_address(comm)  # collective: every rank takes part
    rank = comm.Get_rank()
    store = address = None
    problem = ""
    if rank == 0 and host is None:
        problem = ("its ranks run on several hosts, and rank 0's host has no address but the "
                   "loopback (no default route; its name resolves to 127.x)")
    elif rank == 0:
        try:
            store = dist.TCPStore(host, 0, comm.Get_size(), is_master=True,
                                  wait_for_workers=False)
            address = (host, store.port)
        except Exception as exc:  # noqa: BLE001 - told to every rank, which all raise
            problem = f"rank 0 could not serve a store at {host}: {type(exc).__name__}: {exc}"
    address, problem = comm.bcast((address, problem[:300]), root=0)
    if address is None:
        raise StoreUnreachableError(
            f"bagua_mpi rank {rank}: the {library} group has no store: {problem}; set "
            f"BAGUA_MPI_STORE_ADDR to an address of rank 0's host that the other hosts reach")
    where = f"{address[0]}:{address[1]}"
    failed = ""
    if store is None:
        try:
            store = dist.TCPStore(address[0], address[1], comm.Get_size(), is_master=False,
                                  timeout=datetime.timedelta(seconds=STORE_CONNECT_S))
            store.set_timeout(_timeout)  # then the group's own limit for its rendezvous
        except Exception as exc:  # noqa: BLE001 - torch's store errors have no common base
            failed = f"{type(exc).__name__}: {exc}"[:300]
    unreachable = {r: why for r, why in enumerate(comm.allgather(failed)) if why}
    if unreachable:
        first = min(unreachable)
        raise StoreUnreachableError(
            f"bagua_mpi rank {rank}: rank(s) {sorted(unreachable)} of the {library} group could "
            f"not reach rank 0's store at {where} within {STORE_CONNECT_S:g} s (rank {first}: "
            f"{unreachable[first]}); set BAGUA_MPI_STORE_ADDR to an address of rank 0's host "
            f"that every host reaches, and check that no firewall closes its ports")
    return store


def _host_address(comm) -> str | None:
    """An address rank 0's store is reachable at from every rank of ``comm``:
    ``BAGUA_MPI_STORE_ADDR`` when set; else the loopback when all ranks share rank 0's host;
    else the address of rank 0's outward interface (the one its default route uses), or what
    its host name resolves to (``gethostbyname`` often answers 127.0.1.1); None where that is
    a loopback address too. Collective."""
    from mpi4py import MPI

    hosts = comm.allgather(MPI.Get_processor_name())
    configured = config.store_address()
    if configured is not None:
        return configured
    if all(h == hosts[0] for h in hosts):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # UDP: no packet is sent
            address = probe.getsockname()[0]
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if address.startswith("127.") else address


def group(comm, library: str = "nccl") -> ProcessGroup:
    """The ``library`` group over ``comm`` (made once per communicator; collective on first
    use)."""
    if library not in LIBRARIES:
        raise ValueError(f"process-group library must be one of {LIBRARIES}, got {library!r}")
    key = (library, id(comm))
    with _lock:
        found = _groups.get(key)
    if found is None:
        found = ProcessGroup(comm, library)
        with _lock:
            _groups[key] = found
    return found


def forget(comms) -> None:
    """Shut down and drop the groups over ``comms``, communicators about to be freed (a
    removed process set's, a closed asynchronous optimizer's); collective over each: each
    group keeps its communicator, store and library resources alive until then."""
    ids = {id(c) for c in comms}
    with _lock:
        gone = [_groups.pop(key) for key in [key for key in _groups if key[1] in ids]]
    _close(gone)


def groups() -> list[ProcessGroup]:
    """The groups made so far (tests and the GPU check look at them)."""
    with _lock:
        return list(_groups.values())


def reset(finish: bool = True) -> None:
    """Shut down and forget every group (``shutdown``; ``finish``: see ``ProcessGroup.close``)."""
    with _lock:
        gone = list(_groups.values())
        _groups.clear()
    _close(gone, finish)


def _close(gone: list[ProcessGroup], finish: bool = True) -> None:
    """Shut ``gone`` down, in the same order on every rank. A group that is only dropped
    leaves it to torch's destructor, which aborts a NCCL communicator under collectives still
    queued on the device and warns that the group was never destroyed. torch's own
    ``destroy_process_group`` shuts groups down in an order every rank shares too: NCCL's abort
    was collective in some versions."""
    for found in sorted(gone, key=lambda g: g.order):
        found.close(finish)
