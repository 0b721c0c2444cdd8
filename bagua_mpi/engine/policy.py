"""Execution choices made from the hardware when the user leaves them open.

**Overlap** (``DistributedOptimizer(overlap=None)``, the default). Overlapping a bucket's
exchange with the rest of backward pays only if the exchange has a processor of its own:

* CUDA gradients: backward runs on the GPU, so the communication thread's CPU work (MPI
  progress, staging, the shared-memory reduction) runs beside it. Overlap on.
* CPU gradients: backward already keeps ``torch.get_num_threads()`` cores of this rank busy.
  The exchange then only time-slices with it (MPI progress spins, and the node-shared reduction
  wants the same memory bandwidth), which measured *slower* than exchanging after backward:
  on 2 cores with 2 ranks, backward 157 -> 193 ms for a 21M-parameter MLP while the exchange
  it hid was 26 ms (``benchmarks/step_time.py``). Overlap is on only when the node has a core
  per rank beyond torch's threads.
"""
from __future__ import annotations

import os

import torch


def cores_per_rank(local_size: int) -> float:
    """Cores this rank has: its CPU binding when the launcher bound it to part of the node
    (``srun --cpu-bind``, ``mpiexec -bind-to``), else the node's cores shared among its ranks."""
    total = os.cpu_count() or 1
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = total
    if mine < total:
        return float(mine)
    return total / max(local_size, 1)


def auto_overlap(params: list[torch.Tensor], topo) -> bool:
    """Overlap communication with backward? (see the module docstring)"""
    if any(p.is_cuda for p in params):
        return True
    return cores_per_rank(topo.local_size) >= torch.get_num_threads() + 1
