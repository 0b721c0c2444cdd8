"""Counting the torch operations a piece of code dispatches: the launch count a CPU can see.

On a GPU every operation that computes or copies is at least one kernel launch, a few
microseconds of host time each; allocations and views launch nothing. ``DispatchCount`` counts
the operations dispatched from Python (the top level: what a composite operation does inside
is not seen) on the calling thread, by kind, for tests and benchmarks that a count does not
grow with the number of tensors. ``cuda_kernels`` counts what a GPU really launched (all
threads), from torch's profiler.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class DispatchCount(TorchDispatchMode):
    """``with DispatchCount() as c: ...``; then ``c.launches`` (operations that compute or copy),
    ``c.allocations`` and ``c.views``, and ``c.names`` (each launching operation's name)."""

    def __init__(self):
        super().__init__()
        self.launches = self.allocations = self.views = 0
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.is_view:
            self.views += 1
        elif name in ALLOCATIONS:
            self.allocations += 1
        else:
            self.launches += 1
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def cuda_kernels(fn) -> int:
    """CUDA kernels launched while ``fn()`` runs, on every thread (needs a GPU): the device
    activities torch's profiler records, so the copies and fills the host starts count too."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
