"""CUDA support: is the MPI CUDA-aware, and pinned host staging when it is not.

Whether device pointers may be handed to MPI is decided by a real probe, because
``MPIX_Query_cuda_support`` only says how the library was built, not whether the transport
underneath works with device memory at run time. The probe runs in a child process (a
non-CUDA-aware MPI usually segfaults on a device pointer; the child dies, not the job): it sends
a device buffer to itself over ``MPI_COMM_SELF`` and checks what arrives. The result is cached per
process; ``BAGUA_MPI_CUDA_AWARE=1/0`` or ``set_cuda_aware(True/False)`` skip it.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from . import config

logger = logging.getLogger(__name__)

_aware: bool | None = None

_PROBE = r"""
import sys, torch
from mpi4py import MPI
x = torch.arange(1024, dtype=torch.float32, device="cuda")
y = torch.zeros_like(x)
torch.cuda.synchronize()
req = MPI.COMM_SELF.Isend([x, MPI.FLOAT], dest=0, tag=7)
MPI.COMM_SELF.Recv([y, MPI.FLOAT], source=0, tag=7)
req.Wait()
torch.cuda.synchronize()
sys.exit(0 if torch.equal(x, y) else 3)
"""


def mpi_reports_cuda_support() -> bool | None:
    """What the MPI library says of itself (``MPIX_Query_cuda_support``), if it says anything."""
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return None
    try:
        return bool(query())
    except Exception:  # noqa: BLE001 - an MPI without the extension
        return None


def probe_cuda_aware(timeout: float = 120.0) -> bool:
    """Send a CUDA buffer to self in a child MPI process; True if the data arrived intact."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_CVAR_CH4_", "OMPI_", "SLURM_"))}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, timeout=timeout,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        logger.warning("bagua_mpi: CUDA-aware MPI probe timed out; staging through host memory")
        return False
    if proc.returncode != 0:
        logger.info("bagua_mpi: CUDA-aware MPI probe failed (exit %s): %s", proc.returncode,
                    proc.stderr.strip()[-500:])
    return proc.returncode == 0


def mpi_is_cuda_aware() -> bool:
    """Whether CUDA tensors go to MPI directly (decided once per process)."""
    global _aware
    if _aware is None:
        forced = config.cuda_aware()
        if forced is not None:
            _aware = forced
        else:
            import torch

            _aware = torch.cuda.is_available() and probe_cuda_aware()
            logger.info("bagua_mpi: CUDA-aware MPI: %s (library reports %s)", _aware,
                        mpi_reports_cuda_support())
    return _aware


def set_cuda_aware(value: bool | None) -> None:
    """Force CUDA-aware MPI on or off; ``None`` re-probes on next use."""
    global _aware
    _aware = value


def pinned_empty(shape, dtype):
    """A page-locked host tensor (torch caches these allocations)."""
    import torch

    return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
