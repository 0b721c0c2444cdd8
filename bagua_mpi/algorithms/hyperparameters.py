"""The wrapped optimizer's hyperparameters, compared across the ranks at every step.

Ranks whose learning rates part ways train different models without any error: a
``ReduceLROnPlateau`` stepped on each rank's own validation loss, a schedule read from a
per-rank counter, a change made under ``if rank == 0``. The gradients are still averaged, so
nothing hangs and nothing looks wrong until the models are compared. So the first bucket's
agreement check (``AlgorithmImpl._agree``, one small allreduce it makes anyway) carries a
digest of every param group's hyperparameters, taken when that exchange runs (on the
communication thread):

1. ``digest(groups)``: the numbers (floats, ints, bools; None as NaN; tuples of floats such as
   Adam's betas, with their length) packed as float64 bytes, the rest (other tuples, strings,
   tensors) as text, hashed to 62 bits;
   packing, not formatting, the numbers keeps it at a few microseconds a group;
2. the ranks compare it with the rest of the bucket's signature; only when the digests
   differ do they gather ``summary(groups)``, every value in readable form (a CPU scalar
   tensor as its float; a tensor on a device by name, since reading it would make the host
   wait for the device), and ``differences(summaries)`` names each value that differs, with
   the ranks holding each value.

A change between ``backward()`` and ``step()`` is seen at the next step's first bucket, one
update late; a change anywhere else (a scheduler stepped between steps) before any rank uses it.

The decentralized algorithms exist to spare every step a wait for every rank, so they compare
with their ring neighbours only (``check_ring_neighbours``), before each averaging: one 8-byte
message each way per neighbour. A ring is connected, so wherever two ranks differ some pair of
neighbours does; both ranks of that pair raise ``MismatchError`` naming the values, and with the
library's abort on an uncaught exception (the default) the job ends there.
"""
from __future__ import annotations

import hashlib
import math
from array import array

import numpy as np
import torch
from mpi4py import MPI

from ..consistency import ranks_text
from ..exceptions import MismatchError
from ..primitives.decentralized import ring_peers

FIELD = "hyperparameters"
# the group's parameters and their names (torch.optim keeps these when built from
# named_parameters()): the wrap-time model check compares them, once
_NOT_HYPERPARAMETERS = ("params", "param_names")
_PLAIN = (bool, int, float, str, type(None))
# point-to-point tags of the neighbours' check: no other message on the communicator uses them
_DIGEST_TAG, _SUMMARY_TAG = 7601, 7602
# what a MismatchError of differing hyperparameters tells the user to do
ADVICE = ("Every rank must step alike: a learning-rate scheduler stepped on a per-rank metric "
          "(ReduceLROnPlateau on this rank's validation loss) parts them; average the metric "
          "over the ranks first (bagua_mpi.allreduce)")


def digest(param_groups) -> int:
    """A 62-bit hash of every group's hyperparameters (everything but its parameters)."""
    numbers, rest = [], []
    for group in param_groups:
        numbers.append(-math.inf)  # where a group starts
        for key, value in group.items():
            kind = type(value)
            if kind is float or kind is int or kind is bool:
                numbers.append(value)
            elif kind is tuple and all(type(v) is float for v in value):  # Adam's betas
                numbers.append(len(value))
                numbers.extend(value)
            elif value is None:
                numbers.append(math.nan)
            elif key not in _NOT_HYPERPARAMETERS:
                rest.append((key, _plain(value)))
    try:
        packed = array("d", numbers).tobytes()
    except OverflowError:  # an int past float64's range: as text, slower but exact
        packed = repr(numbers).encode()
    packed += repr(rest).encode()
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 2


def summary(param_groups) -> tuple:
    """``((group index, ((key, value), ...)), ...)`` for every group of ``param_groups``."""
    return tuple((i, tuple((k, _plain(v)) for k, v in group.items()
                           if k not in _NOT_HYPERPARAMETERS))
                 for i, group in enumerate(param_groups))


def _plain(value):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return tuple(value)
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.numel() == 1:
            return float(value)
        return f"tensor{tuple(value.shape)} on {value.device}"
    return type(value).__name__


def digests_differ(signatures: list) -> bool:
    """Whether every rank's signature ends with this check's digest, and they differ."""
    fields = [sig[-1] if sig else None for sig in signatures]
    return (bool(fields) and all(isinstance(f, tuple) and len(f) == 2 and f[0] == FIELD
                                 for f in fields) and len({f[1] for f in fields}) > 1)


def differences(summaries: list, ranks: list[int] | None = None) -> list[str]:
    """One line per hyperparameter whose value differs across the ranks' ``summary`` (one per
    rank: of ``ranks``, in increasing order, else of every rank in rank order)."""
    summaries = {r: dict(s) for r, s in zip(ranks or range(len(summaries)), summaries)}
    lines = []
    for g in sorted({g for s in summaries.values() for g in s}):
        holders = {r: dict(s[g]) for r, s in summaries.items() if g in s}
        if len(holders) < len(summaries):
            lines.append(f"param group {g}: on {ranks_text(sorted(holders))} only")
            continue
        for key in dict.fromkeys(k for values in holders.values() for k in values):
            held: dict = {}
            for r, values in holders.items():
                shown = repr(values[key]) if key in values else "(no such key)"
                held.setdefault(shown, []).append(r)
            if len(held) > 1:
                lines.append(f"param group {g} {key!r}: " + "; ".join(
                    f"{value} on {ranks_text(ranks)}" for value, ranks in held.items()))
    return lines


def check_ring_neighbours(comm: MPI.Intracomm, param_groups, step: int, when: str) -> None:
    """Compare ``param_groups``' hyperparameters with this rank's ring neighbours' on ``comm``
    (every rank calls it at the same point of the same step):

    1. send ``digest(param_groups)`` to both neighbours and receive theirs (8 bytes each way,
       non-blocking, so the ring cannot deadlock);
    2. with every neighbour whose digest differs (which found the difference too), swap
       ``summary(param_groups)``;
    3. raise ``MismatchError`` naming each differing value, this rank and the neighbour.
    """
    rank = comm.Get_rank()
    peers = ring_peers(rank, comm.Get_size())
    if not peers:
        return
    mine = np.array([digest(param_groups)], dtype=np.int64)
    theirs = [np.empty(1, dtype=np.int64) for _ in peers]
    MPI.Request.Waitall([comm.Irecv(t, source=p, tag=_DIGEST_TAG) for t, p in zip(theirs, peers)]
                        + [comm.Isend(mine, dest=p, tag=_DIGEST_TAG) for p in peers])
    differing = [p for p, t in zip(peers, theirs) if t[0] != mine[0]]
    if not differing:
        return
    own = summary(param_groups)
    sends = [comm.isend(own, dest=p, tag=_SUMMARY_TAG) for p in differing]
    lines = []
    for peer in differing:
        ranks = sorted((rank, peer))
        pair = [own, comm.recv(source=peer, tag=_SUMMARY_TAG)]
        lines += differences(pair if ranks[0] == rank else pair[::-1], ranks)
    MPI.Request.waitall(sends)
    raise MismatchError(
        f"rank {rank}: the wrapped optimizer's hyperparameters differ from those of its ring "
        f"neighbour{'s' if len(differing) > 1 else ''} ({ranks_text(differing)}) at step "
        f"{step} ({when}):\n  " + "\n  ".join(lines)
        + "\n" + ADVICE)
