"""What every collective shares: the executor hand-off, operation names, the agreement-check
switch, and the checks of Horovod-style arguments.

Each collective is built in two halves (see the package docstring): arguments are validated in
the caller, then a ``run`` closure does the MPI work through ``run_now`` (synchronous) or
``start`` (asynchronous, returns a ``Handle``). Nothing here imports another module of the
package: every other module builds on this one.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from mpi4py import MPI

from .. import consistency, process_sets, timeline
from ..buffers import INTEGER, is_cuda
from ..compression import Compression
from ..ops import Average, ReduceOp, Sum, UnsupportedOp, mpi_op
from ..worker import Handle

global_process_set = process_sets.global_process_set
NO_COMPRESSION = Compression.none


# -- the agreement check -----------------------------------------------------------------------

def check_wanted(check: bool | None) -> bool:
    """Whether an operation runs the agreement check: its own ``check=`` when given, else the
    process-wide switch (``BAGUA_MPI_CHECK``, ``set_consistency_check``). Read when the
    operation runs, so a queued operation sees the switch as it is then (as it always has)."""
    return consistency._enabled if check is None else check


def agree(comm, signature: tuple, join=None, check: bool | None = None) -> None:
    """The agreement check of one operation (``consistency.verify``), if it is wanted."""
    if check_wanted(check):
        consistency.verify(comm, signature, join)


def rows_of_every_rank(comm, signature: tuple, rows) -> np.ndarray:
    """The agreement check, then every rank's ``rows`` (a count per tensor, dimension 0) in one
    allgather whose header also carries the signature's hash: ``(ranks, tensors)`` counts.
    How an allgather learns the sizes only each caller knows."""
    agree(comm, signature)  # the check message also tells a joined rank what runs
    header = np.concatenate([[consistency.signature_hash(signature)], rows]).astype(np.int64)
    table = np.empty((comm.Get_size(), header.size), dtype=np.int64)
    comm.Allgather(header, table)
    consistency.verify_hashes(comm, table[:, 0], signature)
    return table[:, 1:]


# -- handing operations to the executor --------------------------------------------------------

# Names of asynchronous operations not yet synchronized (Horovod refuses a duplicate name).
_pending_names: dict[str, Handle] = {}
_handle_names: dict[int, str] = {}


def run_now(rt, run, describe, tensors: tuple = (), name=None):
    """Run a synchronous operation on the executor and return its result (inline when nothing
    is queued, else behind the queued work), with the first CUDA tensor's device current, as
    ``start``'s operations run: a CUDA-aware MPI takes a tensor only from its own device."""
    device = _first_cuda_device(tensors)
    if name is None and timeline._collective is None:  # the common case, kept short
        return rt.worker.run(run, describe, device)
    if timeline._collective is not None:
        run = timeline._collective.wrap(run, name, describe)
    if name is not None and name in _pending_names:
        _reserve_name(name)  # raises: an operation of that name is still in flight
    return rt.worker.run(run, describe, device)


def start(rt, run, describe, owned: tuple = (), name=None) -> Handle:
    """Queue an asynchronous operation; ``owned`` buffers stay alive until it completes.

    It returns without waiting for the device: the executor orders the operation after the
    work the caller's stream has queued on the first CUDA buffer's device (``streams.py``), and
    every carrier keeps that order (NCCL in stream order, a staged copy on the communication
    thread's stream, a CUDA-aware MPI after ``transport.device_ready``)."""
    if timeline._collective is not None:
        run = timeline._collective.wrap(run, name, describe)
    device = _first_cuda_device(owned)
    if name is None:
        return rt.worker.submit(run, describe, owned, device=device)
    _reserve_name(name)
    handle = rt.worker.submit(run, describe, owned, device=device)
    _pending_names[name] = handle
    _handle_names[id(handle)] = name
    return handle


def _first_cuda_device(tensors):
    """The device of the first CUDA tensor among ``tensors``; None where there is none."""
    return next((t.device for t in tensors if is_cuda(t)), None)


def _reserve_name(name) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {name!r}")
    if name in _pending_names:
        raise ValueError(f"an operation named {name!r} is still pending: names of operations in "
                         f"flight must be unique (synchronize the first handle before reusing it)")


def release_name(handle) -> None:
    """``handle`` has completed: its name may be used again."""
    name = _handle_names.pop(id(handle), None)
    if name is not None:
        _pending_names.pop(name, None)


def has_named_handles() -> bool:
    return bool(_handle_names)


# -- Horovod-style arguments -------------------------------------------------------------------

def resolve_op(average, op):
    """Horovod's ``average=`` (deprecated) / ``op=`` pair to one op; ``op`` wins, not both.
    Call it straight from the public function: the warning names that function's caller."""
    if op is None and average is None:  # the common case, without a further call
        return Average
    if op is None and (average is True or average is False):
        warnings.warn("average= is deprecated (as in Horovod): use op=Average or op=Sum",
                      DeprecationWarning, stacklevel=3)
    return chosen_op(average, op)


def chosen_op(average, op):
    """``resolve_op``'s choice, without its warning."""
    if op is None:
        if average is None:
            return Average
        if average is True or average is False:
            return Average if average else Sum
        return average  # this library's positional op: allreduce(t, Sum)
    if average is not None:
        raise ValueError("the op parameter supersedes average: pass only one of them "
                         f"(got average={average!r}, op={op!r})")
    return op


def name_and_op(name, op):
    """This library's positional op in Horovod's ``name`` slot: reducescatter(t, Sum)."""
    if isinstance(name, (ReduceOp, UnsupportedOp)):
        return None, name
    return name, op


def reduction(op, dt: str):
    """(op, MPI op, integer average?): Average of integers sums, then scales by 1/n in float64
    and truncates toward zero, as Horovod does."""
    if type(op) is not ReduceOp:
        op = ReduceOp.parse(op)
    if op is Average and dt in INTEGER:
        return op, MPI.SUM, True
    return op, mpi_op(op, dt), False


def check_factor(name: str, value, dtype: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value != 1.0 and dtype == "bool":
        raise TypeError(f"{name}={value!r} cannot scale a bool tensor")
    return float(value)


def check_list(tensors, what: str) -> None:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"{what} needs a non-empty list of tensors, got {tensors!r}")


def topo_of(rt, process_set):
    """The topology (communicator and node layout) an operation on ``process_set`` runs on."""
    if process_set is global_process_set or process_set is None:
        return rt.topo
    return process_sets.topology_of(process_set)


def root_of(rt, root_rank, process_set) -> int:
    """Horovod's root_rank is a global rank, also with process sets: its index in the set."""
    _check_root(root_rank, rt.topo.size)
    if process_set is global_process_set or process_set is None:
        return int(root_rank)
    return process_sets.set_rank_of(process_set, int(root_rank))


def _check_root(root, size: int) -> None:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root_rank must be an integer in [0, {size}), got {root!r}")


def wants_grad(tensor) -> bool:
    """Whether ``tensor`` takes the differentiable version of a collective."""
    return type(tensor) is not np.ndarray and getattr(tensor, "requires_grad", False) \
        and torch.is_grad_enabled()


def row_elems(shape) -> int:
    """Elements in one row (one index of dimension 0) of a tensor of ``shape``."""
    return int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
