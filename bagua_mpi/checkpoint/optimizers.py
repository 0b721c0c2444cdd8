"""The ``optimizer`` argument of ``save`` and ``load``: one optimizer, or several by name.

One optimizer keeps the file layout of every earlier version: ``/optimizer`` is its state dict
and ``/ranks/<r>/algorithm`` its algorithm state. Several (``optimizer={"G": opt_g, "D":
opt_d}``, a GAN; ``SparseAdam`` beside ``Adam``) share those two trees, each keyed by name, and
``/meta`` records their names under ``optimizers``. Names are visited in sorted order, so ranks
that built the dict in different orders still call the (collective) state dicts of sharded
optimizers in the same order and write the same bytes.
"""
from __future__ import annotations

import hashlib
import json

import torch

ONE = None  # the key under which an optimizer given alone is held


def by_name(optimizer) -> dict | None:
    """``{name: optimizer}`` sorted by name, ``{ONE: optimizer}`` for one given alone, or None.

    Raises TypeError for what is not an optimizer (naming its key), ValueError for an empty dict
    or one optimizer given under two names."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, dict):
        _check(optimizer, "optimizer")
        return {ONE: optimizer}
    if not optimizer:
        raise ValueError("optimizer={} names no optimizer: pass None to leave optimizers out")
    seen: dict[int, str] = {}
    for name, opt in optimizer.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"optimizer names must be non-empty strings, got {name!r}")
        _check(opt, f"optimizer[{name!r}]")
        if id(opt) in seen:
            raise ValueError(f"optimizer[{seen[id(opt)]!r}] and optimizer[{name!r}] are the same "
                             "optimizer; give each optimizer once")
        seen[id(opt)] = name
    return {name: optimizer[name] for name in sorted(optimizer)}


def _check(opt, where: str) -> None:
    from ..optimizer import DistributedOptimizer

    if not isinstance(opt, (DistributedOptimizer, torch.optim.Optimizer)):
        raise TypeError(f"{where} must be a torch.optim.Optimizer or a DistributedOptimizer, "
                        f"got {type(opt).__name__}")


def several(named: dict | None) -> bool:
    return named is not None and ONE not in named


def pack(named: dict, values: dict):
    """The tree to write: the one optimizer's value itself, or the values by name."""
    return values[ONE] if ONE in named else values


def unpack(named: dict, tree) -> dict:
    """``pack``'s inverse: ``{name: value}`` (names absent from a several-optimizer tree, such as
    a plain optimizer's in the algorithm tree, are absent here too)."""
    if ONE in named:
        return {ONE: tree}
    return dict(tree or {})


def meta_entry(meta: dict, name) -> dict:
    """Where ``/meta`` describes optimizer ``name``'s algorithm (``algorithm``, ``zero_stage``,
    ``per_rank_algorithm_state``, ``algorithm_state_kinds``): the top level for one optimizer
    given alone, else its entry under ``optimizers``."""
    return meta if name is ONE else meta["optimizers"][name]


def names_digest(named: dict | None) -> int:
    """A nonzero 63-bit digest of several optimizers' names (0 for one or none), which the
    ranks compare before saving."""
    if not several(named):
        return 0
    raw = hashlib.sha256(json.dumps(sorted(named)).encode()).digest()
    return (int.from_bytes(raw[:8], "little") >> 1) | 1


def describe(names) -> str:
    """How a set of optimizer names reads in an error (None: one optimizer given alone)."""
    if names is None:
        return "one optimizer (optimizer=opt)"
    return "optimizers " + ", ".join(repr(n) for n in sorted(names)) + " (optimizer={...})"
