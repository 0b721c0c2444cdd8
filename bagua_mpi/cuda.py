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


class PinnedPool:
    """Host staging buffers for compressed payloads, reused across steps.

    ``get(key, nbytes)`` returns a uint8 NumPy view of ``nbytes`` of the buffer kept under
    ``key`` (e.g. ("clps", "send", thread id)); the buffer is allocated once and only replaced
    when a larger one is asked for, so a training loop allocates in its first step only
    (``allocations`` counts them, for the tests). Page-locked where CUDA is present (fast,
    asynchronous-capable copies); plain host memory otherwise (Numba's CUDA simulator).
    """

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._bufs: dict = {}
        self.allocations = 0

    def get(self, key, nbytes: int):
        import torch

        with self._lock:
            buf = self._bufs.get(key)
            if buf is None or buf.numel() < nbytes:
                size = max(int(nbytes), 1)
                if torch.cuda.is_available():
                    buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                else:
                    buf = torch.empty(size, dtype=torch.uint8)
                self._bufs[key] = buf
                self.allocations += 1
        return buf.numpy()[:nbytes]

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()


pinned_pool = PinnedPool()


def stage_to_host(dev_array, key, stats=None):
    """Copy a 1-D/2-D uint8 Numba device array into the pinned pool buffer ``key``; returns
    the host array (same shape). Counted as a payload copy in ``accounting.staging``."""
    from .accounting import staging

    host = pinned_pool.get(key, dev_array.nbytes).reshape(dev_array.shape)
    dev_array.copy_to_host(host)
    staging.d2h(dev_array.nbytes)
    return host


def stage_to_device(host, dev_array) -> None:
    """Copy a host array back into the device array of the same shape (counted)."""
    from .accounting import staging

    dev_array.copy_to_device(host)
    staging.h2d(host.nbytes)


def _mpi_tensor(t):
    """What mpi4py gets for a CUDA tensor (torch exports no interface for bfloat16)."""
    import torch

    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def payload_collective(call, send, recv, key, dense: bool = False) -> None:
    """``call(send, recv)`` for contiguous CUDA torch tensors holding *payloads* (compressed
    data, PowerSGD's P/Q, top-k pairs): the device tensors themselves with a CUDA-aware MPI,
    else through the pinned pool buffers ``key`` (reused across steps; counted as payload
    copies unless ``dense``). ``recv`` may be ``send`` (an in-place allreduce)."""
    import torch
    from mpi4py import MPI

    from .accounting import staging

    if send.is_cuda:
        torch.cuda.current_stream(send.device).synchronize()  # MPI reads outside torch's stream
    in_place = recv is send
    if mpi_is_cuda_aware():
        call(MPI.IN_PLACE if in_place else _mpi_tensor(send), _mpi_tensor(recv))
        return
    host_send = torch.from_numpy(pinned_pool.get((key, "send"), send.nbytes)).view(
        send.dtype).view(send.shape)
    host_send.copy_(send)
    staging.d2h(send.nbytes, dense=dense)
    if in_place:
        host_recv = host_send
        call(MPI.IN_PLACE, _host(host_recv))
    else:
        host_recv = torch.from_numpy(pinned_pool.get((key, "recv"), recv.nbytes)).view(
            recv.dtype).view(recv.shape)
        call(_host(host_send), _host(host_recv))
    recv.copy_(host_recv)
    staging.h2d(recv.nbytes)


def _host(t):
    from .buffers import host_view

    return host_view(t)
