"""``DistributedOptimizer``: wrap any torch optimizer for data-parallel training.

    opt = bagua_mpi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    bagua_mpi.broadcast_parameters(model.state_dict(), root_rank=0)
    bagua_mpi.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # gradient communication overlaps with this
        opt.step()                        # updates (backward() averaged the gradients)

The wrapper owns the optimizer (composition; no dynamic subclassing of the user's class) and
forwards ``param_groups``, ``state``, ``state_dict`` and ``load_state_dict``. It derives from
``torch.optim.Optimizer`` only so that ``isinstance`` checks (LR schedulers) accept it.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings

import torch

from . import (backends, collectives, config, consistency, layout, optimizer_hooks, runtime,
               sharding)
from .algorithms import AlgorithmContext, UnsupportedOptionError, WrapOptions, create
from .compression import Compression
from .engine import Engine, StepClock, ownership
from .engine.policy import auto_overlap
from .consistency import ranks_text
from .exceptions import DiscardedExchangeWarning, MismatchError, MisuseError
from .ops import Average, ReduceOp, Sum
from .timeline import Timeline

logger = logging.getLogger(__name__)
# torch.amp.GradScaler's module: it reads param_groups to unscale (see the property)
_GRAD_SCALER = "torch.amp.grad_scaler"
_REPLACES_NOTE = ("earlier DistributedOptimizers over these parameters still open on this "
                  "rank, which this one closes; close() them on every rank or on none")


class DistributedOptimizer(torch.optim.Optimizer):
    """Data-parallel wrapper around ``optimizer``.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        named_parameters: ``model.named_parameters()``, for readable errors and timelines.
        algorithm: a registered name (``bagua_mpi.algorithms.names()``) or an ``Algorithm``.
        compression: ``Compression.none`` / ``fp16`` / ``bf16`` (Horovod's objects work too).
        backward_passes_per_step: gradients are communicated every this many backward passes
            (local accumulation in between); call ``step()`` after the last one.
        op: ``Average`` (default) or ``Sum`` of the gradients over ranks.
        gradient_predivide_factor: divide gradients by this before the sum and by
            ``size / factor`` after it (Average only), to keep float16 sums in range.
        bucket_size_mb: byte budget of a bucket (25 MB, as DDP: on a 1 Gbit link the compressed
            algorithms ran 1.6x faster than allreduce with 4 MB buckets and 2.7-3.1x with
            25 MB, since each bucket costs a few collectives of fixed latency).
        overlap / flatten / hierarchical: the execution optimizer's O, F, H switches
            (hierarchical=None takes ``bagua_mpi``'s global default; overlap=None decides
            from the hardware, see ``engine.policy.auto_overlap``; ``opt.overlap`` tells).
        profile_order: bucket in the profiled order of gradient readiness (else in reverse
            declaration order, as DDP and Horovod assume).
        find_unused_parameters: when each step's gradients are synchronized (the end of its
            last backward pass), parameters that no rank used in the iteration get
            ``grad = None`` (as in single-process training); costs one tiny allreduce per step.
            Without it, an unused parameter is averaged as a zero gradient from the ranks that
            did not use it. Either way no rank hangs.
        timeline: path prefix for a Chrome-trace timeline (default ``BAGUA_MPI_TIMELINE``).
        process_set: train over a subset of the ranks (an object with ``.topology``, the
            topology of the set's communicator, such as ``bagua_mpi.ProcessSet``); every rank
            of the set wraps its optimizer, the others do not.
        backend: who carries this optimizer's payloads: ``"auto"``, ``"mpi"``, ``"nccl"``,
            ``"nccl_hierarchical"`` or ``"gloo"`` (default: ``init``'s choice, else
            ``BAGUA_MPI_BACKEND``, else auto: NCCL for a CUDA model where it can run, MPI
            otherwise); ``bagua_mpi.backends`` says what each does and what it needs.
            ``opt.backend`` tells what was chosen.
        sparse_as_dense: sparse gradients (``nn.Embedding(sparse=True)``) are exchanged sparse by
            default, as Horovod does: every rank's rows all-gathered and coalesced, outside the
            buckets, so ``p.grad`` stays sparse (``torch.optim.SparseAdam`` works); True
            densifies them into the buckets. Algorithms that average models and ``zero_stage``
            > 0 always densify.
        zero_stage: ZeRO (``bagua_mpi.sharding``): 0 (default) every rank holds all optimizer
            state; 1 each rank keeps and updates the state of its 1/n slice of every bucket and
            the parameters are all-gathered after the step; 2 also reduce-scatters the
            gradients, so each rank keeps only its slice of them (``p.grad`` is None after
            ``synchronize()``: clip with ``opt.clip_grad_norm_``). Needs an elementwise
            optimizer and flattened buckets; checkpoints hold the logical, unsharded state.
        zero_elementwise: with ``zero_stage``, declare that an optimizer from outside
            torch.optim (a third-party one, or a subclass with a ``step`` of its own) updates
            each element from that element's own state alone, as Lion or signSGD do; without
            it such an optimizer is refused, since one that takes norms over whole tensors
            (LAMB, LARS) would step each rank's slice differently, silently.

    An option the algorithm cannot honour raises ``UnsupportedOptionError`` here, naming the
    option and what to use instead (docs/training.md's algorithm x option table lists them).
    """

    zero_stage = 0  # (class defaults: subclasses that skip __init__ are unsharded)
    _sharded = None
    # torch.optim.Optimizer's per-instance hook tables (its register_*_hook methods fill them)
    _optimizer_step_pre_hooks = optimizer_hooks.HookTable()
    _optimizer_step_post_hooks = optimizer_hooks.HookTable()
    _optimizer_state_dict_pre_hooks = optimizer_hooks.HookTable()
    _optimizer_state_dict_post_hooks = optimizer_hooks.HookTable()
    _optimizer_load_state_dict_pre_hooks = optimizer_hooks.HookTable()
    _optimizer_load_state_dict_post_hooks = optimizer_hooks.HookTable()

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 algorithm="gradient_allreduce", compression=Compression.none,
                 backward_passes_per_step: int = 1, op=Average,
                 gradient_predivide_factor: float = 1.0, *, bucket_size_mb: float = 25.0,
                 overlap: bool | None = None, flatten: bool = True,
                 hierarchical: bool | None = None,
                 profile_order: bool = True, find_unused_parameters: bool = False,
                 timeline: str | None = None, process_set=None, backend: str | None = None,
                 zero_stage: int = 0, sparse_as_dense: bool = False,
                 zero_elementwise: bool = False):
        # Deliberately no super().__init__: the wrapped optimizer holds the real state.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer")
        if (isinstance(backward_passes_per_step, bool)
                or not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1):
            raise ValueError("backward_passes_per_step must be a positive integer, got "
                             f"{backward_passes_per_step!r}")
        op = ReduceOp.parse(op)
        if op not in (Average, Sum):
            raise ValueError(f"op must be Average or Sum for gradients, got {op.name}")
        if not gradient_predivide_factor > 0:
            raise ValueError("gradient_predivide_factor must be positive, got "
                             f"{gradient_predivide_factor!r}")
        if gradient_predivide_factor != 1.0 and op is not Average:
            raise ValueError("gradient_predivide_factor only applies with op=Average")
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb!r}")
        if not isinstance(sparse_as_dense, bool):
            raise ValueError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
        if isinstance(zero_stage, bool) or zero_stage not in sharding.STAGES:
            raise ValueError(f"zero_stage must be one of {sharding.STAGES}, got {zero_stage!r}")
        if not isinstance(zero_elementwise, bool):
            raise ValueError(f"zero_elementwise must be a bool, got {zero_elementwise!r}")
        if zero_elementwise and not zero_stage:
            raise ValueError("zero_elementwise only applies with zero_stage 1 or 2")
        if zero_stage:
            sharding.check_optimizer(optimizer, zero_stage, zero_elementwise)
            if not flatten:
                raise UnsupportedOptionError(f"zero_stage={zero_stage} is not supported with "
                                             f"flatten=False: slices are cut from the flat "
                                             f"bucket buffers")
            if find_unused_parameters:
                raise UnsupportedOptionError(
                    f"zero_stage={zero_stage} is not supported with find_unused_parameters="
                    f"True: a slice may span used and unused parameters, and a sharded step "
                    f"updates whole slices")
        rt = runtime.get()
        topo = rt.topo if process_set is None else process_set.topology
        if topo is None:
            raise ValueError(f"rank {rt.topo.rank} is not in {process_set!r}: only its ranks "
                             f"may wrap an optimizer for it")
        self.optimizer = optimizer
        self.compression = Compression.parse(compression)
        self.algorithm = create(algorithm)
        if backend is not None:  # checked at wrap time: a missing GPU or NCCL fails here
            backend = backends.resolve(backend)
            backends.check_available(backend)
        hierarchical = rt.hierarchical if hierarchical is None else bool(hierarchical)
        self.algorithm.check_options(WrapOptions(
            compression=self.compression, hierarchical=hierarchical, average=op is Average,
            gradient_predivide_factor=gradient_predivide_factor, zero_stage=zero_stage))
        params, names, self._frozen = _trainable_parameters(optimizer, named_parameters)
        self._groups = WrappedGroups(optimizer)
        wrapped = [p for g in optimizer.param_groups for p in g["params"]]
        replaced = ownership.open_over(wrapped)  # taken over below (engine/ownership.py)
        device = params[0].device.type if params else "cpu"
        elsewhere = backends.off_current_device({p.device.index for p in params if p.is_cuda},
                                                torch.cuda.current_device()
                                                if device == "cuda" else None)
        if elsewhere:
            logger.warning("bagua_mpi rank %d: %s", rt.topo.rank, elsewhere)
        if process_set is None:  # the node's ranks compare the GPUs their models are on
            mine = backends.model_gpu(params[0]) if params else None
            backends.use_model_gpus(rt.worker.run(lambda: topo.intra.allgather(mine),
                                                  ("allgather_object",)))
        chosen = backends.resolve(backend)
        wire = backends.wire(chosen, device)
        # what every rank must set alike: any of these differing makes the ranks exchange
        # different bytes, or wait in different libraries (auto is agreed on below)
        settings = {"algorithm": self.algorithm.config(),
                    "backend": "auto" if chosen == "auto" else wire,
                    "compression": self.compression.name,
                    "op": op.name, "gradient_predivide_factor": gradient_predivide_factor,
                    "backward_passes_per_step": backward_passes_per_step,
                    "hierarchical": hierarchical, "zero_stage": zero_stage,
                    "bucket_size_mb": bucket_size_mb, "flatten": flatten,
                    "find_unused_parameters": find_unused_parameters,
                    "sparse_as_dense": sparse_as_dense,
                    "replaces_open_optimizers": len(replaced)}
        notes = check_models_agree(names, params, None if process_set is None else topo,
                                   settings=settings,
                                   notes={"backend": backends.why_wire(chosen, device),
                                          "wire": wire, "gpus_shared": backends.sharing_text(),
                                          "replaces_open_optimizers": _REPLACES_NOTE})
        if chosen == "auto":
            backend = _agreed_auto(notes, backend)
        elif device == "cuda" and chosen in backends.NCCL_BACKENDS:
            _refuse_shared_gpus(notes, chosen)
        size = topo.size
        ctx = AlgorithmContext(
            topo=topo, average=op is Average,
            prescale=1.0 / gradient_predivide_factor,
            postscale=(gradient_predivide_factor / size) if op is Average else 1.0,
            hierarchical=hierarchical, compression=self.compression,
            param_numels={n: layout.real_geometry(p)[2] for n, p in zip(names, params)},
            param_strides=layout.strides_not_row_major(names, params))
        self.impl = self.algorithm.reify(ctx)
        self.impl.use_clock(self._step_clock())  # the one step clock: this wrapper advances it
        self.impl.backend = backend
        self.impl.zero_stage = zero_stage
        self.zero_stage = zero_stage
        if zero_stage and hierarchical:
            sharding.check_uniform_nodes(topo, zero_stage)
        self._sharded = (sharding.ShardedOptimizer(optimizer, zero_stage, topo, backend,
                                                   hierarchical, self.impl.wire)
                         if zero_stage else None)
        _ = self.backend  # decided and logged once, at wrap time
        self.impl.wrapped_optimizer = optimizer
        self.impl.bind_optimizer(optimizer)
        prefix = timeline if timeline is not None else config.timeline_prefix()
        self.timeline = Timeline(prefix, rt.topo.rank) if prefix else None
        if overlap is None:
            overlap = auto_overlap(params, topo)
        self.overlap = bool(overlap)
        ownership.close_replaced(replaced, wrapped, by="a DistributedOptimizer")
        self._engine = Engine(params, names, self.impl,
                              bucket_bytes=int(bucket_size_mb * 1024 * 1024), overlap=overlap,
                              flatten=flatten, profile_order=profile_order,
                              backward_passes_per_step=backward_passes_per_step,
                              find_unused_parameters=find_unused_parameters,
                              timeline=self.timeline, clock=self._step_clock(),
                              shard_parts=size if zero_stage else 1,
                              sparse_as_dense=sparse_as_dense, process_set=process_set)
        self._synchronized = False  # set by an explicit synchronize() before step()
        self._skip_sync = False
        self._discard_told = False  # zero_grad() discarded an exchange: said once
        # the parameters are compared across the ranks before this optimizer's first step,
        # except by the algorithms that average models (they bring the models together)
        self._start_checked = self.algorithm.averages_models
        self.steps = 0
        # Horovod's public arguments, readable as attributes
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor

    # -- what torch.optim.Optimizer users touch ---------------------------------------------------
    @property
    def param_groups(self):
        """The wrapped optimizer's groups. ``torch.amp.GradScaler`` reading them (to unscale
        and check the gradients, which the step's last backward pass left averaged) tells the
        algorithm that a loss scaler is in use."""
        engine = getattr(self, "_engine", None)
        if engine is not None and sys._getframe(1).f_globals.get("__name__") == _GRAD_SCALER:
            self.impl.on_loss_scaling()
            engine.loss_scaler_read = True
            if (self._sharded is not None and self._sharded.stage == 2
                    and self._engine.buckets is not None):
                # the gradients are slices, not p.grad: the scaler reads those (collective,
                # as every rank's scaler unscales at the same point of the step)
                if self._sharded.inner is None:
                    self._sharded.attach(self._engine.buckets)
                return self._sharded.loss_scaler_groups()
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    @optimizer_hooks.state_dict_hooks
    def state_dict(self):
        """The wrapped optimizer's state dict; with ``zero_stage`` the logical (unsharded) one,
        gathered from every rank (collective), which any world size and stage loads."""
        if self._sharded is not None:
            return self._sharded.state_dict()
        return self.optimizer.state_dict()

    @optimizer_hooks.load_state_dict_hooks
    def load_state_dict(self, state_dict) -> None:
        if self._sharded is not None:
            self._sharded.load_state_dict(state_dict)  # this rank keeps its slices
        else:
            self.optimizer.load_state_dict(state_dict)
            match_state_layouts(self.optimizer)  # a file's or a wire's state is row-major
        # loading replaces the param_groups dicts: algorithms holding them must see the new ones
        self.impl.bind_optimizer(self.optimizer)

    def local_state_dict(self) -> dict:
        """The wrapped optimizer's state as this rank holds it, for an in-memory snapshot that
        this rank loads back (``load_local_state_dict``; an elastic commit): with
        ``zero_stage`` only this rank's slices, not gathered (no communication, 1/n of the
        memory ``state_dict()`` takes); otherwise ``state_dict()``. Not for checkpoints, which
        need the logical state."""
        if self._sharded is None:
            return self.state_dict()
        return self._sharded.local_state_dict()

    def load_local_state_dict(self, local: dict) -> None:
        if self._sharded is None:
            self.load_state_dict(local)
            return
        self._sharded.load_local_state_dict(local)
        self.impl.bind_optimizer(self.optimizer)  # loading replaced the groups' dicts

    def add_param_group(self, param_group) -> None:
        raise NotImplementedError("parameters cannot be added to a DistributedOptimizer: build "
                                  "the optimizer with all groups, then wrap it, or add the "
                                  "group to the wrapped optimizer and wrap that again (the "
                                  "new DistributedOptimizer takes the parameters over)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: ``None`` by default, as ``torch.optim`` does (backward's fresh
        gradient is then copied into its bucket once, which measured cheaper than zeroing the
        buckets and letting autograd add into them: -15 ms a step for 84 MB of gradients on
        2 cores); ``set_to_none=False`` zeroes the buckets and keeps ``.grad`` their views.

        Between the step's last backward pass and ``step()`` it discards the synchronized
        gradients: the step is skipped, on every rank alike when every rank calls it, and what
        the exchange fed into the algorithm's state is dropped (``on_step_skipped``). The
        first such discard warns (``DiscardedExchangeWarning``): in a GAN's loop it means a
        pass meant for another optimizer exchanged these gradients for nothing.

        Raises ``MisuseError`` between the backward passes of one step
        (``backward_passes_per_step`` > 1): the gradients counted so far are about to be
        communicated, and zeroing them would make this rank contribute something else than it
        computed.
        """
        pending = self._engine.pending_description()
        if pending:
            raise MisuseError(f"rank {runtime.get().topo.rank}: zero_grad() called while "
                             f"{pending}; call zero_grad() before backward(), or after "
                             f"step() / synchronize()")
        dropped = self._engine.discard_synchronized()
        if dropped is not None and not self._discard_told:
            self._discard_told = True
            warnings.warn(_discarded_exchange_message(runtime.get().topo.rank,
                                                      self.impl.algorithm.name, dropped),
                          DiscardedExchangeWarning, stacklevel=2)
        if set_to_none:
            self.optimizer.zero_grad(set_to_none=True)  # the engine re-absorbs them later
        else:
            self._engine.zero_grads()

    def synchronize(self) -> None:
        """Wait for (and finish) this iteration's gradient communication: Horovod's call. The
        step's last backward pass already finishes it as it ends, so after ``backward()`` this
        does nothing, as does calling it again before ``step()``."""
        self._check_open("synchronize()")
        if not self._engine.synchronized_for_step():
            self._engine.synchronize()
        self._synchronized = True

    def abandon_iteration(self) -> None:
        """Drop the iteration under way, as if it had not begun: gradients counted for the
        coming exchange, buckets on the wire (waited for) and synchronized gradients no
        ``step()`` took are forgotten, without touching the algorithm's state (a skipped step,
        by contrast, clears what the exchange fed into it). Call it on every rank before
        restoring state saved between steps after an error; ``elastic.TorchState.restore``
        does."""
        self._engine.abandon_iteration()
        self._synchronized = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` between steps (Horovod's method); every rank must
        call it with the same value before the same step."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got "
                             f"{passes!r}")
        pending = self._engine.pending_description()
        if pending:
            raise MisuseError(f"rank {runtime.get().topo.rank}: set_backward_passes_per_step() "
                              f"called while {pending}; call it between step() and the next "
                              f"backward()")
        self.backward_passes_per_step = passes
        self._engine.passes = passes

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside skips synchronization (call ``synchronize()`` yourself first)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally (no communication)."""
        self._engine.communicating = False
        try:
            yield
        finally:
            self._engine.communicating = True

    @optimizer_hooks.runs_step_hooks
    def step(self, closure=None):
        self._check_open("step()")
        self._groups.check_unchanged(self._engine.worker_rank)
        self._frozen.check_untrained(self._engine.worker_rank)
        if self.impl.wants_flat_params:
            self._engine.check_params_in_buckets()
        self.impl.on_step_start(self.steps)
        if not self._engine.synchronized_for_step():
            if not self._skip_sync:
                self._engine.synchronize()
            elif self._engine.pending_description():
                # stepping now would apply this rank's own gradients: the ranks would diverge
                raise MisuseError(
                    f"rank {runtime.get().topo.rank}: step() inside skip_synchronize() while "
                    f"{self._engine.pending_description()}; call synchronize() after "
                    f"backward() and before the step")
        if not self._start_checked:
            self._start_checked = True
            if consistency.enabled():  # the agreement check's switch turns this off too
                self._engine.check_same_start()
        self._synchronized = False
        self.impl.before_step(self.optimizer)
        if self._sharded is not None:
            if self._sharded.inner is None:  # the buckets exist from the first synchronize
                self._sharded.attach(self._engine.buckets)
            loss = self._sharded.step(closure)
        else:
            loss = self.impl.optimizer_step(self.optimizer, closure)
        self._engine.step_taken()
        exchange_start = time.perf_counter()
        self.impl.after_step(self.optimizer)
        if not self.impl.communicates_gradients:  # their exchange (of weights) happens here
            self._engine.wait_seconds += time.perf_counter() - exchange_start
        self.steps += 1  # between steps: the index of the next one (as checkpointed)
        self.impl.check_state_claimed()
        return loss

    # -- the step clock ------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Completed ``step()`` calls: the one step clock, which the engine (at bucket launch)
        and the algorithm (``impl.step``) read."""
        return self._step_clock().step

    @steps.setter
    def steps(self, value: int) -> None:
        self._step_clock().step = int(value)

    def _step_clock(self) -> StepClock:
        clock = self.__dict__.get("_clock")
        if clock is None:  # created on first use (subclasses may skip this __init__)
            clock = self.__dict__["_clock"] = StepClock()
        return clock

    # -- algorithm state, lifecycle -----------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        """This rank's algorithm state (residuals, peer models, stage...): tensors and numbers,
        all of them copies (nothing in it changes as training goes on)."""
        return {"config": self.algorithm.config(), "steps": self.steps,
                "state": self.impl.state_dict()}

    def load_algorithm_state_dict(self, state: dict) -> None:
        if state.get("config", {}).get("name") != self.algorithm.name:
            raise ValueError(f"algorithm state of {state.get('config', {}).get('name')!r} "
                             f"cannot be loaded into {self.algorithm.name!r}")
        # state of buckets not built yet is held by the framework and applied when they are
        self.impl.load_state_dict(state["state"])
        # The step is stored twice (here and as state["state"]["step"], equal in every
        # checkpoint written so far); both are still written, and "steps" wins on load. Setting
        # the one clock sets what the engine and the impl read: warm-ups and seeds continue.
        self.steps = int(state["steps"])

    def communication_stats(self) -> dict:
        """Bytes this rank sent to others (counted from message sizes) and per step;
        ``shared_memory_bytes`` is the part that node-shared buckets moved without MPI;
        ``launches_per_bucket`` / ``syncs_per_bucket`` / ``allocations_per_bucket``: the
        compression kernels launched, the times the host waited for the device and the device
        allocations the kernels made (scratch or results) in each bucket's last exchange (by bucket
        index: the host cost of driving a GPU, zero waits and, after the first step, zero
        allocations being the aim); ``wait_seconds``: the
        time the training thread spent blocked on communication, summed over steps (waiting
        for gradient buckets in ``synchronize()``, or for algorithms that communicate no
        gradients, their exchange after the step): the communication overlap did not hide."""
        steps = max(1, self.steps)
        per_bucket = self.impl.bucket_overhead
        return {"bytes_sent": self.impl.wire.bytes_sent, "steps": self.steps,
                "bytes_per_step": self.impl.wire.bytes_sent / steps,
                "shared_memory_bytes": self.impl.wire.shared_bytes,
                "wait_seconds": self._engine.wait_seconds,
                "launches_per_bucket": {i: c[0] for i, c in sorted(per_bucket.items())},
                "syncs_per_bucket": {i: c[1] for i, c in sorted(per_bucket.items())},
                "allocations_per_bucket": {i: c[2] for i, c in sorted(per_bucket.items())}}

    def memory_stats(self) -> dict:
        """Bytes this rank holds now: ``optimizer_state_bytes`` (the wrapped optimizer's state
        tensors, this rank's slices with ``zero_stage``) and ``gradient_bytes`` (bucket
        gradient buffers, plus the reduced slices at stage 2)."""
        if self._sharded is not None:
            state = self._sharded.state_bytes()
        else:
            state = sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                        for v in s.values() if torch.is_tensor(v))
        grads = 0
        for bucket in self._engine.buckets or ():
            grads += bucket.grad_bytes
            if bucket.shard_grad is not None:
                grads += bucket.shard_grad.numel() * bucket.shard_grad.element_size()
        return {"optimizer_state_bytes": state, "gradient_bytes": grads}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the synchronized gradients so that their total ``norm_type`` norm is at most
        ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``), at every ``zero_stage``: with
        sharded gradients each rank adds up its slices and one allreduce gives the total.
        Synchronizes first if needed; returns the total norm (before clipping)."""
        self.synchronize()
        if self._sharded is None:
            return torch.nn.utils.clip_grad_norm_(
                [p for g in self.optimizer.param_groups for p in g["params"]
                 if p.grad is not None], max_norm, norm_type)
        if self._sharded.inner is None:
            self._sharded.attach(self._engine.buckets)
        return self._sharded.clip_grad_norm_(max_norm, norm_type)

    @property
    def backend(self) -> str:
        """Who carries this optimizer's payloads, e.g. ``"auto: nccl"``, ``"mpi (pinned host
        staging)"`` or ``"mpi"`` for a CPU model (``bagua_mpi.backends``)."""
        device = next((p.device.type for g in self.optimizer.param_groups for p in g["params"]),
                      "cpu")
        return backends.describe(backends.resolve(self.impl.backend), device)

    @property
    def buckets(self):
        """The engine's buckets (None before the first step ends the profiling phase)."""
        return self._engine.buckets

    def close(self) -> None:
        """Remove the hooks, stop the algorithm's background work and write the timeline
        (collective where the algorithm's closing exchange is: ``async_average``). Wrapping
        any of its parameters again closes it too (``engine/ownership.py``). ``step()`` then
        raises ``MisuseError``."""
        self._engine.close()

    def _check_open(self, call: str) -> None:
        reason = self._engine.closed_because
        if reason is not None:
            raise MisuseError(f"rank {self._engine.worker_rank}: {call} on a DistributedOptimizer "
                              f"that no longer exchanges gradients: {reason}")

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, "
                f"algorithm={self.algorithm.name!r}, compression={self.compression!r})")


def _trainable_parameters(optimizer, named_parameters
                          ) -> tuple[list, list[str], "FrozenAtWrap"]:
    """The optimizer's parameters that train (``requires_grad``), their names, and those
    frozen at wrap time (``FrozenAtWrap``: never exchanged, so they must stay frozen)."""
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    params = [p for p in everything if p.requires_grad]
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter appears in more than one param group")
    if named_parameters is None:
        name_of = {id(p): f"param.{i}" for i, p in enumerate(params)}
    else:
        named = list(named_parameters)
        if any(not isinstance(n, str) for n, _ in named):
            raise ValueError("named_parameters must yield (name, parameter) pairs")
        name_of = {id(p): n for n, p in named}
        missing = [i for i, p in enumerate(params) if id(p) not in name_of]
        if missing:
            raise ValueError(f"{len(missing)} optimizer parameters are not in named_parameters "
                             f"(first: position {missing[0]}, shape "
                             f"{tuple(params[missing[0]].shape)})")
    frozen = FrozenAtWrap([(name_of.get(id(p), f"frozen parameter {i}"), p)
                           for i, p in enumerate(everything) if not p.requires_grad])
    return params, [name_of[id(p)] for p in params], frozen


class FrozenAtWrap:
    """The parameters of the wrapped optimizer that were frozen (``requires_grad`` off) when it
    was wrapped. They are not in the buckets, so their gradients are never exchanged: one that
    gets a gradient later (unfrozen) would be stepped on this rank's gradient alone."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        self.named = named

    def check_untrained(self, rank: int) -> None:
        """Raise ``MisuseError`` (before anything is stepped) if one of them has a gradient."""
        trained = [n for n, p in self.named if p.grad is not None]
        if trained:
            raise MisuseError(
                f"rank {rank}: {len(trained)} parameter(s) ({', '.join(trained[:3])}"
                f"{', ...' if len(trained) > 3 else ''}) have a gradient but were frozen "
                f"(requires_grad=False) when the optimizer was wrapped, so their gradients are "
                f"not exchanged and this rank would train them alone. Wrap the optimizer with "
                f"every parameter it will train unfrozen, and freeze them after wrapping "
                f"(requires_grad_(False)): a parameter frozen then is left alone by the step "
                f"and can be unfrozen again")


class WrappedGroups:
    """How many parameters each param group of the wrapped optimizer held when it was
    wrapped. A parameter added afterwards (``group["params"].append(p)``, or a group added to
    the wrapped optimizer itself) has no hook and no bucket, so this rank would train it alone;
    one removed would still be exchanged."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.sizes = self._sizes()

    def _sizes(self) -> list[int]:
        return [len(group["params"]) for group in self.optimizer.param_groups]

    def check_unchanged(self, rank: int) -> None:
        """Raise ``MisuseError`` (before anything is stepped) if the groups changed."""
        sizes = self._sizes()
        if sizes == self.sizes:
            return
        if len(sizes) != len(self.sizes):
            change = f"{len(self.sizes)} -> {len(sizes)} groups"
        else:
            change = ", ".join(f"group {g}: {was} -> {now} parameters"
                               for g, (was, now) in enumerate(zip(self.sizes, sizes)) if was != now)
        raise MisuseError(
            f"rank {rank}: the wrapped optimizer's param groups changed after wrapping "
            f"({change}): a parameter added has no hook and no bucket, so this rank would "
            f"train it alone, and one removed would still be exchanged. Wrap a new "
            f"DistributedOptimizer around the changed optimizer (it takes the parameters over)")


def _discarded_exchange_message(rank: int, algorithm: str, dropped: list[str]) -> str:
    lost = (f", and {algorithm}'s {' and '.join(dropped)} restarted" if dropped else "")
    return (f"bagua_mpi: rank {rank}: zero_grad() discarded gradients this optimizer had "
            f"already exchanged, with no step() after them: the exchange was made for "
            f"nothing{lost}. Skipping a step on purpose (a NaN loss) is fine. But if that "
            f"backward pass was meant for another optimizer's parameters (a GAN's generator "
            f"pass runs through the discriminator), run it inside this optimizer's no_sync(), "
            f"or with these parameters' requires_grad off. Said once per optimizer.")


def _agreed_auto(notes: list[dict], backend):
    """``auto`` decides on each rank from what that rank sees (NCCL in torch, a GPU for each
    local rank), so nodes that differ can decide differently: then every rank takes MPI,
    which runs everywhere, and says why. Returns the optimizer's backend."""
    wires = [n["wire"] for n in notes]
    if len(set(wires)) == 1:
        return backend
    first = next(r for r, w in enumerate(wires) if w != wires[0])
    logger.warning("bagua_mpi: backend='auto' carries the payloads over %s on rank 0 (%s) but "
                   "over %s on rank %d (%s); every rank uses mpi", wires[0],
                   notes[0]["backend"], wires[first], first, notes[first]["backend"])
    return "mpi"


def _refuse_shared_gpus(notes: list[dict], chosen: str) -> None:
    """An explicit NCCL backend where ranks of a node are on one GPU: NCCL would refuse at its
    first collective, in its own words; say so at wrap time, on every rank, naming them."""
    shared = [(r, n["gpus_shared"]) for r, n in enumerate(notes) if n.get("gpus_shared")]
    if shared:
        rank, text = shared[0]
        raise backends.BackendUnavailableError(
            f"backend={chosen!r}: on the node of rank {rank}, {text}, and NCCL refuses two "
            f"ranks on one GPU; give each rank a GPU of its own (torch.cuda.set_device("
            f"bm.local_rank() % torch.cuda.device_count()) before moving the model) or use "
            f"backend='auto' or 'mpi'")


def check_models_agree(names: list[str], params: list, topo=None, *,
                       settings: dict | None = None, notes: dict | None = None) -> list[dict]:
    """Raise ``MismatchError`` on every rank unless all ranks wrap identical models (all ranks
    of ``topo``, a process set's topology, when given: only its ranks take part) with equal
    ``settings`` (``{name: value}``; a dict value is compared key by key, as ``name.key``).
    ``notes``: ``{name: text}``, not compared: a setting's note is shown beside its values
    where they differ (how each rank came to it). One collective; returns every rank's notes,
    in rank order."""
    mine = ([(n, tuple(p.shape), str(p.dtype).replace("torch.", ""), layout.describe(p))
             for n, p in zip(names, params)], _flat_settings(settings or {}), notes or {})
    if topo is None:
        everyone = collectives.allgather_object(mine)
    else:  # on the set's communicator, in order with the other collectives
        everyone = runtime.get().worker.run(lambda: topo.comm.allgather(mine),
                                            ("allgather_object",))
    problems = _model_differences([model for model, _, _ in everyone])
    if problems:
        raise MismatchError("the ranks wrap different models:\n  " + "\n  ".join(problems))
    problems = _setting_differences([(flat, rank_notes) for _, flat, rank_notes in everyone])
    if problems:
        raise MismatchError("the ranks wrap their optimizers with different settings (each "
                            "must be the same on every rank):\n  " + "\n  ".join(problems))
    return [rank_notes for _, _, rank_notes in everyone]


def _model_differences(models: list) -> list[str]:
    reference = models[0]
    problems = []
    for r, theirs in enumerate(models[1:], start=1):
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            problems.append(f"rank {r} has {len(theirs)} trainable parameters, "
                            f"rank 0 has {len(reference)}")
        for a, b in zip(reference, theirs):
            if a != b:
                problems.append(f"rank 0 has {a[0]} {a[1]} {a[2]} {a[3]}, rank {r} has "
                                f"{b[0]} {b[1]} {b[2]} {b[3]}")
                break
    return problems


def _flat_settings(settings: dict) -> dict:
    flat = {}
    for name, value in settings.items():
        if isinstance(value, dict):
            flat.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            flat[name] = value
    return flat


def _setting_differences(ranks: list) -> list[str]:
    """One line per setting whose value differs: each value with the ranks that have it (and
    the first of those ranks' note). Where the algorithms' names differ, their
    hyperparameters are not compared."""
    keys = list(dict.fromkeys(k for flat, _ in ranks for k in flat))
    names_differ = len({repr(flat.get("algorithm.name")) for flat, _ in ranks}) > 1
    problems = []
    for key in keys:
        if names_differ and key.startswith("algorithm.") and key != "algorithm.name":
            continue
        holders: dict[str, list[int]] = {}
        for r, (flat, _) in enumerate(ranks):
            holders.setdefault(repr(flat.get(key)), []).append(r)
        if len(holders) == 1:
            continue
        parts = []
        for value, who in holders.items():
            note = ranks[who[0]][1].get(key)
            parts.append(f"{value} on {ranks_text(who)}" + (f" ({note})" if note else ""))
        problems.append(f"{key}: " + "; ".join(parts))
    return problems


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Overwrite every rank's parameters/buffers with ``root_rank``'s, in place.

    ``params``: a ``state_dict()`` or an iterable of ``(name, tensor)`` such as
    ``model.named_parameters()``. Tensors go in sorted-name order so every rank matches.
    """
    items = sorted(params.items() if isinstance(params, dict) else list(params),
                   key=lambda kv: kv[0])
    handles = [collectives.broadcast_async_(t.data if isinstance(t, torch.nn.Parameter) else t,
                                            root_rank) for _, t in items]
    for h in handles:
        h.wait()


def match_state_layouts(optimizer) -> None:
    """Give each state tensor of ``optimizer`` that is shaped like its parameter the strides
    torch's optimizers create it with (``torch.empty_like(param)``: the parameter's own when it
    is dense, as ``channels_last``), keeping its dtype, device and values; others are left.

    Why: state read from a file or received over the wire comes back row-major, and torch's
    fused Adam/AdamW pair a parameter's elements with its moments' by memory position. On the
    CPU a ``channels_last`` parameter would then step with other elements' moments (silently
    wrong); on CUDA the step refuses ("same dtype, device, and layout"), and foreach leaves its
    fast path. A tensor already so laid out is kept (no copy). With ``zero_stage`` the inner
    optimizer holds flat slices in the buckets' (the parameters' memory) order: left alone."""
    if isinstance(optimizer, DistributedOptimizer):
        if optimizer._sharded is not None:
            return
        optimizer = optimizer.optimizer
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or p.layout != torch.strided:
                continue
            want = layout.autograd_strides(p)
            for key, value in list(state.items()):
                if (torch.is_tensor(value) and value.layout == torch.strided
                        and value.shape == p.shape and value.stride() != want):
                    with torch.no_grad():
                        state[key] = torch.empty_like(p, dtype=value.dtype,
                                                      device=value.device).copy_(value)


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state (tensors broadcast, scalars pickled in
    transit only); ranks whose optimizer has no state yet get it created.

    Each rank receives a state tensor where the root keeps it: on this rank's copy of the
    parameter's device (Adam's moments of a CUDA model), or on the host (its ``step``), so that
    every rank's tensor takes the same wire (NCCL for a CUDA tensor, where the root's would).
    A state tensor shaped like its parameter gets the parameter's strides on every rank, the
    root included (``match_state_layouts``): fused Adam needs them, and ranks whose state were
    laid out differently could step differently."""
    opt = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    is_root = runtime.get().topo.rank == root_rank
    if is_root:
        match_state_layouts(opt)
    state = opt.state_dict()
    # the state dict's parameter ids, in the param_groups' order, name these parameters
    param_of = {pid: p for saved, group in zip(state["param_groups"], opt.param_groups)
                for pid, p in zip(saved["params"], group["params"])}
    layout = None
    if is_root:
        layout = {pid: {k: (("tensor", tuple(v.shape), str(v.dtype),
                             pid in param_of and v.device == param_of[pid].device)
                            if torch.is_tensor(v) else ("value", v)) for k, v in s.items()}
                  for pid, s in state["state"].items()}
    layout, groups = collectives.broadcast_object((layout, state["param_groups"]), root_rank)
    new_state = {}
    for pid in sorted(layout):
        entry = {}
        for key in sorted(layout[pid]):
            kind, *info = layout[pid][key]
            if kind == "value":
                entry[key] = info[0]
                continue
            shape, dtype, with_parameter = info
            if is_root:
                t = state["state"][pid][key]
            else:
                param = param_of.get(pid)
                device = param.device if with_parameter and param is not None else "cpu"
                dtype = getattr(torch, dtype.replace("torch.", ""))
                if (param is not None and param.layout == torch.strided
                        and tuple(param.shape) == tuple(shape)):
                    # the parameter's strides (the broadcast carries values, not memory order)
                    t = torch.empty_like(param, dtype=dtype, device=device)
                else:
                    t = torch.empty(shape, dtype=dtype, device=device)
            entry[key] = collectives.broadcast_(t, root_rank)
        new_state[pid] = entry
    if not is_root:
        opt.load_state_dict({"state": new_state, "param_groups": groups})
        match_state_layouts(opt)  # torch's load casts dtype and device only
