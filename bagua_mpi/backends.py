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
ranks on one GPU, so ``auto`` picks MPI when a node has more ranks than GPUs. Every rank must
come to the same library (``wire``): ``DistributedOptimizer`` compares them at wrap time, turns
``auto`` decisions that differ between nodes into MPI everywhere and refuses explicit choices
that differ with ``MismatchError``; an allreduce that runs on NCCL says so in its agreement
check (``collectives._allreduce``), so ranks whose routes differ raise there instead of hang.

The user-facing collectives (``bagua_mpi.allreduce`` and friends) follow the same device rule
for dense allreduces of CUDA tensors on the global set; host tensors go through MPI there
whatever the backend.
"""
from __future__ import annotations

import logging
import os

from .exceptions import BaguaMPIError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "mpi", "nccl", "nccl_hierarchical", "gloo")
NCCL_BACKENDS = ("nccl", "nccl_hierarchical")
ENV = "BAGUA_MPI_BACKEND"


class BackendError(BaguaMPIError, ValueError):
    """An unknown backend name (from ``init(backend=)``, an optimizer or ``BAGUA_MPI_BACKEND``)."""


class BackendUnavailableError(BaguaMPIError):
    """The chosen backend cannot run here: no CUDA GPU, or no NCCL in this torch build."""


_default: str | None = None  # set by init(backend=); None: the environment decides
_described: set = set()  # choices already logged (each is logged once per process)
_node_ranks: int | None = None  # ranks on this node, told by init (None: ask the launcher)


def resolve(name: str | None = None) -> str:
    """The backend to use: ``name``, else ``init``'s choice, else ``BAGUA_MPI_BACKEND``, else
    ``auto``. Raises ``BackendError`` for an unknown name."""
    if name is None:
        name = _default
    if name is None:
        from . import config
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


def set_node_ranks(count: int | None) -> None:
    """``init`` tells how many ranks share this node (NCCL needs a GPU for each)."""
    global _node_ranks
    _node_ranks = count


def local_ranks() -> int:
    """Ranks on this node: as ``init`` found them, else what the launcher says, else 1."""
    if _node_ranks is not None:
        return _node_ranks
    for var in ("SLURM_NTASKS_PER_NODE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(var, "").split("(")[0]
        if value.isdigit():
            return int(value)
    return 1


def auto_device_backend() -> tuple[str, str]:
    """What ``auto`` uses for device payloads here: (``"nccl"`` or ``"mpi"``, why)."""
    missing = nccl_missing()
    if missing is not None:
        return "mpi", f"NCCL cannot run: {missing}"
    import torch

    gpus, ranks = torch.cuda.device_count(), local_ranks()
    if ranks > gpus:
        return "mpi", (f"{ranks} ranks share this node's {gpus} GPU(s), and NCCL refuses two "
                       f"ranks on one GPU")
    return "nccl", f"torch has NCCL {_nccl_version()} and each of {ranks} local rank(s) has a GPU"


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
        text = "nccl" if carrier == "nccl" else f"mpi ({_mpi_device_form()})"
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


def reset() -> None:
    """Forget ``init``'s choice and the process groups (``shutdown``)."""
    global _default, _node_ranks
    from . import process_groups

    process_groups.reset()
    _default = _node_ranks = None
