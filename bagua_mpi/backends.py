"""Which library moves device tensors: MPI (the default), or NCCL bootstrapped over MPI.

=====================  ======================================================================
backend                what runs the dense collectives of CUDA tensors
=====================  ======================================================================
``mpi``                MPI (device buffers when it is CUDA-aware, else pinned host staging)
``nccl``               one NCCL communicator over every rank (torch.distributed's
                       ``ProcessGroupNCCL``, made directly: ``torch.distributed``'s global
                       default group is left alone)
``nccl_hierarchical``  NCCL inside each node (sum, then broadcast from the node's first rank),
                       MPI among the node leaders in between
=====================  ======================================================================

Chosen per optimizer (``DistributedOptimizer(backend=...)``), else by
``bagua_mpi.init(backend=...)``, else ``BAGUA_MPI_BACKEND``, else ``mpi``. The NCCL
communicators are bootstrapped over MPI, with no launcher besides ``mpiexec``/``srun``: rank 0
of the group starts a ``TCPStore`` on a free port and broadcasts its address with mpi4py.
Choosing NCCL without a CUDA GPU, or with a torch built without NCCL, raises
``BackendUnavailableError`` naming what is missing; nothing falls back to MPI silently. CPU
tensors always go through MPI (NCCL cannot read host memory); the choice is about device
tensors. NCCL refuses two ranks on one GPU, so on a one-GPU machine NCCL runs at world size 1
only (``tests/gpu/run.sh`` checks exactly that).
"""
from __future__ import annotations

import socket
import threading

from .exceptions import BaguaMPIError

BACKENDS = ("mpi", "nccl", "nccl_hierarchical")
ENV = "BAGUA_MPI_BACKEND"


class BackendError(BaguaMPIError, ValueError):
    """An unknown backend name (from ``init(backend=)``, an optimizer or ``BAGUA_MPI_BACKEND``)."""


class BackendUnavailableError(BaguaMPIError):
    """The chosen backend cannot run here: no CUDA GPU, or no NCCL in this torch build."""


_lock = threading.Lock()
_default: str | None = None  # set by init(backend=); None: the environment decides
_groups: dict = {}  # (kind, id of the MPI communicator) -> NCCLGroup


def resolve(name: str | None = None) -> str:
    """The backend to use: ``name``, else ``init``'s choice, else ``BAGUA_MPI_BACKEND``, else
    ``mpi``. Raises ``BackendError`` for an unknown name."""
    if name is None:
        name = _default
    if name is None:
        from . import config
        return config.backend()  # ConfigError naming BAGUA_MPI_BACKEND when malformed
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise BackendError(f"backend={name!r} is not a backend; valid: {', '.join(BACKENDS)}")
    return name.lower()


def check_available(name: str) -> None:
    """Raise ``BackendUnavailableError`` when backend ``name`` cannot run in this process."""
    if name == "mpi":
        return
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"backend={name!r} needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); use backend='mpi'")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available() or not hasattr(
            dist, "ProcessGroupNCCL"):
        raise BackendUnavailableError(
            f"backend={name!r} needs NCCL, and this torch ({torch.__version__}) was built "
            f"without it (torch.distributed.is_nccl_available() is False); use backend='mpi'")


def set_default(name: str | None) -> None:
    """``init(backend=)``: the process-wide choice (None: the environment decides). Checked
    at once, so a missing GPU or NCCL fails at init, not at the first step."""
    global _default
    if name is not None:
        name = resolve(name)
        check_available(name)
    _default = name


def uses_nccl(tensor, name: str | None = None) -> bool:
    """Whether a dense collective of ``tensor`` goes through NCCL (a CUDA tensor and a NCCL
    backend). Raises when NCCL was chosen but cannot run."""
    if not getattr(tensor, "is_cuda", False):
        return False
    backend = resolve(name)
    if backend == "mpi":
        return False
    check_available(backend)
    return True


class NCCLGroup:
    """A ``ProcessGroupNCCL`` over the ranks of an MPI communicator, bootstrapped over it."""

    def __init__(self, comm):
        import torch
        import torch.distributed as dist

        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        if torch.cuda.is_available():
            torch.cuda.set_device(torch.cuda.current_device())
        address = None
        store = None
        host = _host_address(comm)  # collective: every rank takes part
        if self.rank == 0:
            store = dist.TCPStore(host, 0, self.size, is_master=True, wait_for_workers=False)
            address = (host, store.port)
        address = comm.bcast(address, root=0)
        if store is None:
            store = dist.TCPStore(address[0], address[1], self.size, is_master=False)
        self.store = store  # kept alive: the group's rendezvous lives in it
        # a store of its own per group (rank 0 of each group serves it): no prefix needed
        self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("bagua_mpi/", store), self.rank,
                                        self.size)
        self.comm = comm

    def allreduce_(self, tensor, op: str = "sum") -> None:
        """In place: reduce over the group with ``op`` (sum, min, max, product), on torch's
        current stream (ordered before later work on it)."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = _NCCL_OPS[op]()
        self.pg.allreduce([tensor], opts).wait()

    def broadcast_(self, tensor, root: int = 0) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()


def _op(name):
    def make():
        import torch.distributed as dist
        return getattr(dist.ReduceOp, name)
    return make


_NCCL_OPS = {"sum": _op("SUM"), "min": _op("MIN"), "max": _op("MAX"), "product": _op("PRODUCT")}


def _host_address(comm) -> str:
    """An address rank 0's store is reachable at from every rank of ``comm``: the loopback
    when all ranks share rank 0's host, else the address of rank 0's outward interface (the
    one its default route uses; ``gethostbyname`` often answers 127.0.1.1)."""
    from mpi4py import MPI

    hosts = comm.allgather(MPI.Get_processor_name())
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
    return socket.gethostbyname(socket.gethostname())


def group(comm) -> NCCLGroup:
    """The NCCL group over ``comm`` (made once per communicator; collective on first use)."""
    key = id(comm)
    with _lock:
        found = _groups.get(key)
    if found is None:
        found = NCCLGroup(comm)
        with _lock:
            _groups[key] = found
    return found


def allreduce_(tensor, topo, name: str | None = None, op: str = "sum") -> None:
    """In place: reduce a contiguous CUDA ``tensor`` over every rank of ``topo`` with ``op``
    (sum, min, max, product) and the NCCL backend ``name`` (flat, or hierarchical: NCCL in
    the node, MPI among the leaders)."""
    if op not in _NCCL_OPS:
        raise BackendError(f"op {op!r} has no NCCL reduction; valid: {', '.join(_NCCL_OPS)}")
    backend = resolve(name)
    check_available(backend)
    if backend == "nccl":
        group(topo.comm).allreduce_(tensor, op)
        return
    local = group(topo.intra)
    local.allreduce_(tensor, op)
    if topo.leaders is not None and topo.leaders.Get_size() > 1:
        from mpi4py import MPI

        from .cuda import payload_collective
        mop = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}[op]
        payload_collective(lambda s, r: topo.leaders.Allreduce(s, r, op=mop), tensor,
                           tensor, ("nccl_hierarchical", threading.get_ident()), dense=True)
    local.broadcast_(tensor, 0)


def reset() -> None:
    """Forget the NCCL groups and ``init``'s choice (``shutdown``)."""
    global _default
    with _lock:
        _groups.clear()
    _default = None
