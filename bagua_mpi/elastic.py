"""Horovod Elastic's API (``hvd.elastic.run``, ``TorchState``, ``ObjectState``) for MPI jobs.

An MPI job has a fixed set of ranks, so what Horovod Elastic does by re-forming the ring
in-process is done here in two ways:

* **Errors every rank sees** (``MismatchError``, ``JoinedRankError``: raised on all ranks at
  once): ``run`` restores the last ``commit()`` on every rank, takes the state's values from
  rank 0 again and calls the training function again (at most ``reset_limit`` times in a row
  without a commit). The restore is exact: models, optimizers and their algorithms' state are
  each rank's own commit, so the run goes on as one that never failed.
* **A rank that dies** ends the job (MPI cannot continue without it). With a checkpoint
  directory (``TorchState(..., checkpoint_dir=...)`` or ``BAGUA_MPI_ELASTIC_DIR``) every
  ``commit()`` is also written as a ``bagua_mpi.checkpoint`` (HDF5, atomic, no pickle), and
  when the job is restarted (Slurm ``--requeue``, see ``slurm/``) ``run`` resumes from the last
  commit, on the same or another number of ranks, and runs the reset callbacks (Horovod calls
  them when the world changed: that is where a script rescales its learning rate).

``ElasticSampler`` continues an epoch from the last commit. Not supported: adding or removing
hosts while running (no host discovery; ``HostsUpdatedInterrupt`` is never raised) and
in-process recovery from a dead rank.
"""
from __future__ import annotations

import copy
import functools

import torch

from . import collectives, config, consistency, runtime
from .exceptions import MismatchError
from .horovod.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from .optimizer import DistributedOptimizer

_RETRYABLE = (MismatchError, consistency.JoinedRankError)


class State:
    """Training state that ``commit()`` saves, ``restore()`` brings back and ``sync()`` makes
    equal on every rank (from rank 0)."""

    def __init__(self, bcast_object=None, get_rank=None):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called after a reset (e.g. to rescale the learning rate): a restore after
        an error every rank saw, or a resume from the checkpoint directory (a restarted job,
        possibly on another number of ranks)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._sync_after_reset()
        for callback in self._reset_callbacks:
            callback()

    def _sync_after_reset(self) -> None:
        """What a reset makes equal again before the callbacks: here everything, from rank 0."""
        self.sync()

    def on_hosts_updated(self, timestamp=None, update_res=None) -> None:
        """Never called: the ranks of an MPI job are fixed."""

    def commit(self) -> None:
        """Save the state (the point ``restore`` and a restarted job come back to)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """No-op: hosts never change under MPI (Horovod raises ``HostsUpdatedInterrupt``)."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """State of plain values given as keyword arguments, readable as attributes
    (``state.epoch``); ``sync`` broadcasts rank 0's values."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__()
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved_state = dict.fromkeys(kwargs)
        self._saved_state = copy.deepcopy(self._values())

    def _set_attrs(self) -> None:
        # copies: a value changed in place (a list appended to) must not change the commit
        for name, value in copy.deepcopy(self._saved_state).items():
            current = getattr(self, name, None)
            if isinstance(current, ElasticSampler):  # samplers keep their object
                current.load_state_dict(value if isinstance(value, dict)
                                        else value.state_dict())
            else:
                setattr(self, name, value)

    def _values(self) -> dict:
        return {name: (v.state_dict() if isinstance(v, ElasticSampler) else v)
                for name, v in ((n, getattr(self, n)) for n in self._saved_state)}

    def save(self) -> None:
        self._saved_state = copy.deepcopy(self._values())

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = collectives.broadcast_object(self._values(), 0)
            self._set_attrs()


class TorchState(ObjectState):
    """Models, optimizers, LR schedulers and values (``TorchState(model, optimizer, epoch=0)``).

    As Horovod's: keyword arguments that are models (``torch.nn.Module``), optimizers or LR
    schedulers are handled as ``model`` and ``optimizer`` are (``TorchState(generator, opt_g,
    discriminator=d, opt_d=opt_d, scheduler=sched, epoch=0)``): each is saved, restored and
    synchronised in place, so the objects the training loop holds are the ones restored, and
    assigning another one (``state.model = new_model``) hands it over and saves it. The other
    keyword arguments are values.

    A ``DistributedOptimizer``'s algorithm state (error feedback, peer models, step count) is
    committed and restored with it, and ``restore`` first abandons the iteration the error
    interrupted (``DistributedOptimizer.abandon_iteration``), so training after a restore goes
    on exactly as it would have from the commit, however many restores a commit sees.

    ``checkpoint_dir`` (default ``BAGUA_MPI_ELASTIC_DIR``): also write every commit there, and
    let ``run`` resume from it after a restart. The values and the schedulers' state dicts then
    must be numbers, strings, lists or dicts (they go to the checkpoint's JSON ``extras``).
    """

    def __init__(self, model=None, optimizer=None, checkpoint_dir: str | None = None, **kwargs):
        for name, value in (("model", model), ("optimizer", optimizer)):
            if value is not None and _kind_of(value) is None:
                raise TypeError(f"TorchState({name}=...) takes a torch.nn.Module, an optimizer "
                                f"or an LR scheduler, got {type(value).__name__}")
        handled = {name: value for name, value in
                   {"model": model, "optimizer": optimizer, **kwargs}.items()
                   if value is not None and _kind_of(value) is not None}
        self.model, self.optimizer = model, optimizer
        for name, value in handled.items():
            setattr(self, name, value)
        # kind -> name -> object, names sorted: synchronising and checkpointing are collective,
        # in the same order on every rank whatever order the keyword arguments came in
        self._snapshots = {kind: {} for kind in (*_KINDS, "algorithms")}
        self._handled = {kind: {} for kind in _KINDS}  # from here on, __setattr__ hands over
        for name in sorted(handled):
            self._handled[_kind_of(handled[name])][name] = handled[name]
        self.checkpoint_dir = checkpoint_dir or config.elastic_dir()
        self.commits = 0
        super().__init__(**{n: v for n, v in kwargs.items() if n not in handled})
        self._snapshot()

    def __setattr__(self, name, value) -> None:
        handled = self.__dict__.get("_handled")
        kind = next((k for k, named in (handled or {}).items() if name in named), None)
        if kind is not None:
            if _kind_of(value) != kind:
                raise TypeError(f"state.{name} holds {_KIND_WORDS[kind]}; a "
                                f"{type(value).__name__} is not one")
            handled[kind][name] = value
            self._snapshot_one(kind, name)
        super().__setattr__(name, value)

    # -- save, restore, sync ---------------------------------------------------------------------
    def _snapshot(self) -> None:
        for kind, named in self._handled.items():
            for name in named:
                self._snapshot_one(kind, name)

    def _snapshot_one(self, kind: str, name: str) -> None:
        value = self._handled[kind][name]
        if isinstance(value, DistributedOptimizer):
            # this rank's own state (ZeRO: its slices, not the gathered whole, which would
            # undo the sharding's memory saving at every commit), and the algorithm's, which
            # is already a copy (one float per parameter for error feedback: not twice)
            self._snapshots[kind][name] = copy.deepcopy(value.local_state_dict())
            self._snapshots["algorithms"][name] = value.algorithm_state_dict()
        else:
            self._snapshots[kind][name] = copy.deepcopy(value.state_dict())
            self._snapshots["algorithms"].pop(name, None)

    def save(self) -> None:
        super().save()
        self._snapshot()
        self.commits += 1
        if self.checkpoint_dir:
            from . import checkpoint
            checkpoint.save(self.checkpoint_dir, model=self._checkpoint_model(),
                            optimizer=self._checkpoint_optimizer(), step=self.commits, keep=2,
                            extras={"elastic": self._saved_state, "commits": self.commits,
                                    "schedulers": self._snapshots["schedulers"]})

    def _checkpoint_model(self):
        """One model as itself (the layout of a single-model checkpoint), several as one
        ``ModuleDict`` by name."""
        return _one_or_several(self._handled["models"], torch.nn.ModuleDict)

    def _checkpoint_optimizer(self):
        """One optimizer as itself, several by name (``checkpoint.save(optimizer={...})``)."""
        return _one_or_several(self._handled["optimizers"], dict)

    def restore(self) -> None:
        for opt in self._handled["optimizers"].values():
            if isinstance(opt, DistributedOptimizer):
                opt.abandon_iteration()
        for kind, named in self._handled.items():
            for name, value in named.items():
                # a copy: torch.optim keeps the tensors it loads and its steps change them in
                # place, so the snapshot would not be the commit at the next restore
                saved = copy.deepcopy(self._snapshots[kind][name])
                if isinstance(value, DistributedOptimizer):
                    value.load_local_state_dict(saved)
                    value.load_algorithm_state_dict(self._snapshots["algorithms"][name])
                else:
                    value.load_state_dict(saved)
        super().restore()

    def sync(self) -> None:
        from .horovod.functions import broadcast_optimizer_state, broadcast_parameters
        for model in self._handled["models"].values():
            broadcast_parameters(model.state_dict(), root_rank=0)
        for opt in self._handled["optimizers"].values():
            broadcast_optimizer_state(opt, root_rank=0)
        for scheduler in self._handled["schedulers"].values():
            scheduler.load_state_dict(collectives.broadcast_object(scheduler.state_dict(), 0))
        super().sync()
        self._snapshot()

    def _sync_after_reset(self) -> None:
        """Only the values come from rank 0 again. After a restore (or a resume) every rank
        holds its own last commit of the models and optimizers: the same on every rank where
        the algorithm keeps replicas, and each rank's own where it averages models
        (``decentralized``), whose models and peer estimates a broadcast would set apart."""
        ObjectState.sync(self)

    def resume(self) -> bool:
        """Load the last commit from ``checkpoint_dir`` if there is one (collective)."""
        if not self.checkpoint_dir:
            return False
        from . import checkpoint
        if checkpoint.latest(self.checkpoint_dir) is None:
            return False
        # the extras alone first (verified, nothing restored), so that other schedulers than
        # the commit's are refused before the models and optimizers are touched
        found = checkpoint.load(self.checkpoint_dir, restore_rng=False)
        extras = found.extras or {}
        saved = extras.get("schedulers", {})
        if sorted(saved) != sorted(self._handled["schedulers"]):
            raise checkpoint.CheckpointError(
                f"{found.path} holds LR schedulers {sorted(saved)}, this TorchState has "
                f"{sorted(self._handled['schedulers'])}: give it the same schedulers")
        info = checkpoint.load(found.path, model=self._checkpoint_model(),
                               optimizer=self._checkpoint_optimizer(), verify=False)
        for name, scheduler in self._handled["schedulers"].items():
            scheduler.load_state_dict(saved[name])
        self._saved_state = dict(extras.get("elastic", self._saved_state))
        self.commits = int(extras.get("commits", info.step))
        self._set_attrs()
        self._snapshot()
        return True


_KINDS = {"models": lambda v: isinstance(v, torch.nn.Module),
          "optimizers": lambda v: isinstance(v, torch.optim.Optimizer),
          "schedulers": lambda v: isinstance(v, torch.optim.lr_scheduler.LRScheduler)}
_KIND_WORDS = {"models": "a model", "optimizers": "an optimizer", "schedulers": "an LR scheduler"}


def _one_or_several(named: dict, several):
    """None, the one object of ``named``, or ``several(named)`` for more than one."""
    if len(named) > 1:
        return several(named)
    return next(iter(named.values()), None)


def _kind_of(value) -> str | None:
    """Which kind of handled object ``value`` is (a key of ``_KINDS``), or None: a value."""
    return next((kind for kind, test in _KINDS.items() if test(value)), None)


class ElasticSampler:
    """Horovod's ``ElasticSampler`` for a fixed set of ranks: this rank's share of the
    (shuffled) indices of an epoch, minus the batches already processed, so that a restore or a
    resumed job continues the epoch where its last commit left it.

    Put it in the state (``TorchState(..., sampler=sampler)``): its ``state_dict`` (epoch and
    processed count) is what gets committed. ``record_batch(batch_idx, batch_size)`` after each
    step; ``set_epoch(epoch)`` at the start of an epoch resets the processed count.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = runtime.size()
        self.rank = runtime.rank()
        self._indices = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """All ranks processed batch ``batch_idx`` of ``batch_size`` samples each."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices) -> None:
        self.processed_num += len(indices) * self.num_replicas

    def reset(self) -> None:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        remaining = order[min(self.processed_num, n):]
        per_rank = -(-len(remaining) // self.num_replicas) if remaining else 0
        padded = remaining + remaining[:per_rank * self.num_replicas - len(remaining)]
        self._indices = padded[self.rank:per_rank * self.num_replicas:self.num_replicas]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.processed_num = int(state["processed_num"])
        self.reset()

    def __iter__(self):
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)

    def __getstate__(self):  # the state carries the counters, not the dataset
        return self.state_dict()

    def __deepcopy__(self, memo):
        return dict(self.state_dict())


def run(func=None, *, reset_limit: int = 3):
    """Decorator for ``train(state, ...)``: sync the state from rank 0, or resume it from the
    last persistent commit if there is one and run the reset callbacks, then call ``train``; on
    an error that every rank raised, restore the last commit (``state.on_reset``: for a
    ``TorchState`` the values come from rank 0 again, each rank keeps its restored models),
    run the reset callbacks and call it again."""
    if func is None:
        return functools.partial(run, reset_limit=reset_limit)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        runtime.get()  # NotInitializedError before anything else
        if isinstance(state, TorchState) and state.resume():
            # A restarted job is Horovod's reset: the world may have another size now, and
            # the reset callbacks are where a script adapts (e.g. rescales its learning rate,
            # which the restored optimizer state brought from the old world).
            state.on_reset()
        else:
            state.sync()
        resets, commits = 0, getattr(state, "commits", None)
        while True:
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                state.on_reset()
            except _RETRYABLE:
                now = getattr(state, "commits", None)
                resets = 1 if (now is not None and now != commits) else resets + 1
                commits = now
                if resets > reset_limit:
                    raise
                state.restore()
                state.on_reset()

    return wrapper


__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
