"""Which library carries the payloads: the backend choice, checked and explained.

=====================  ===============================  ==========================================
backend                device (CUDA) payloads           host payloads
=====================  ===============================  ==========================================
``auto`` (default)     NCCL when torch has it and each   MPI
                       local rank has a GPU of its own,
                       else MPI as below
``mpi``                MPI: device buffers when it is    MPI
                       CUDA-aware, else through pinned
                       host buffers
``nccl``               NCCL                              MPI
``nccl_hierarchical``  NCCL; a dense gradient            MPI
                       allreduce on every rank runs
                       NCCL inside each node and MPI
                       among the node leaders
``gloo``               MPI, as ``mpi``                   torch.distributed's gloo: the process-
                                                         group plane NCCL runs, on host tensors
                                                         (how CI tests that code without a GPU)
=====================  ===============================  ==========================================

"Payload" is everything an algorithm exchanges: dense gradients, compressed chunks, top-k
pairs, low-rank factors, models. ``transport.py`` routes each exchange by where its buffers
live and what this module decides. The choice is made per optimizer
(``DistributedOptimizer(backend=...)``), else by ``bagua_mpi.init(backend=...)``, else
``BAGUA_MPI_BACKEND``, else ``auto``. An explicit choice that cannot run here (``nccl`` without
a GPU or without NCCL in torch, ``gloo`` without torch.distributed) raises
``BackendUnavailableError`` naming what is missing; only ``auto`` falls back, and it says why
(``describe``, logged once and shown as ``DistributedOptimizer.backend``). NCCL refuses two
ranks on one GPU, so ``auto`` picks MPI on a node where two ranks map to one GPU: ``init``
gathers each local rank's GPU by its UUID (``learn_node_gpus``), so ranks that each see only
their own GPU (numbered 0 in every process) take NCCL; wrapping an optimizer replaces that
mapping with the GPUs its model is on (``use_model_gpus``). Every rank must
come to the same library (``wire``): ``DistributedOptimizer`` compares them at wrap time, turns
``auto`` decisions that differ between nodes into MPI everywhere and refuses explicit choices
that differ with ``MismatchError``; an allreduce that runs on NCCL says so in its agreement
check (``collectives._allreduce``), so ranks whose routes differ raise there instead of hang.

The user-facing collectives (``bagua_mpi.allreduce`` and friends) of CUDA tensors follow the
same device rule, on process sets too; host tensors go through MPI there, except the data
movement (allgather, broadcast, alltoall, reducescatter) of torch tensors under ``gloo``.
"""
from __future__ import annotations

import logging
import os

from . import config
from .consistency import ranks_text
from .exceptions import BaguaMPIError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "mpi", "nccl", "nccl_hierarchical", "gloo")
NCCL_BACKENDS = ("nccl", "nccl_hierarchical")
ENV = "BAGUA_MPI_BACKEND"


class BackendError(BaguaMPIError, ValueError):
    """An unknown backend name (from ``init(backend=)``, an optimizer or ``BAGUA_MPI_BACKEND``)."""


class BackendUnavailableError(BaguaMPIError):
    """The chosen backend cannot run here: no CUDA GPU, no NCCL in this torch build, or no
    gloo in its torch.distributed."""


_default: str | None = None  # set by init(backend=); None: the environment decides
_described: set = set()  # choices already logged (each is logged once per process)
_node_ranks: int | None = None  # ranks on this node, told by init (None: ask the launcher)
# per local rank of this node, its GPU or None: init's mapping (``gpu_of``), then the GPUs the
# models are on (``use_model_gpus``, at each optimizer's wrap)
_node_gpus: list | None = None


def resolve(name: str | None = None) -> str:
    """The backend to use: ``name``, else ``init``'s choice, else ``BAGUA_MPI_BACKEND``, else
    ``auto``. Raises ``BackendError`` for an unknown name."""
    if name is None:
        name = _default
    if name is None:
        return config.backend()  # ConfigError naming BAGUA_MPI_BACKEND when malformed
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise BackendError(f"backend={name!r} is not a backend; valid: {', '.join(BACKENDS)}")
    return name.lower()


def nccl_missing() -> str | None:
    """Why NCCL cannot run in this process (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return (f"no CUDA GPU (torch.cuda.is_available() is False; torch "
                f"{torch.__version__})")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available() or not hasattr(
            dist, "ProcessGroupNCCL"):
        return (f"this torch ({torch.__version__}) was built without NCCL "
                f"(torch.distributed.is_nccl_available() is False)")
    return None


def check_available(name: str) -> None:
    """Raise ``BackendUnavailableError`` when backend ``name`` cannot run in this process."""
    if name in ("mpi", "auto"):
        return
    if name == "gloo":
        import torch.distributed as dist

        if not dist.is_available() or not hasattr(dist, "ProcessGroupGloo"):
            raise BackendUnavailableError("backend='gloo' needs torch.distributed with gloo, "
                                          "and this torch has none; use backend='mpi'")
        return
    missing = nccl_missing()
    if missing is not None:
        need = "a CUDA GPU" if "GPU" in missing else "NCCL"
        raise BackendUnavailableError(f"backend={name!r} needs {need}, and there is {missing}"
                                      f"; use backend='mpi' or 'auto'")


def set_default(name: str | None) -> None:
    """``init(backend=)``: the process-wide choice (None: the environment decides). Checked
    at once, so a missing GPU or NCCL fails at init, not at the first step."""
    global _default
    if name is not None:
        name = resolve(name)
        check_available(name)
    _default = name


def gpu_of(local_rank: int) -> tuple[str, str] | None:
    """The GPU local rank ``local_rank`` maps to, as (an id of the physical device, its name);
    None without a GPU. The mapping is visible device ``local_rank % count``: the local
    rank's own device when every rank sees all of the node's GPUs, and device 0 when each
    rank sees only its own (``slurm/bind_gpu.sh``, Slurm's ``--gpus-per-task=1``)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return gpu_id(local_rank % torch.cuda.device_count())


def gpu_id(index: int) -> tuple[str, str]:
    """(an id, the name) of visible CUDA device ``index``. The id is the device's UUID, the
    same whatever number ``CUDA_VISIBLE_DEVICES`` gives the device in a process, so two ranks
    that each see one GPU are told apart by it. Reading the properties initializes torch's
    CUDA state but makes no CUDA context."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid), props.name
    # an older torch: the PCI address names the device as well
    return (f"PCI {props.pci_domain_id:04x}:{props.pci_bus_id:02x}:"
            f"{props.pci_device_id:02x}", props.name)


def learn_node_gpus(intra) -> None:
    """Collective over ``intra``, this node's ranks (``init`` calls it): gather which GPU each
    local rank maps to (``gpu_of``), so that ``auto`` takes NCCL exactly when no two of them
    share one. A rank whose GPU cannot be read counts as having none (``auto`` then takes
    MPI on this node) and logs why."""
    global _node_gpus, _node_ranks
    try:
        mine = gpu_of(intra.Get_rank())
    except Exception as exc:  # noqa: BLE001 - a broken driver: decide as without a GPU
        logger.warning("bagua_mpi: the GPU of local rank %d cannot be read (%s: %s); "
                       "backend='auto' takes MPI on this node", intra.Get_rank(),
                       type(exc).__name__, exc)
        mine = None
    _node_gpus = intra.allgather(mine)
    _node_ranks = len(_node_gpus)


def model_gpu(param) -> tuple[str, str] | None:
    """``gpu_id`` of the GPU a model's parameter is on; None on the CPU."""
    return gpu_id(param.device.index) if param.is_cuda else None


def use_model_gpus(node_gpus: list) -> None:
    """The GPUs the node's ranks keep their models on (``DistributedOptimizer`` gathers them
    when it wraps: ``gpu_id`` of each rank's parameters, None for a CPU model) replace
    ``init``'s mapping, which assumed local rank % count; nothing changes where every model
    is on the CPU. Ranks that ``init`` mapped to GPUs of their own but whose models share one
    (a script that moved its model to ``cuda`` without ``torch.cuda.set_device``) are warned
    about: ``auto`` then takes MPI, and an explicit NCCL is refused."""
    global _node_gpus
    if all(gpu is None for gpu in node_gpus):
        return
    mapped_apart = shared_gpus() == []
    _node_gpus = list(node_gpus)
    shared = shared_gpus()
    if shared and mapped_apart:
        logger.warning("bagua_mpi: %s; call torch.cuda.set_device(bm.local_rank() %% "
                       "torch.cuda.device_count()) before moving the model to the GPU",
                       sharing_text())


def off_current_device(model_gpus: set, current: int | None) -> str:
    """Why a CUDA model's GPUs (device indices) leave out the calling thread's current CUDA
    device, in words; "" where they include it, or for a CPU model. The library runs each of
    its operations with its tensors' device current, but whatever asks for the current
    device (``torch.empty(..., device="cuda")``, a CUDA context made at first use) would get
    another GPU than the model's, moved to ``cuda:k`` without ``torch.cuda.set_device(k)``."""
    if not model_gpus or current is None or current in model_gpus:
        return ""
    on = ", ".join(f"cuda:{i}" for i in sorted(model_gpus))
    return (f"the model is on {on} but this thread's current CUDA device is cuda:{current}; "
            f"call torch.cuda.set_device({min(model_gpus)}) before wrapping the optimizer "
            f"(whatever asks for the current device would get another GPU than the model's)")


def sharing_text() -> str:
    """Which of this node's local ranks share a GPU, in words ("" where none do, or where
    nothing was gathered)."""
    shared = shared_gpus()
    if not shared:
        return ""
    first = shared[0]
    uuid, name = _node_gpus[first[0]]
    more = f" (and {len(shared) - 1} more GPU(s) shared)" if len(shared) > 1 else ""
    return f"local {ranks_text(first)} on one GPU ({name}, {uuid}){more}"


def local_ranks() -> int:
    """Ranks on this node: as ``init`` found them, else what the launcher says, else 1."""
    if _node_ranks is not None:
        return _node_ranks
    for var in ("SLURM_NTASKS_PER_NODE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(var, "").split("(")[0]
        if value.isdigit():
            return int(value)
    return 1


def shared_gpus() -> list[list[int]] | None:
    """The groups of this node's local ranks that map to one GPU (each group in rank order;
    empty when every rank has its own), or None where ``init`` has not gathered them."""
    if _node_gpus is None:
        return None
    ranks_of: dict = {}
    for local_rank, gpu in enumerate(_node_gpus):
        if gpu is not None:
            ranks_of.setdefault(gpu[0], []).append(local_rank)
    return [ranks for ranks in ranks_of.values() if len(ranks) > 1]


def auto_device_backend() -> tuple[str, str]:
    """What ``auto`` uses for device payloads here: (``"nccl"`` or ``"mpi"``, why)."""
    missing = nccl_missing()
    if missing is not None:
        return "mpi", f"NCCL cannot run: {missing}"
    shared = shared_gpus()
    if shared is None:  # before init: count the GPUs this process sees
        import torch

        gpus, ranks = torch.cuda.device_count(), local_ranks()
        if ranks > gpus:
            return "mpi", (f"{ranks} ranks share this node's {gpus} GPU(s), and NCCL refuses "
                           f"two ranks on one GPU")
    else:
        ranks = len(_node_gpus)
        without = [r for r, gpu in enumerate(_node_gpus) if gpu is None]
        if without:
            return "mpi", f"local {ranks_text(without)} of this node without a GPU"
        if shared:
            return "mpi", f"{sharing_text()}, and NCCL refuses two ranks on one GPU"
    return "nccl", (f"torch has NCCL {_nccl_version()} and each of {ranks} local rank(s) has "
                    f"a GPU of its own")


def auto_backend() -> tuple[str, str]:
    """(backend, one-line reason) that ``auto`` picks for a CUDA model here."""
    name, why = auto_device_backend()
    if name == "mpi":
        return "mpi", f"{why}; MPI carries device payloads ({_mpi_device_form()})"
    return name, why


def wire(name: str, device_type: str) -> str:
    """The libraries that carry the payloads of a ``device_type`` model under backend ``name``:
    ``"nccl"``, ``"nccl_hierarchical"``, ``"mpi"`` or ``"gloo"``, and for a CUDA model under
    ``gloo`` ``"mpi (host payloads: gloo)"``. Every rank of a job must come to the same one
    (``DistributedOptimizer`` checks at wrap time): a rank on NCCL and a rank on MPI would each
    wait for the other in a library the other never calls. MPI on device buffers and MPI
    through pinned host buffers are one wire."""
    host = host_carrier(name)
    if device_type != "cuda":
        return host
    device = _device_wire(name)
    return device if host == "mpi" else f"{device} (host payloads: {host})"


def _device_wire(name: str) -> str:
    if name in NCCL_BACKENDS:
        check_available(name)
        return name
    if name == "auto" and auto_device_backend()[0] == "nccl":
        return "nccl"
    return "mpi"


def why_wire(name: str, device_type: str) -> str:
    """How this rank came to ``wire(name, device_type)``: the setting, and ``auto``'s reason."""
    if name == "auto" and device_type == "cuda":
        return f"backend='auto': {auto_device_backend()[1]}"
    return f"backend={name!r}"


def device_carrier(name: str) -> str:
    """Who moves device payloads under backend ``name``: ``"nccl"``, ``"mpi_device"``
    (CUDA-aware MPI) or ``"mpi_staged"`` (pinned host buffers)."""
    if _device_wire(name) != "mpi":
        return "nccl"
    from .cuda import mpi_is_cuda_aware

    return "mpi_device" if mpi_is_cuda_aware() else "mpi_staged"


def host_carrier(name: str) -> str:
    """Who moves host payloads under backend ``name``: ``"gloo"`` or ``"mpi"``."""
    return "gloo" if name == "gloo" else "mpi"


def describe(name: str, device_type: str) -> str:
    """What backend ``name`` means for a model on ``device_type`` (e.g. ``"nccl"``, ``"mpi
    (pinned host staging)"``); logged once per distinct answer."""
    if device_type == "cuda":
        carrier = device_carrier(name)
        # the form too: nccl_hierarchical runs NCCL in each node and MPI among the leaders
        form = name if name == "nccl_hierarchical" else "nccl"
        text = form if carrier == "nccl" else f"mpi ({_mpi_device_form()})"
        if name == "auto":
            text = f"auto: {text}"
    else:
        text = "gloo" if host_carrier(name) == "gloo" else "mpi"
    if text not in _described:
        _described.add(text)
        reason = f" ({auto_backend()[1]})" if name == "auto" and device_type == "cuda" else ""
        logger.info("bagua_mpi: payloads of %s models go through %s%s", device_type, text,
                    reason)
    return text


def _mpi_device_form() -> str:
    from .cuda import mpi_is_cuda_aware

    return "CUDA-aware" if mpi_is_cuda_aware() else "pinned host staging"


def _nccl_version() -> str:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without the version query
        return "(version unknown)"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def reset(finish: bool = True) -> None:
    """Forget ``init``'s choice and shut the process groups down (``shutdown``; ``finish``:
    after their queued work, else at once)."""
    global _default, _node_ranks, _node_gpus
    from . import process_groups

    process_groups.reset(finish)
    _default = _node_ranks = _node_gpus = None
