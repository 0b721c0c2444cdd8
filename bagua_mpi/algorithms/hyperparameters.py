"""The wrapped optimizer's hyperparameters, compared across the ranks at every step.

Ranks whose learning rates part ways train different models without any error: a
``ReduceLROnPlateau`` stepped on each rank's own validation loss, a schedule read from a
per-rank counter, a change made under ``if rank == 0``. The gradients are still averaged, so
nothing hangs and nothing looks wrong until the models are compared. So the first bucket's
agreement check (``AlgorithmImpl._agree``, one small allreduce it makes anyway) carries a
digest of every param group's hyperparameters, taken as the bucket is launched:

1. ``digest(groups)``: the numbers (floats, ints, bools; None as NaN) packed as float64 bytes,
   the rest (Adam's betas and other tuples, strings, tensors) as text, hashed to 62 bits;
   packing, not formatting, the numbers keeps it at a few microseconds a group;
2. the ranks compare it with the rest of the bucket's signature; only when the digests
   differ do they gather ``summary(groups)``, every value in readable form (a CPU scalar
   tensor as its float; a tensor on a device by name, since reading it would make the host
   wait for the device), and ``differences(summaries)`` names each value that differs, with
   the ranks holding each value.

A change between ``backward()`` and ``step()`` is seen at the next step's first bucket, one
update late; a change anywhere else (a scheduler stepped between steps) before any rank uses it.
"""
from __future__ import annotations

import hashlib
import math
from array import array

import torch

from ..consistency import ranks_text

FIELD = "hyperparameters"
# the group's parameters and their names (torch.optim keeps these when built from
# named_parameters()): the wrap-time model check compares them, once
_NOT_HYPERPARAMETERS = ("params", "param_names")
_PLAIN = (bool, int, float, str, type(None))


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


def differences(summaries: list) -> list[str]:
    """One line per hyperparameter whose value differs across the ranks' ``summary`` (one per
    rank, in rank order)."""
    summaries = {r: dict(s) for r, s in enumerate(summaries)}
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
