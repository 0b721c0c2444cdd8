"""Counting the torch operations a piece of code dispatches: the launch count a CPU can see.

On a GPU every operation that computes or copies is at least one kernel launch, a few
microseconds of host time each; allocations and views launch nothing. ``DispatchCount`` counts
the operations dispatched from Python (the top level: what a composite operation does inside
is not seen) on the calling thread, by kind, for tests and benchmarks that a count does not
grow with the number of tensors. ``cuda_kernels`` counts what a GPU really launched (all
threads), from torch's profiler. ``ArraysAsked`` records what the primitives ask for around
their kernels and the wire: the tensors they view as arrays, the new arrays they make, and the
buffers the transport sends from and receives into.
"""
from __future__ import annotations

import numpy as np
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


# the transport's verbs that receive: (the buffer sent, the buffers received into) of a call
_RECEIVING = {"alltoall": lambda send, recv, **kw: (send, [recv]),
              "allgather": lambda send, recv, **kw: (send, [recv]),
              "recv": lambda buf, source, **kw: (None, [buf]),
              "exchange": lambda send, recvs, peers, **kw: (send, list(recvs))}


class ArraysAsked:
    """``with ArraysAsked() as asked: ...``, on every thread (the exchanges of an optimizer run
    on its communication thread): ``asked.views``, the tensors ``device_arrays.array_of``
    viewed as arrays for the kernels (a view of a CUDA tensor costs some 24 us of host time);
    ``asked.new``, the arrays ``device_arrays.empty`` made; ``asked.exchanges``, (the buffer
    sent, the buffers received into) of each transport call that receives, in order. The
    records hold the buffers, so memory a later call finds shared with one of them was not
    new (``shares_memory``)."""

    def __init__(self):
        self.views, self.new, self.exchanges = [], [], []

    def __enter__(self):
        from bagua_mpi import transport
        from bagua_mpi.primitives import device_arrays
        self._saved = (device_arrays.array_of, device_arrays.empty,
                       {verb: getattr(transport.Transport, verb) for verb in _RECEIVING})
        array_of, empty, verbs = self._saved
        device_arrays.array_of = lambda t: self.views.append(t) or array_of(t)
        device_arrays.empty = lambda *a: self.new.append(a) or empty(*a)
        for verb, original in verbs.items():
            setattr(transport.Transport, verb, self._recording(verb, original))
        return self

    def _recording(self, verb, original):
        def call(transport_self, *args, **kwargs):
            self.exchanges.append(_RECEIVING[verb](*args, **kwargs))
            return original(transport_self, *args, **kwargs)
        return call

    def __exit__(self, *exc):
        from bagua_mpi import transport
        from bagua_mpi.primitives import device_arrays
        device_arrays.array_of, device_arrays.empty, verbs = self._saved
        for verb, original in verbs.items():
            setattr(transport.Transport, verb, original)
        return False

    @property
    def received(self) -> list:
        """Every buffer received into, in order."""
        return [buf for _, bufs in self.exchanges for buf in bufs]


def shares_memory(a, b) -> bool:
    """Whether two host buffers (NumPy arrays or CPU tensors) share memory."""
    def host(x):
        return x.numpy() if isinstance(x, torch.Tensor) else x
    return np.shares_memory(host(a), host(b))
