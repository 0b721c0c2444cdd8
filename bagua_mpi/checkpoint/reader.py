"""``load``: verify a checkpoint, read each rank's part, restore it (collective). The MPI-free
``verify`` / ``read_meta`` for inspecting files are in ``inspection``.

``load`` tries candidates in order (``rotation.candidates``: the file ``latest`` names, then
older ones when ``fallback``) and for each:

1. rank 0 checks the seal (header, size and, with ``verify``, the SHA-256 of the whole file) and
   reads ``/meta``; the verdict is broadcast, so all ranks move on together;
2. compatibility is decided from ``/meta`` alone (identical on all ranks, so all raise alike):
   a different world size loads the replicated state and refuses per-rank state that has no
   meaning on the new ranks (see ``load``);
3. every rank reads what it needs (the replicated trees and ``/ranks/<its rank>``); fletcher32
   verifies each chunk. A failure on any rank is agreed by an allreduce and the candidate is
   skipped on all ranks;
4. only then is anything modified: model, optimizer, algorithm state, RNG states. An error here
   (a model of another shape) is agreed the same way and raised on every rank.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from mpi4py import MPI

from .. import consistency, runtime
from .errors import (CheckpointCorruptError, CheckpointError, CheckpointFormatError,
                     CheckpointNotFoundError, WorldSizeMismatchError)
from .format import open_file
from .inspection import read_meta
from .trees import read_tree
from . import optimizers
from . import rng as rng_state
from . import rotation

logger = logging.getLogger(__name__)


@dataclass
class CheckpointInfo:
    """What ``load`` restored, and from where."""

    path: str  # the file that was loaded
    step: int
    epoch: int | None
    extras: Any  # rank 0's ``extras`` (None if none were saved)
    rank_extras: Any  # this rank's ``rank_extras`` (None if none, or the world size changed)
    world_size: int  # ranks of the job that saved it
    write_scheme: str  # "token" or "mpio"
    rng_restored: bool
    # "loaded", "reset" (reset_algorithm_state=True, or resharded), "none"; with several
    # optimizers, one of those for each, by name
    algorithm_state: str | dict
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, why) fallen back from
    meta: dict = field(default_factory=dict, repr=False)  # the file's /meta


# -- collective load ------------------------------------------------------------------------------

def _agree_error(comm, rank: int, size: int, error: str | None) -> str | None:
    """Everyone learns the lowest failing rank's error (None when no rank failed)."""
    culprit = comm.allreduce(rank if error is not None else size, op=MPI.MIN)
    if culprit == size:
        return None
    return comm.bcast(error, root=culprit)


def _plan(meta: dict, path: str, size: int, model, named: dict | None,
          reset_algorithm_state: bool, node_leaders: list[int]):
    """Which trees this job loads, and what becomes of each optimizer's algorithm state
    (``{name: "loaded" | "reset" | "none"}``), from ``/meta`` and this job's nodes
    (``Topology.node_leaders``) alone; raises on an impossible resume."""
    trees = meta["trees"]
    same_size = meta["world_size"] == size
    wanted = []
    if model is not None:
        if "model" not in trees:
            raise CheckpointError(f"{path} holds no model state")
        wanted.append("model")
    if named is not None:
        if "optimizer" not in trees:
            raise CheckpointError(f"{path} holds no optimizer state")
        saved_names = meta.get("optimizers")  # absent: one optimizer given alone
        given_names = list(named) if optimizers.several(named) else None
        if (saved_names is None) != (given_names is None) or (
                given_names is not None and sorted(saved_names) != given_names):
            raise CheckpointError(
                f"{path} holds the state of {optimizers.describe(saved_names)}; load() was "
                f"given {optimizers.describe(given_names)}: pass the optimizers it holds, by "
                "the same names")
        wanted.append("optimizer")
    per_rank = [n for n in wanted if trees[n] == "per_rank"]
    if "model" in per_rank and not same_size and meta.get("model_parameters") == "replicated":
        # only buffers (BatchNorm's running statistics) differed from rank to rank
        per_rank.remove("model")
        logger.warning("bagua_mpi checkpoint: %s was saved by %d ranks whose model buffers "
                       "(e.g. BatchNorm running statistics) differed; its parameters are the "
                       "same on every rank, and every rank loads rank 0's buffers", path,
                       meta["world_size"])
    if per_rank and not same_size:
        raise WorldSizeMismatchError(
            f"{path} was saved by {meta['world_size']} ranks whose {' and '.join(per_rank)} "
            f"state differs from rank to rank (e.g. decentralized training); it cannot be "
            f"loaded by {size} ranks. Resume with {meta['world_size']} ranks.")
    algorithms = {name: _algorithm_plan(meta, path, size, name, opt, reset_algorithm_state,
                                        node_leaders)
                  for name, opt in (named or {}).items()}
    if "loaded" in algorithms.values():
        wanted.append("algorithm")
    if "extras" in trees:
        wanted.append("extras")
    if same_size:
        wanted += [n for n in ("rank_extras", "rng") if n in trees]
    return wanted, algorithms


def _node_sizes(leaders: list[int]) -> list[int]:
    """Ranks per node, nodes in the order of their leaders' ranks."""
    return [leaders.count(leader) for leader in sorted(set(leaders))]


def _algorithm_plan(meta: dict, path: str, size: int, name, optimizer,
                    reset_algorithm_state: bool, node_leaders: list[int]) -> str:
    """What becomes of one optimizer's saved algorithm state: "loaded", "reset" or "none".

    Per-rank state loads where the ranks and their nodes are the ones that saved it (a file
    from before the nodes were recorded counts as the same nodes): a node leader's exchange
    state (a hierarchical exchange, node-shared buckets) belongs to the node it led."""
    from ..optimizer import DistributedOptimizer

    entry = optimizers.meta_entry(meta, name)
    saved, saved_zero_stage = entry.get("algorithm"), entry.get("zero_stage")
    kinds, per_rank = entry.get("algorithm_state_kinds"), entry["per_rank_algorithm_state"]
    which = "the optimizer" if name is optimizers.ONE else f"optimizer {name!r}"
    if not isinstance(optimizer, DistributedOptimizer):
        return "none"
    if saved is None:
        logger.warning("bagua_mpi checkpoint: %s was saved without a DistributedOptimizer as "
                       "%s; its algorithm starts afresh", path, which)
        return "none"
    saved_name = saved["config"].get("name")
    if saved_name != optimizer.algorithm.name:
        raise CheckpointError(f"{path} holds state of algorithm {saved_name!r}, {which} runs "
                              f"{optimizer.algorithm.name!r}")
    if reset_algorithm_state:
        return "reset"
    saved_nodes = meta.get("node_leaders")
    same_nodes = saved_nodes is None or list(saved_nodes) == node_leaders
    if not per_rank or (meta["world_size"] == size and same_nodes):
        return "loaded"
    if meta["world_size"] == size:   # the same ranks, on other nodes
        if optimizer.zero_stage or saved_zero_stage:
            logger.warning(
                "bagua_mpi checkpoint: %s was saved on nodes of %s ranks, loaded on nodes of "
                "%s: the per-rank state of algorithm %r of %s belongs to the old nodes and was "
                "reset; the model and the optimizer state continue", path,
                _node_sizes(list(saved_nodes)), _node_sizes(node_leaders), saved_name, which)
            return "reset"
        raise WorldSizeMismatchError(
            f"{path} was saved by {size} ranks on nodes of {_node_sizes(list(saved_nodes))} "
            f"ranks and holds per-rank state of algorithm {saved_name!r} for {which}, which "
            f"belongs to those nodes (a node leader's exchange state); this job's nodes hold "
            f"{_node_sizes(node_leaders)}. Resume on the same nodes, or pass "
            f"reset_algorithm_state=True to start the algorithm's state afresh (training "
            f"continues, but not bit-identically).")
    if optimizer.zero_stage or saved_zero_stage:
        # sharded training is where a requeued job often gets fewer nodes: its logical
        # optimizer state reshards, and what belongs to another partition starts afresh
        logger.warning(
            "bagua_mpi checkpoint: %s was saved by %d ranks, loaded by %d: the per-rank state "
            "of algorithm %r (%s) of %s belongs to the old partition of the buckets and was "
            "reset; the model and the optimizer state were resharded and continue",
            path, meta["world_size"], size, saved_name,
            ", ".join(kinds or ["error feedback"]), which)
        return "reset"
    raise WorldSizeMismatchError(
        f"{path} was saved by {meta['world_size']} ranks and holds per-rank state of algorithm "
        f"{saved_name!r} for {which} (error feedback, peer models, ...), which has no meaning "
        f"on {size} ranks. Resume with {meta['world_size']} ranks, or pass "
        "reset_algorithm_state=True to start the algorithm's state afresh (training "
        "continues, but not bit-identically).")


def _read(path: str, meta: dict, rank: int, size: int, wanted: list[str]) -> dict:
    """This rank's trees. On another world size only replicated state is wanted, and the
    algorithm state (then the same on every saving rank) comes from rank 0."""
    source = rank if meta["world_size"] == size else 0
    parts = {}
    try:
        with open_file(path, "r") as f:
            for name in wanted:
                where = name if meta["trees"][name] == "replicated" else f"ranks/{source}/{name}"
                if where not in f:
                    raise CheckpointCorruptError(path, f"/{where} is missing")
                parts[name] = read_tree(f[where], path)
    except OSError as exc:
        raise CheckpointCorruptError(path, str(exc)) from exc
    return parts


def _apply(parts: dict, meta: dict, model, named: dict | None, algorithms: dict,
           restore_rng: bool, strict: bool) -> bool:
    if model is not None:
        if isinstance(model, torch.nn.Module):
            model.load_state_dict(parts["model"], strict=strict)
        else:
            for key, value in parts["model"].items():
                model[key].copy_(value)
    if named is not None:
        states = optimizers.unpack(named, parts["optimizer"])
        algorithm_states = optimizers.unpack(named, parts.get("algorithm"))
        for name, optimizer in named.items():
            optimizer.load_state_dict(states[name])  # the wrapper's: it sees the new groups
            # the file's tensors are row-major: give a plain optimizer's state its parameters'
            # strides, as the wrapper's load does (fused Adam pairs them by memory position)
            from ..optimizer import match_state_layouts
            match_state_layouts(optimizer)
            if algorithms[name] == "loaded":
                optimizer.load_algorithm_state_dict(algorithm_states[name])
            elif algorithms[name] == "reset":
                saved = optimizers.meta_entry(meta, name)["algorithm"]
                optimizer.steps = int(saved["steps"])  # the step count goes on
    if restore_rng and "rng" in parts:
        return rng_state.restore(parts["rng"])
    return False


def load(path: str, model=None, optimizer=None, *, fallback: bool = True,
         restore_rng: bool = True, strict: bool = True, reset_algorithm_state: bool = False,
         verify: bool = True) -> CheckpointInfo:
    """Restore a checkpoint saved by ``save``; collective over the library's ranks.

    Args:
        path: a checkpoint directory (its ``latest``) or one ``ckpt-*.h5`` file.
        model / optimizer: what to restore into (either may be None). A
            ``DistributedOptimizer`` also gets this rank's algorithm state. Optimizers saved
            by name (``optimizer={"G": opt_g, "D": opt_d}``) are given by the same names.
        fallback: when the chosen file is corrupt, truncated or unfinished, log why and try
            the previous checkpoints, newest first (``info.skipped`` lists what was skipped).
        restore_rng: restore each rank's torch/CUDA/NumPy/Python RNG states (same world size).
        strict: passed to ``model.load_state_dict``.
        reset_algorithm_state: do not restore the algorithm's per-rank state (the one way to
            resume an algorithm with per-rank state on a different number of ranks).
        verify: rank 0 checks the SHA-256 of the whole file before use (fletcher32 sums are
            always checked while reading).

    Different world size: model, optimizer and extras load, and so does algorithm state that
    is the same on every saving rank and holds no tensors (configuration, step count, stage:
    e.g. ``gradient_allreduce``, or 1-bit Adam still in its warm-up); RNG states and
    ``rank_extras`` are not restored (``info.rng_restored`` is False). Per-rank algorithm state
    (error-feedback residuals, compressed momenta, anything with tensors) and a model whose
    parameters differ per rank are refused with ``WorldSizeMismatchError``: there is no sound
    rule to split or merge them. A model whose parameters are the same on every saving rank
    and only its buffers differ (BatchNorm's running statistics) loads rank 0's copy.

    Example::

        info = bagua_mpi.checkpoint.load("ckpt", model=model, optimizer=opt)
        start = info.step                     # the step count that was saved
    """
    named = optimizers.by_name(optimizer)  # TypeError / ValueError before any communication
    rt = runtime.get()
    comm, rank, size = rt.topo.comm, rt.topo.rank, rt.topo.size
    rt.worker.drain()
    consistency.check_called_everywhere(comm, "bm.checkpoint.load", "every rank calls it")
    found = None
    if rank == 0:
        try:
            found = (None, rotation.candidates(path, fallback))
        except CheckpointNotFoundError as exc:
            found = (str(exc), None)
    not_found, candidates = comm.bcast(found, root=0)
    if not_found:
        raise CheckpointNotFoundError(not_found)
    node_leaders = rt.topo.node_leaders()

    skipped: list[tuple[str, str]] = []
    for candidate in candidates:
        verdict = None
        if rank == 0:
            try:
                verdict = (None, read_meta(candidate, verify=verify))
            except CheckpointCorruptError as exc:
                verdict = (exc.reason, None)
            except FileNotFoundError as exc:
                verdict = (f"vanished: {exc}", None)
            except CheckpointFormatError as exc:
                verdict = ("format: " + str(exc), None)
        problem, meta = comm.bcast(verdict, root=0)
        if problem is not None and problem.startswith("format: "):
            raise CheckpointFormatError(problem[len("format: "):])
        if problem is None:
            wanted, algorithms = _plan(meta, candidate, size, model, named,
                                       reset_algorithm_state, node_leaders)
            parts = None
            try:
                parts = _read(candidate, meta, rank, size, wanted)
            except CheckpointCorruptError as exc:
                problem = f"rank {rank}: {exc.reason}"
            problem = _agree_error(comm, rank, size, problem)
        if problem is not None:
            skipped.append((candidate, problem))
            if rank == 0:
                logger.warning("bagua_mpi checkpoint: skipping %s: %s", candidate, problem)
            if not fallback:
                raise CheckpointCorruptError(candidate, problem)
            continue
        error = None
        try:
            rng_restored = _apply(parts, meta, model, named, algorithms, restore_rng, strict)
        except Exception as exc:  # noqa: BLE001 - agreed, then raised on every rank
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
        error = _agree_error(comm, rank, size, error)
        if error is not None:
            raise CheckpointError(f"could not restore {candidate}: {error}")
        if meta["world_size"] != size and rank == 0:
            logger.warning("bagua_mpi checkpoint: %s was saved by %d ranks, loaded by %d: "
                           "replicated state restored, RNG states not", candidate,
                           meta["world_size"], size)
        return CheckpointInfo(
            path=candidate, step=meta["step"], epoch=meta["epoch"],
            extras=parts.get("extras"), rank_extras=parts.get("rank_extras"),
            world_size=meta["world_size"], write_scheme=meta["write_scheme"],
            rng_restored=rng_restored, skipped=skipped, meta=meta,
            algorithm_state=(algorithms if optimizers.several(named)
                             else algorithms.get(optimizers.ONE, "none")))
    reasons = "; ".join(f"{p}: {why}" for p, why in skipped)
    raise CheckpointCorruptError(path, f"no loadable checkpoint ({reasons})")
