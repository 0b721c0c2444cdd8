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
        self._saved_state = self._values()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
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
    """Models, optimizers and values (``TorchState(model, optimizer, epoch=0, batch=0)``).

    As Horovod's: keyword arguments that are models (``torch.nn.Module``) or optimizers join
    ``model`` and ``optimizer`` (``TorchState(generator, opt_g, discriminator=d, opt_d=opt_d,
    epoch=0)``, a GAN). Each is saved, restored and synchronised in place: the objects the
    training loop holds are the ones restored. The other keyword arguments are values.

    A ``DistributedOptimizer``'s algorithm state (error feedback, peer models, step count) is
    committed and restored with it, and ``restore`` first abandons the iteration the error
    interrupted (``DistributedOptimizer.abandon_iteration``), so training after a restore goes
    on exactly as it would have from the commit.

    ``checkpoint_dir`` (default ``BAGUA_MPI_ELASTIC_DIR``): also write every commit there, and
    let ``run`` resume from it after a restart. The values then must be numbers, strings,
    lists or dicts (they go to the checkpoint's JSON ``extras``).
    """

    def __init__(self, model=None, optimizer=None, checkpoint_dir: str | None = None, **kwargs):
        handled = {"model": model, "optimizer": optimizer,
                   **{name: v for name, v in kwargs.items() if _is_model(v) or _is_optimizer(v)}}
        for name in ("model", "optimizer"):
            value = handled[name]
            if value is not None and not (_is_model(value) or _is_optimizer(value)):
                raise TypeError(f"TorchState({name}=...) takes a torch.nn.Module or an "
                                f"optimizer, got {type(value).__name__}")
        # sorted by name: synchronising and checkpointing are collective, the same order on
        # every rank whatever order the keyword arguments came in
        self._models = {n: v for n, v in sorted(handled.items()) if _is_model(v)}
        self._optimizers = {n: v for n, v in sorted(handled.items()) if _is_optimizer(v)}
        for name, value in handled.items():
            setattr(self, name, value)
        self.checkpoint_dir = checkpoint_dir or config.elastic_dir()
        self.commits = 0
        super().__init__(**{n: v for n, v in kwargs.items() if n not in handled})
        self._snapshots: dict = {}
        self._snapshot()

    def _snapshot(self) -> None:
        self._snapshots = {
            "models": {n: copy.deepcopy(m.state_dict()) for n, m in self._models.items()},
            "optimizers": {n: copy.deepcopy(o.state_dict()) for n, o in self._optimizers.items()},
            # already a copy (one float per parameter for error feedback: not twice)
            "algorithms": {n: o.algorithm_state_dict()
                           for n, o in self._optimizers.items() if _is_distributed(o)}}

    def save(self) -> None:
        super().save()
        self._snapshot()
        self.commits += 1
        if self.checkpoint_dir:
            from . import checkpoint
            checkpoint.save(self.checkpoint_dir, model=self._checkpoint_model(),
                            optimizer=self._checkpoint_optimizer(), step=self.commits, keep=2,
                            extras={"elastic": self._saved_state, "commits": self.commits})

    def _checkpoint_model(self):
        """One model as itself (the layout of a single-model checkpoint), several as one
        ``ModuleDict`` by name."""
        if len(self._models) > 1:
            return torch.nn.ModuleDict(self._models)
        return next(iter(self._models.values()), None)

    def _checkpoint_optimizer(self):
        if len(self._optimizers) > 1:
            return dict(self._optimizers)
        return next(iter(self._optimizers.values()), None)

    def restore(self) -> None:
        for opt in self._optimizers.values():
            if _is_distributed(opt):
                opt.abandon_iteration()
        for name, model in self._models.items():
            model.load_state_dict(self._snapshots["models"][name])
        for name, opt in self._optimizers.items():
            opt.load_state_dict(self._snapshots["optimizers"][name])
            if name in self._snapshots["algorithms"]:
                opt.load_algorithm_state_dict(self._snapshots["algorithms"][name])
        super().restore()

    def sync(self) -> None:
        from .horovod.functions import broadcast_optimizer_state, broadcast_parameters
        for model in self._models.values():
            broadcast_parameters(model.state_dict(), root_rank=0)
        for opt in self._optimizers.values():
            broadcast_optimizer_state(opt, root_rank=0)
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
        info = checkpoint.load(self.checkpoint_dir, model=self._checkpoint_model(),
                               optimizer=self._checkpoint_optimizer())
        extras = info.extras or {}
        self._saved_state = dict(extras.get("elastic", self._saved_state))
        self.commits = int(extras.get("commits", info.step))
        self._set_attrs()
        self._snapshot()
        return True


def _is_model(value) -> bool:
    return isinstance(value, torch.nn.Module)


def _is_optimizer(value) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def _is_distributed(opt) -> bool:
    return isinstance(opt, DistributedOptimizer)


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
