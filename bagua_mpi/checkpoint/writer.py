"""``save``: every rank's state into one HDF5 file, published atomically (collective).

Steps (all ranks, after draining the library's queued communication):

1. **Prepare.** Each rank encodes its trees (``trees.encode_tree``: nothing is copied yet) and
   hashes (SHA-256) the model and optimizer state. One MIN and one MAX allreduce of a
   fixed-size vector check that all ranks passed the same step and the same kinds of state,
   find encoding errors, and tell whether the model/optimizer are *replicated* (bit-identical on
   every rank: written once) or per-rank (decentralized training: every rank's copy is
   written; also a model whose parameters agree but whose buffers do not, which ``/meta``
   records, since it can load on another number of ranks), and whether the algorithm state
   is *per-rank* (it holds tensors, or differs between ranks) — which decides whether
   another world size may load it.
2. **Write** under a temporary name in the target directory, with one of two schemes, recorded
   in ``/meta`` as ``write_scheme``:

   * ``mpio`` (h5py built with parallel HDF5): every rank opens the file with the MPI-IO driver,
     all ranks create every object (HDF5 needs metadata operations to be collective), then each
     rank writes its own datasets concurrently (contiguous, each with a SHA-256 in the tree's
     JSON instead of fletcher32, which would force one collective call per dataset; see
     ``mpio``).
   * ``token`` (serial h5py, the usual pip/conda build): rank 0 creates the file and writes
     ``/meta``, the replicated trees and ``/ranks/0``, closes and fsyncs it, and sends a token to
     rank 1, which opens the file, appends ``/ranks/1``, fsyncs and passes the token on; the last
     rank returns it to rank 0. The token carries the first error, so after a failure the later
     ranks skip writing and everybody learns why. Memory on any rank is its own state, whatever
     the world size; the price is that ranks write one after another.

3. **Publish** (rank 0): seal the file (SHA-256 in the user block), fsync, ``os.replace`` to
   ``ckpt-<step>.h5``, point ``latest`` at it, delete checkpoints beyond ``keep`` (see
   ``rotation``). Rank 0 broadcasts the outcome; a failure raises ``CheckpointWriteError`` on
   every rank and leaves the previous checkpoint as it was.

Library messages use the library's private communicator with their own tag. The waits happen
outside the communication thread, so a long save on a slow filesystem does not trip the stall
watchdog.

Fault injection for the crash tests: ``BAGUA_MPI_CHECKPOINT_FAULT=<phase>[@rank]`` makes that
rank (default 0) SIGKILL itself at ``phase``, one of ``PHASES``.
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import h5py
import numpy as np
import torch
from mpi4py import MPI

from .. import config, consistency, runtime
from .errors import CheckpointError, CheckpointWriteError
from .format import FORMAT_NAME, FORMAT_VERSION, LIBVER, USERBLOCK_SIZE, open_file, seal, write_json
from .trees import Leaf, encode_tree, tree_digest, write_tree
from . import optimizers
from . import rng as rng_state
from . import rotation

logger = logging.getLogger(__name__)

TAG = 27181  # point-to-point tag of the token (below the guaranteed MPI_TAG_UB of 32767)
FAULT_ENV = "BAGUA_MPI_CHECKPOINT_FAULT"
SCHEME_ENV = "BAGUA_MPI_CHECKPOINT_SCHEME"
PHASES = ("prepared", "temp_created", "rank_write", "written", "before_replace",
          "before_latest", "before_prune")


def fault_point(phase: str, rank: int) -> None:
    """SIGKILL this process if ``BAGUA_MPI_CHECKPOINT_FAULT`` names ``phase`` (and this rank)."""
    fault = config.checkpoint_fault(PHASES)
    if fault is None or fault != (phase, rank):
        return
    sys.stderr.write(f"bagua_mpi checkpoint: {FAULT_ENV}: SIGKILL at {phase} on rank {rank}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def scheme() -> str:
    """The write scheme ``save`` uses here: ``mpio`` with parallel h5py, else ``token``."""
    try:
        wanted = config.checkpoint_scheme()
    except ValueError as exc:  # ConfigError: keep the checkpoint module's one error type
        raise CheckpointError(f"{exc}; expected auto, mpio or token") from None
    parallel = bool(h5py.get_config().mpi)
    if wanted == "auto":
        return "mpio" if parallel else "token"
    if wanted == "token" or (wanted == "mpio" and parallel):
        return wanted
    if wanted == "mpio":
        raise CheckpointError(f"{SCHEME_ENV}=mpio but this h5py has no MPI support "
                              "(h5py.get_config().mpi is False)")
    raise CheckpointError(f"{SCHEME_ENV}={wanted!r}: expected auto, mpio or token")


@dataclass
class Tree:
    name: str
    skeleton: object
    leaves: list[Leaf]


# -- 1. prepare ----------------------------------------------------------------------------------

def _state_of(model) -> dict:
    if isinstance(model, torch.nn.Module):
        return model.state_dict()
    if isinstance(model, dict):
        return model
    raise TypeError(f"model must be a torch.nn.Module or a state_dict, got {type(model)}")


def _encode_all(model, named: dict | None, extras, rank_extras, with_rng: bool):
    """This rank's trees, by name; and the algorithm state of each DistributedOptimizer, by
    optimizer name (``optimizers.ONE`` for one given alone)."""
    from ..optimizer import DistributedOptimizer

    trees: dict[str, Tree] = {}

    def add(name: str, obj) -> None:
        skeleton, leaves = encode_tree(obj, name)
        trees[name] = Tree(name, skeleton, leaves)

    algorithms: dict = {}
    if model is not None:
        add("model", _state_of(model))
    if named is not None:
        states = {}
        for name, opt in named.items():  # sorted: sharded state dicts are collective
            if isinstance(opt, DistributedOptimizer):
                algorithms[name] = opt.algorithm_state_dict()
            states[name] = opt.state_dict()  # logical state, also when sharded
        if algorithms:
            add("algorithm", optimizers.pack(named, algorithms))
        add("optimizer", optimizers.pack(named, states))
    if extras is not None:
        add("extras", extras)
    if rank_extras is not None:
        add("rank_extras", rank_extras)
    if with_rng:
        add("rng", rng_state.capture())
    return trees, algorithms


class _Vector:
    """Named slots of the fixed-size uint64 vector that the prepare allreduces carry."""

    NAMES = ("step", "keep", "has_model", "has_optimizer", "has_algorithm", "has_extras",
             "has_rank_extras", "has_rng", "optimizer_names", "error_rank", "errors",
             "algorithm_tensors")
    AGREED = NAMES[:8]  # every rank must pass the same (optimizer_names is reported apart)
    DIGESTS = 16  # 4 words each: model, optimizer, algorithm state, the model's parameters

    def __init__(self):
        self.values = np.zeros(len(self.NAMES) + self.DIGESTS, dtype=np.uint64)

    def __setitem__(self, name, value):
        self.values[self.NAMES.index(name)] = value

    @classmethod
    def get(cls, array, name):
        return int(array[cls.NAMES.index(name)])

    def set_digest(self, slot: int, digest: bytes) -> None:
        base = len(self.NAMES) + 4 * slot
        self.values[base:base + 4] = np.frombuffer(digest, dtype=np.uint64)

    @classmethod
    def digests_equal(cls, low, high, slot: int) -> bool:
        base = len(cls.NAMES) + 4 * slot
        return bool(np.array_equal(low[base:base + 4], high[base:base + 4]))


def _parameter_paths(model) -> set[str] | None:
    """The paths of the model tree's leaves that are parameters, not buffers (None when the
    model was given as a state_dict, which does not tell them apart)."""
    if not isinstance(model, torch.nn.Module):
        return None
    return {f"model.{name}" for name, _ in model.named_parameters(remove_duplicate=False)}


def _model_digests(tree: Tree, paths: set[str]) -> tuple[bytes, bytes]:
    """Digests of the model tree without its parameters (structure and buffers) and of the
    parameters alone: ranks whose buffers differ (BatchNorm's running statistics, which each
    rank gathers from its own batches) may still agree on the second."""
    rest = [leaf for leaf in tree.leaves if leaf.path not in paths]
    params = hashlib.sha256()
    for leaf in tree.leaves:
        if leaf.path in paths:
            params.update(leaf.path.encode())
            params.update(memoryview(leaf.array()).cast("B"))
    return tree_digest(tree.skeleton, rest), params.digest()


def _agree(comm, rank: int, size: int, step: int, keep: int | None, trees, error: str | None,
           named, replicated: bool | None, parameter_paths: set[str] | None = None):
    vec = _Vector()
    vec["step"] = step
    vec["keep"] = 0 if keep is None else keep
    vec["optimizer_names"] = optimizers.names_digest(named)
    for name in ("model", "optimizer", "algorithm", "extras", "rank_extras", "rng"):
        vec[f"has_{name}"] = int(name in trees)
    vec["errors"] = int(error is not None)
    vec["error_rank"] = rank if error is not None else size
    tensors = "algorithm" in trees and bool(trees["algorithm"].leaves)
    vec["algorithm_tensors"] = int(tensors)
    if error is None:
        # Model and optimizer: replicated when bit-identical everywhere. Algorithm state is
        # per-rank when it holds tensors (their shapes may depend on the world size) or
        # differs between ranks, so only tensor-free state is hashed.
        # A module's model is hashed in two parts, the parameters apart (slot 3).
        split = "model" in trees and replicated is None and parameter_paths is not None
        for slot, name in enumerate(("model", "optimizer", "algorithm")):
            if (name in trees and (replicated is None if slot < 2 else not tensors)
                    and not (split and name == "model")):
                vec.set_digest(slot, tree_digest(trees[name].skeleton, trees[name].leaves))
        if split:
            for slot, digest in zip((0, 3), _model_digests(trees["model"], parameter_paths)):
                vec.set_digest(slot, digest)
    low, high = np.empty_like(vec.values), np.empty_like(vec.values)
    comm.Allreduce(vec.values, low, op=MPI.MIN)
    comm.Allreduce(vec.values, high, op=MPI.MAX)
    if _Vector.get(high, "errors"):
        culprit = _Vector.get(low, "error_rank")
        message = comm.bcast(error, root=culprit)
        raise CheckpointError(f"checkpoint not saved: rank {culprit}: {message}")
    for name in _Vector.AGREED:
        if _Vector.get(low, name) != _Vector.get(high, name):
            what = name.replace("has_", "")
            raise CheckpointError(
                f"checkpoint not saved: the ranks disagree on {what} (from "
                f"{_Vector.get(low, name)} to {_Vector.get(high, name)}); every rank must call "
                "save() with the same step, keep and kinds of state")
    if _Vector.get(low, "optimizer_names") != _Vector.get(high, "optimizer_names"):
        names = comm.allgather(sorted(named) if optimizers.several(named) else None)
        raise CheckpointError(
            "checkpoint not saved: the ranks name their optimizers differently: " + "; ".join(
                f"rank {r}: {optimizers.describe(n)}" for r, n in enumerate(names)))
    if replicated is None:
        rep = {name: _Vector.digests_equal(low, high, slot)
               for slot, name in enumerate(("model", "optimizer")) if name in trees}
        if "model" in trees and parameter_paths is not None:
            rep["model_parameters"] = _Vector.digests_equal(low, high, 3)
            rep["model"] = rep["model"] and rep["model_parameters"]
    else:
        rep = {name: bool(replicated) for name in ("model", "optimizer") if name in trees}
    per_rank_algorithm = "algorithm" in trees and (
        bool(_Vector.get(high, "algorithm_tensors")) or not _Vector.digests_equal(low, high, 2))
    return rep, per_rank_algorithm


def _per_rank_algorithms(comm, named: dict, algorithms: dict) -> dict:
    """Several optimizers, once ``_agree`` found the same names on every rank: which of them
    hold per-rank algorithm state (tensors, or tensor-free state that differs between ranks),
    so that another world size refuses or resets only those. One MIN and one MAX allreduce
    of 5 words per optimizer: a tensor flag and a digest."""
    vec = np.zeros(5 * len(named), dtype=np.uint64)
    for i, name in enumerate(named):
        if name in algorithms:
            skeleton, leaves = encode_tree(algorithms[name], name)
            vec[5 * i] = int(bool(leaves))
            if not leaves:
                vec[5 * i + 1:5 * i + 5] = np.frombuffer(tree_digest(skeleton, leaves),
                                                         dtype=np.uint64)
    low, high = np.empty_like(vec), np.empty_like(vec)
    comm.Allreduce(vec, low, op=MPI.MIN)
    comm.Allreduce(vec, high, op=MPI.MAX)
    return {name: bool(high[5 * i]) or not np.array_equal(low[5 * i:5 * i + 5],
                                                          high[5 * i:5 * i + 5])
            for i, name in enumerate(named) if name in algorithms}


# -- 2. write ------------------------------------------------------------------------------------

def _algorithm_summary(state: dict | None) -> dict | None:
    return None if state is None else {"config": state["config"], "steps": state["steps"]}


def _state_kinds(state: dict | None) -> list[str]:
    return sorted((state or {}).get("state", {}).get("tensors", {}))


def _meta(step, epoch, size, write_scheme, trees, replicated, named, algorithms,
          algorithm_state, per_rank_by_optimizer: dict) -> dict:
    layout = {}
    for name in ("model", "optimizer"):
        if name in trees:
            layout[name] = "replicated" if replicated[name] else "per_rank"
    if "extras" in trees:
        layout["extras"] = "replicated"
    for name in ("algorithm", "rank_extras", "rng"):
        if name in trees:
            layout[name] = "per_rank"
    zero_stages = {name: getattr(opt, "zero_stage", 0) for name, opt in (named or {}).items()}
    meta = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step, "epoch": epoch,
        "world_size": size, "write_scheme": write_scheme,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "trees": layout,
        "model_parameters": _parameters_layout(layout, replicated),
        "algorithm": _algorithm_summary(algorithms.get(optimizers.ONE)),
        # per-rank for all the optimizers together when it is for any of them
        "per_rank_algorithm_state": algorithm_state,
        "zero_stage": max(zero_stages.values(), default=0),
        "algorithm_state_kinds": sorted({kind for state in algorithms.values()
                                         for kind in _state_kinds(state)}),
        "versions": _versions(),
    }
    if optimizers.several(named):
        meta["optimizers"] = {
            name: {"algorithm": _algorithm_summary(algorithms.get(name)),
                   "per_rank_algorithm_state": per_rank_by_optimizer.get(name, False),
                   "zero_stage": zero_stages[name],
                   "algorithm_state_kinds": _state_kinds(algorithms.get(name))}
            for name in named}
    return meta


def _parameters_layout(layout: dict, replicated: dict) -> str | None:
    """Whether the model's parameters are the same on every rank, also where its tree is
    written per rank because buffers differ: such a model loads on another number of ranks
    (rank 0's copy, as a checkpoint saved by rank 0 alone would hold). None: not known (no
    model, or one given as a state_dict, whose parameters and buffers look alike)."""
    if "model" not in layout:
        return None
    if layout["model"] == "replicated":
        return "replicated"
    same = replicated.get("model_parameters")
    return None if same is None else "replicated" if same else "per_rank"


def _versions() -> dict:
    from .. import __version__
    return {"bagua_mpi": __version__, "torch": torch.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version, "numpy": np.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip()}


def _split(trees: dict, meta: dict) -> tuple[list[Tree], list[Tree]]:
    """(replicated trees, this rank's trees)."""
    shared = [trees[n] for n, where in meta["trees"].items() if where == "replicated"]
    mine = [trees[n] for n, where in meta["trees"].items() if where == "per_rank"]
    return shared, mine


def _mirror_attrs(f, meta: dict) -> None:
    """Human-readable copies of /meta (h5dump, h5ls -v); the reader uses /meta itself."""
    for key in ("format", "format_version", "step", "epoch", "world_size", "write_scheme",
                "created_utc"):
        if meta[key] is not None:
            f.attrs[key] = meta[key]


def _write_rank_group(f, rank: int, mine: list[Tree]) -> None:
    group = f.require_group("ranks").create_group(str(rank))
    group.attrs["rank"] = rank
    write_json(group, "meta", {"rank": rank, "trees": [t.name for t in mine]})
    for tree in mine:
        write_tree(group, tree.name, tree.skeleton, tree.leaves,
                   after_first=lambda: fault_point("rank_write", rank))


def _write_token(comm, rank: int, size: int, tmp: str, meta, shared, mine) -> str | None:
    """The token-passing scheme; returns the first error (on rank 0, all ranks'), or None."""
    error = None
    if rank == 0:
        try:
            with open_file(tmp, "w", userblock_size=USERBLOCK_SIZE, libver=LIBVER) as f:
                fault_point("temp_created", 0)
                _mirror_attrs(f, meta)
                write_json(f, "meta", meta)
                for tree in shared:
                    write_tree(f, tree.name, tree.skeleton, tree.leaves)
                _write_rank_group(f, 0, mine)
            rotation.fsync_path(tmp)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
            error = f"rank 0: {type(exc).__name__}: {exc}"
    else:
        error = comm.recv(source=rank - 1, tag=TAG)
        if error is None:
            try:
                with open_file(tmp, "r+") as f:
                    _write_rank_group(f, rank, mine)
                rotation.fsync_path(tmp)
            except Exception as exc:  # noqa: BLE001
                error = f"rank {rank}: {type(exc).__name__}: {exc}"
    if size > 1:
        comm.send(error, dest=(rank + 1) % size, tag=TAG)
        if rank == 0:
            error = comm.recv(source=size - 1, tag=TAG)
    return error


def _write_mpio(comm, rank: int, size: int, tmp: str, meta, shared, mine) -> str | None:
    """The parallel-HDF5 scheme: collective structure, collective filtered writes."""
    from .mpio import write_collective
    error = None
    try:
        write_collective(comm, rank, size, tmp, meta, shared, mine, _mirror_attrs, fault_point)
        rotation.fsync_path(tmp)
    except Exception as exc:  # noqa: BLE001 - an error inside a collective HDF5 call may
        error = f"rank {rank}: {type(exc).__name__}: {exc}"  # still hang the others
    errors = comm.gather(error, root=0)
    return next((e for e in errors if e), None) if rank == 0 else None


# -- 3. publish ----------------------------------------------------------------------------------

def _publish(directory: str, tmp: str, final: str, keep: int | None) -> None:
    seal(tmp)
    fault_point("before_replace", 0)
    rotation.publish(tmp, final)
    fault_point("before_latest", 0)
    rotation.write_latest(directory, os.path.basename(final))
    fault_point("before_prune", 0)
    removed = rotation.prune(directory, final, keep)
    if removed:
        logger.info("bagua_mpi checkpoint: removed %s", ", ".join(map(os.path.basename, removed)))


def save(directory: str, model=None, optimizer=None, *, step: int, epoch: int | None = None,
         extras=None, rank_extras=None, keep: int | None = 3, rng: bool = True,
         replicated: bool | None = None) -> str:
    """Save a checkpoint of the whole training state; collective over the library's ranks.

    Args:
        directory: where ``ckpt-<step>.h5`` and ``latest`` go (created if missing; a shared
            filesystem visible to all ranks).
        model: a ``torch.nn.Module`` (or a ``state_dict``).
        optimizer: a ``DistributedOptimizer`` (its wrapped optimizer's state plus this rank's
            algorithm state) or any ``torch.optim.Optimizer``; or several by name,
            ``{"G": opt_g, "D": opt_d}``, which ``load`` must then be given by the same names.
        step: the training step this state belongs to, e.g. the number of optimizer steps
            done (names the file; the same on all ranks).
        epoch: optional, returned by ``load``.
        extras: user state of rank 0 (tensors, arrays, numbers, strings, lists, dicts), e.g. an
            LR scheduler's ``state_dict()``; rank_extras: each rank's own such state.
        keep: how many checkpoints to keep (None: all).
        rng: save every rank's torch/CUDA/NumPy/Python RNG states (for an exact resume).
        replicated: None detects whether model and optimizer are bit-identical on all ranks
            (written once) or not (written per rank); True/False skips the detection.

    Returns the path of the new checkpoint (on every rank).

    Example::

        path = bagua_mpi.checkpoint.save("ckpt", model=model, optimizer=opt, step=step,
                                         extras={"scheduler": sched.state_dict()})
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise ValueError(f"epoch must be an integer or None, got {epoch!r}")
    step = int(step)
    rt = runtime.get()
    comm, rank, size = rt.topo.comm, rt.topo.rank, rt.topo.size
    rt.worker.drain()  # no library collective of ours may be in flight during the save
    consistency.check_called_everywhere(comm, "bm.checkpoint.save", "every rank calls it")
    started = time.perf_counter()

    error, trees, algorithms, named = None, {}, {}, None
    try:
        named = optimizers.by_name(optimizer)
        trees, algorithms = _encode_all(model, named, extras, rank_extras, rng)
    except (CheckpointError, TypeError, ValueError) as exc:
        error = str(exc)
    replicated_map, algorithm_state = _agree(comm, rank, size, step, keep, trees, error,
                                             named, replicated, _parameter_paths(model))
    per_rank_by_optimizer = (_per_rank_algorithms(comm, named, algorithms)
                             if optimizers.several(named) else {})
    write_scheme = scheme()
    meta = _meta(step, epoch, size, write_scheme, trees, replicated_map, named, algorithms,
                 algorithm_state, per_rank_by_optimizer)
    meta["node_leaders"] = rt.topo.node_leaders()
    shared, mine = _split(trees, meta)

    directory = os.path.abspath(directory)
    final = os.path.join(directory, rotation.checkpoint_name(step))
    setup = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            rotation.remove_stale_temporaries(directory)
            setup = (None, os.path.join(directory, rotation.temporary_name(
                os.path.basename(final))))
        except OSError as exc:
            setup = (f"rank 0: cannot prepare {directory}: {exc}", None)
    setup_error, tmp = comm.bcast(setup, root=0)
    if setup_error:
        raise CheckpointWriteError(f"checkpoint {final} was not saved: {setup_error}")
    fault_point("prepared", rank)

    if write_scheme == "mpio":
        error = _write_mpio(comm, rank, size, tmp, meta, shared, mine)
    else:
        error = _write_token(comm, rank, size, tmp, meta, shared, mine)
    if rank == 0:
        fault_point("written", 0)
        if error is None:
            try:
                _publish(directory, tmp, final, keep)
            except OSError as exc:
                error = f"rank 0: publishing failed: {exc}"
        if error is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    error = comm.bcast(error, root=0)
    if error is not None:
        raise CheckpointWriteError(f"checkpoint {final} was not saved ({error}); the previous "
                                   "checkpoint is untouched")
    if rank == 0:
        logger.info("bagua_mpi checkpoint: saved step %d to %s (%.1f MB, %.2f s, %s)", step,
                    final, os.path.getsize(final) / 1e6, time.perf_counter() - started,
                    write_scheme)
    return final
