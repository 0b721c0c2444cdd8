"""Horovod's build and feature queries, answered for bagua_mpi (MPI only, via mpi4py)."""
from __future__ import annotations

import torch

from .. import runtime


def mpi_built() -> bool:
    """Always True: every collective runs on MPI (mpi4py)."""
    return True


def mpi_enabled() -> bool:
    """True: MPI is the (only) controller and data transport."""
    return True


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """NCCL's version as an integer (as Horovod) when the optional NCCL backend can run here
    (``init(backend="nccl")``: torch with NCCL and a GPU), else 0: CUDA tensors go through MPI."""
    from .. import backends
    try:
        backends.check_available("nccl")
    except backends.BackendUnavailableError:
        return 0
    import torch
    version = torch.cuda.nccl.version()
    if isinstance(version, tuple):
        major, minor, patch = (list(version) + [0, 0, 0])[:3]
        return major * 1000 + minor * 100 + patch
    return int(version)


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def mlsl_built() -> bool:
    return False


def sycl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when torch has CUDA and a GPU is visible: CUDA tensors are accepted (passed to a
    CUDA-aware MPI directly, else staged through pinned host memory)."""
    return torch.version.cuda is not None and torch.cuda.is_available()


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks (from the local topology)."""
    topo = runtime.get().topo
    return topo.local_size * topo.cross_size == topo.size
