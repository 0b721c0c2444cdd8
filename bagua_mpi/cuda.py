"""The CUDA-aware MPI probe: may device pointers be handed to this MPI?

Decided once per process, in this order (``how_decided`` says which step answered):

1. ``BAGUA_MPI_CUDA_AWARE=1/0`` or ``set_cuda_aware(True/False)``: forced;
2. no CUDA GPU: no;
3. the loaded MPI library's own answer, ``MPIX_Query_cuda_support`` (through mpi4py, or looked
   up in the loaded ``libmpi`` where it exports the symbol): a "no" is final;
4. otherwise (a "yes", or a library that does not say) a device allreduce in a child process
   confirms it, because the library's answer describes how it was built, not whether the
   transport underneath handles device memory at run time, and a non-CUDA-aware MPI usually
   segfaults on a device pointer rather than raising: the child dies, not the job.

How payloads then travel is ``transport.py``'s business.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from . import config

logger = logging.getLogger(__name__)

_aware: bool | None = None
_how: str = "not decided yet"

_PROBE = r"""
import sys, torch
from mpi4py import MPI
x = torch.arange(1024, dtype=torch.float32, device="cuda")
y = torch.zeros_like(x)
torch.cuda.synchronize()
MPI.COMM_SELF.Allreduce([x, MPI.FLOAT], [y, MPI.FLOAT], op=MPI.SUM)
torch.cuda.synchronize()
sys.exit(0 if torch.equal(x, y) else 3)
"""


def mpi_reports_cuda_support() -> bool | None:
    """What the loaded MPI library says of itself (``MPIX_Query_cuda_support``), or None when
    it exports no such query."""
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - mpi4py built without the extension: ask libmpi
            pass
    import ctypes

    path = _loaded_libmpi()
    if path is None:
        return None
    try:
        symbol = ctypes.CDLL(path).MPIX_Query_cuda_support  # already loaded: the same handle
    except (AttributeError, OSError):
        return None
    symbol.restype = ctypes.c_int
    return bool(symbol())


def _loaded_libmpi() -> str | None:
    """The file of the MPI library this process has loaded (mpi4py loads it privately, so its
    symbols are not in the global namespace), from the process's memory map."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libmpi.so"):
                    return path
    except OSError:
        pass
    return None


def probe_cuda_aware(timeout: float = 120.0) -> bool:
    """A device allreduce over ``MPI_COMM_SELF`` in a child process; True if the data arrived
    intact."""
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
    """Whether CUDA tensors go to MPI directly (decided once per process, see above)."""
    global _aware, _how
    if _aware is None:
        _aware, _how = _decide()
        logger.info("bagua_mpi: CUDA-aware MPI: %s (%s)", _aware, _how)
    return _aware


def how_decided() -> str:
    """How ``mpi_is_cuda_aware`` reached its answer (for ``bagua_mpi doctor`` and logs)."""
    mpi_is_cuda_aware()
    return _how


def _decide() -> tuple[bool, str]:
    forced = config.cuda_aware()
    if forced is not None:
        return forced, f"forced by BAGUA_MPI_CUDA_AWARE={int(forced)}"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    reported = mpi_reports_cuda_support()
    if reported is False:
        return False, "the MPI library says no (MPIX_Query_cuda_support)"
    said = "says yes" if reported else "does not say"
    confirmed = probe_cuda_aware()
    return confirmed, (f"the MPI library {said}; a device allreduce in a child process "
                       f"{'worked' if confirmed else 'failed'}")


def set_cuda_aware(value: bool | None) -> None:
    """Force CUDA-aware MPI on or off; ``None`` re-probes on next use."""
    global _aware, _how
    _aware = value
    _how = "set by set_cuda_aware()" if value is not None else "not decided yet"
