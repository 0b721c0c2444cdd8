"""The algorithm interface and the framework around it (docs/design.md, "Algorithms").

An ``Algorithm`` holds hyperparameters only (a frozen dataclass, serialisable as JSON through
``config()``, each field checked by the validator it declares in ``validators``). Its
``reify(ctx)`` makes its ``AlgorithmImpl``, which owns the running state and fills in the hooks
it needs:

=========================  ==========================  ==========================================
hook                       runs on                     used for
=========================  ==========================  ==========================================
``init_buckets``           main thread, once buckets   state every rank keeps (momenta, layers)
                           exist; every rank
``init_exchange``          main thread, once buckets   the exchange's state (error feedback,
                           exist; exchanging ranks     residuals, estimates); default:
                                                       ``init_tensor`` per communicated tensor
``init_tensor``            (from ``init_exchange``)    one communicated tensor's state, through
                                                       ``self.tensor_state``
``reduce_bucket``          communication thread;       a bucket's gradients are all ready: make
                           exchanging ranks            them the synchronized gradients over
                                                       ``self.comm``; default: ``reduce_tensor``
                                                       per communicated tensor
``reduce_tensor``          (from ``reduce_bucket``)    one communicated tensor (the flat bucket,
                                                       or one gradient); default: dense allreduce
``reduce_scatter_bucket``  communication thread, at    this rank's slice of the synchronized
                           ``zero_stage=2``            gradient (default: dense reduce-scatter)
``exchanged_tensors``      communication thread;       what the node broadcast hands on
                           every rank of the node      (default: the gradients)
                           (hierarchical)
``before_step``            main thread, in ``step()``  model-side ops before the optimizer update
``optimizer_step``         main thread, in ``step()``  the update itself (default: the wrapped
                                                       optimizer's ``step``)
``after_step``             main thread, in ``step()``  model-side ops after it (decentralized
                                                       averaging, local SGD, async, decisions)
``extra_state`` /          anywhere                    scalars and small structures to checkpoint
``load_extra_state``                                   (tensors go through ``self.state``)
``close``                  main thread                 stop background work
=========================  ==========================  ==========================================

What the framework does so that no algorithm re-solves it:

* **who exchanges**: ``self.comm`` is every rank, or the node leaders when hierarchical (None on
  the other ranks of a node). ``init_exchange`` and the ``reduce_*`` hooks run only where it is
  set, so no hook tests for it; ``setup_exchange()`` runs ``init_exchange`` again (on those
  ranks) for an algorithm whose stage switch starts an exchange with state of its own.
* **step**: ``self.step`` is the optimizer's step count, read from the one step clock the
  optimizer owns and advances (``engine/clock.py``); the engine passes the step to
  ``communicate_bucket`` and so to ``reduce_bucket`` (read from the same clock on the main
  thread when the bucket was launched).
* **warm-up**: configs with ``dense_warmup = True`` run ``warmup_steps`` of plain dense
  allreduce before ``reduce_bucket`` is first called.
* **op and scaling**: ``self.scale`` (prescale x postscale: 1/n for Average) is what a
  compressed exchange multiplies its sum by; the dense exchange applies pre and post separately.
* **hierarchy**: with ``hierarchical=True`` a bucket is summed into each node's leader in full
  precision, ``reduce_bucket`` runs among the leaders (``self.comm``), and the leader broadcasts
  the result in its node. Algorithms that average models run their exchange through
  ``synchronize_`` (the same two levels, ``two_level``, on the node's sum or average model).
* **layout**: ``param_slices`` cuts a bucket's flat vector (gradient, state) into its
  parameters' pieces, shaped and strided as the parameters; ``bucket_slices`` a whole-model
  vector into its buckets' pieces.
* **device placement**: ``forms.py`` gives each primitive the dtype and layout it reads where
  the tensor lives, and ``self.transport`` (``transport.py``) moves every payload; device
  tensors never reach NumPy.
* **bytes**: ``self.wire`` counts what is handed to MPI, node-level messages included.
* **state**: ``self.state`` keys every per-rank tensor by parameter name (``state.py``), holds
  state loaded before the buckets exist, and checkpoints it independently of bucketing;
  ``self.tensor_state`` gives the vector laid over a communicated tensor's parameters, keyed by
  their names (``names_key``), so the same tensor finds the same state in any bucketing.
* **options**: ``Algorithm.check_options`` refuses, at wrap time, every optimizer option the
  algorithm cannot honour, naming the option and what to use instead.
* **sharding** (ZeRO, ``sharding.py``): at ``zero_stage=2`` the framework calls
  ``reduce_scatter_bucket`` instead of ``reduce_bucket``, writing this rank's slice of the
  synchronized gradient into ``bucket.shard_grad`` and then freeing the bucket's full gradient
  buffer. The default is the dense reduce-scatter; an algorithm that overrides
  ``reduce_bucket`` or ``reduce_tensor`` supports stage 2 only if it overrides
  ``reduce_scatter_bucket`` too (else stage 2 is refused at wrap time); ``sharding_refusal``
  refuses every stage.
* **configs**: ``Algorithm.__post_init__`` checks every field against ``validators``
  (``validation.py``); a config declares the table, not the check.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

import torch
from mpi4py import MPI

from .. import consistency, process_groups
from ..collectives import join_route
from ..accounting import WireStats, overhead
from ..buffers import FusedTensors, dtype_name, reduce_dtype
from ..engine.clock import StepClock
from ..exceptions import BaguaMPIError, MismatchError
from ..layout import flat_alias, is_dense
from ..transport import Transport
from . import dense, hyperparameters
from .state import AlgorithmState, StateVector, names_key
from .validation import validate_fields

if TYPE_CHECKING:
    from ..engine.buckets import Bucket


class UnsupportedOptionError(BaguaMPIError, ValueError):
    """An optimizer option that the chosen algorithm cannot honour (raised at wrap time)."""


@dataclass(frozen=True)
class AlgorithmContext:
    """What an implementation may use: communicators and the wrapper's reduction settings."""

    topo: Any  # bagua_mpi.topology.Topology
    average: bool  # op=Average (else Sum)
    prescale: float  # multiply gradients by this before the sum (gradient_predivide_factor)
    postscale: float  # ...and by this after it (1/n for Average is folded in here)
    hierarchical: bool  # two levels: inside nodes, then among node leaders
    compression: Any  # bagua_mpi.compression.Compressor
    param_numels: dict = dataclasses.field(default_factory=dict)  # name -> numel
    # name -> strides of the parameters not laid out row-major (layout.py): their state is in
    # that memory order, which checkpoints record
    param_strides: dict = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class KeptPlan:
    """A bucket's exchange plan and what it was made for (``AlgorithmImpl.kept_plan``)."""

    grads: list | torch.Tensor | None
    also: Any
    generation: int
    plan: Any


class AlgorithmImpl:
    communicates_gradients: ClassVar[bool] = True
    wants_flat_params: ClassVar[bool] = False
    backend: str | None = None  # DistributedOptimizer(backend=): the dense steps' library
    zero_stage: int = 0  # DistributedOptimizer(zero_stage=): 2 reduce-scatters gradients
    # the optimizer DistributedOptimizer wraps: its hyperparameters join the first bucket's
    # agreement check (hyperparameters.py)
    wrapped_optimizer: torch.optim.Optimizer | None = None

    def __init__(self, algorithm: "Algorithm", ctx: AlgorithmContext):
        self.algorithm = algorithm
        self.ctx = ctx
        self.buckets: list[Bucket] = []
        self.wire = WireStats()  # bytes this rank sent, for communication_stats()
        self.state = AlgorithmState(ctx.param_numels, ctx.param_strides)
        # The optimizer's step count: read from its clock (DistributedOptimizer hands its own
        # over with use_clock; the impl never advances it). See engine/clock.py.
        self.clock = StepClock()
        self._state_checked = False  # loaded state all claimed (see check_state_claimed)
        self._shared_ok = True  # node-shared buckets may reduce in place (no rank joined)
        # bucket index -> (kernel launches, host waits for the device, kernel scratch
        # allocations) of its last exchange
        self.bucket_overhead: dict[int, tuple[int, int, int]] = {}
        self._plans: dict[int, KeptPlan] = {}   # bucket index -> its kept plan (kept_plan)

    @property
    def step(self) -> int:
        """The optimizer's step count (the index of the step under way; between steps, of the
        next one), read from the clock the optimizer owns."""
        return self.clock.step

    @step.setter
    def step(self, value: int) -> None:  # an impl used without an optimizer (tests, loads)
        self.clock.step = int(value)

    def use_clock(self, clock: StepClock) -> None:
        """Read the step from ``clock`` (the optimizer's) from now on."""
        self.clock = clock

    # -- what the framework offers implementations -------------------------------------------
    @property
    def comm(self):
        """The communicator the algorithm exchanges over: every rank, or the node leaders when
        hierarchical (None on the other ranks of a node: they take no part)."""
        topo = self.ctx.topo
        return topo.leaders if self.ctx.hierarchical else topo.comm

    @property
    def transport(self):
        """``self.comm`` with this optimizer's backend: what the primitives send through (None
        where ``self.comm`` is None)."""
        comm = self.comm
        return None if comm is None else Transport(comm, self.backend)

    @property
    def scale(self) -> float:
        """Factor on the sum of the ranks' gradients (1/n for Average)."""
        return self.ctx.prescale * self.ctx.postscale

    def kept_plan(self, bucket: "Bucket", grads: list | torch.Tensor | None,
                  make: Callable[[], Any], also: Any = None) -> Any:
        """What ``make()`` plans for ``bucket``'s exchange of ``grads`` (its layers' float32
        gradients, ``forms.float32_layers``, or its flat float32 gradient,
        ``forms.float32_flat``), made once and kept across steps while nothing it holds views
        of moves: ``grads`` is the bucket's own float32 memory (its kept list of layer views,
        ``Bucket.layer_grads``, or its buffer, ``Bucket.flat_grad``: the same objects every
        step), the state's tensors are those it was made with (``AlgorithmState.generation``),
        and ``also`` (what else the plan depends on, such as L-GreCo's assignment) is the same
        object. ``grads`` None: the plan views none of the bucket's gradients, only the
        algorithm's state (1-bit Adam's momentum). Otherwise (a 16-bit bucket's float32 copy,
        made each step) it is made for this step alone, and not kept: it would hold the copy
        between steps. So the host spends nothing a step on looking up state, checking layouts
        and viewing tensors."""
        kept = self._plans.get(bucket.index)
        if (kept is not None and kept.grads is grads and kept.also is also
                and kept.generation == self.state.generation):
            return kept.plan
        plan = make()
        flat = bucket.flat_grad
        own = grads is None or (flat is not None
                                and (grads is flat or grads is bucket.layer_grads()))
        if own:
            self._plans[bucket.index] = KeptPlan(grads, also, self.state.generation, plan)
        return plan

    def in_dense_stage(self, step: int) -> bool:
        algo = self.algorithm
        return algo.dense_warmup and step < algo.warmup_steps

    def dense_allreduce_(self, tensors: "list[torch.Tensor] | FusedTensors", comm=None, *,
                         average_models: bool = False, fused: bool = False) -> None:
        """C_FP_S of ``tensors`` over ``comm`` (default ``self.comm``), one message each (or
        one for all, ``fused``, as a ``buffers.FusedTensors`` always is), with the wrapper's
        compression and scaling (or plain averaging, for models)."""
        comm = self.comm if comm is None else comm
        ctx = self.ctx
        if average_models:
            pre, post = 1.0, 1.0 / ctx.topo.size
        else:
            pre, post = ctx.prescale, ctx.postscale
        kwargs = dict(prescale=pre, postscale=post, wire_dtype=ctx.compression.wire_dtype,
                      stats=self.wire, library_comm=ctx.topo.comm, backend=self.backend,
                      shared=self._shared_ok)
        if fused or isinstance(tensors, FusedTensors):
            dense.fused_allreduce_(tensors, comm, **kwargs)
            return
        for t in tensors:
            dense.allreduce_(t, comm, **kwargs)

    def node_sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` into this node's leader (full precision). Each may be any dense
        tensor: a gradient that is not flattened has its parameter's strides
        (``channels_last``), and goes through ``_as_flat``."""
        topo = self.ctx.topo
        node = Transport(topo.intra, self.backend)
        for t in tensors:
            _as_flat(t, lambda flat: node.reduce_(flat, 0, dense=True))
            self.wire.node_reduce(t.numel() * t.element_size(), topo.local_rank, topo.local_size)

    def node_broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Give every rank of the node its leader's ``tensors`` (any layout, as ``node_sum_``
        takes them)."""
        topo = self.ctx.topo
        node = Transport(topo.intra, self.backend)
        for t in tensors:
            _as_flat(t, lambda flat: node.broadcast_(flat, 0, dense=True))
            self.wire.node_broadcast(t.numel() * t.element_size(), topo.local_rank,
                                     topo.local_size)

    def two_level(self, tensors: list[torch.Tensor], among_leaders, *,
                  node_average: bool = False) -> None:
        """Hierarchical exchange of ``tensors``:

        1. node sum into the leader (divided by the node's size with ``node_average``: a model
           exchange among the leaders averages node models, not node sums);
        2. ``among_leaders()`` on the leaders;
        3. node broadcast of the leader's result.
        """
        self.node_sum_(tensors)
        topo = self.ctx.topo
        if topo.leaders is not None:
            if node_average:
                for t in tensors:
                    t.div_(topo.local_size)
            among_leaders()
        self.node_broadcast_(tensors)

    def synchronize_(self, tensors: list[torch.Tensor], exchange, *,
                     node_average: bool = False) -> None:
        """Run ``exchange()`` over ``self.comm`` and leave ``tensors`` synchronized on every
        rank: directly among all ranks, or with ``hierarchical=True`` among the node leaders
        inside ``two_level`` (what model averaging uses; gradients go through
        ``communicate_bucket``)."""
        if self.ctx.hierarchical:
            self.two_level(tensors, exchange, node_average=node_average)
        else:
            exchange()

    # -- state and layout ---------------------------------------------------------------------
    def tensor_state(self, kind: str, segments: list[tuple[str, int]], length: int | None = None,
                     *, window: tuple[int, int] | None = None, device="cpu") -> StateVector:
        """The ``kind`` vector laid over a tensor of parameters ``segments`` (a communicated
        tensor, a bucket), allocated once through ``self.state`` and keyed by the parameters'
        names, so another bucketing finds it wherever the tensor is the same."""
        return self.state.vector(kind, names_key(segments), segments, length, window,
                                 device=device)

    @staticmethod
    def param_slices(bucket: "Bucket", *vectors: torch.Tensor) -> Iterator[tuple]:
        """(parameter, its slice of each of ``vectors``) for each parameter of ``bucket``, the
        vectors laid out as the bucket's flat vector; each slice is seen with the parameter's
        shape and memory layout (``layout.py``; a complex parameter's real view's), so it
        lines up with ``layout.real_view`` of the parameter element by element."""
        for k, p in enumerate(bucket.params):
            yield (p, *(bucket.real_view(v, k) for v in vectors))

    def bucket_slices(self, vector: torch.Tensor) -> Iterator[tuple["Bucket", torch.Tensor]]:
        """(bucket, its slice of ``vector``) for each bucket, ``vector`` holding the buckets'
        flat vectors one after another (a whole-model vector)."""
        offset = 0
        for bucket in self.buckets:
            yield bucket, vector[offset:offset + bucket.numel]
            offset += bucket.numel

    # -- entry points the engine and the wrapper call -----------------------------------------
    def communicate_bucket(self, bucket: "Bucket", step: int) -> None:
        """Comm thread: synchronize ``bucket``'s gradients for ``step``.

        With the agreement check on (the default) the ranks first agree on what they exchange
        (algorithm, bucket, sizes): one 40-byte allreduce per bucket, which turns ranks that
        disagree into ``MismatchError`` and lets a rank inside ``bagua_mpi.join()`` take part in
        a dense exchange with zeros (any other exchange raises ``JoinedRankError`` on the ranks
        still training instead of hanging). With ``hierarchical=True`` the check runs too, but
        a joined rank has no way into the two-level exchange, so that is refused.
        """
        # a rank inside join() adds its zeros through MPI: no shared-memory exchange then
        self._shared_ok = not (consistency.enabled() and self._agree(
            bucket, step, joinable=not self.ctx.hierarchical))
        launches, syncs = overhead.snapshot()
        allocations = overhead.allocations()
        self._exchange_bucket(bucket, step)
        launched, synced = overhead.snapshot()
        self.bucket_overhead[bucket.index] = (launched - launches, synced - syncs,
                                              overhead.allocations() - allocations)

    def _exchange_bucket(self, bucket: "Bucket", step: int) -> None:
        if self.zero_stage == 2:
            out = bucket.shard_grad_buffer()
            if self.ctx.hierarchical:
                self.two_level_reduce_scatter_(bucket, out)
            elif self.in_dense_stage(step):
                self.dense_reduce_scatter_(bucket, out)
            else:
                self.reduce_scatter_bucket(bucket, step, out)
            bucket.release_grads()  # only this rank's slice is kept
            return

        def exchange():
            if self.in_dense_stage(step):
                self.dense_allreduce_(bucket.communication_tensors())
            else:
                self.reduce_bucket(bucket, step)

        if not self.ctx.hierarchical:
            exchange()
            return
        self.node_sum_(bucket.communication_tensors())
        if self.ctx.topo.leaders is not None:
            exchange()
        self.node_broadcast_(self.exchanged_tensors(bucket, step))

    def _agree(self, bucket: "Bucket", step: int, joinable: bool = True) -> bool:
        tensors = bucket.communication_tensors()
        dense_plain = ((self.in_dense_stage(step) or self.exchanges_dense_gradients())
                       and self.ctx.compression.wire_dtype is None and self.zero_stage != 2)
        join = None
        if dense_plain and joinable:  # a joined rank adds zeros to each of the allreduces...
            topo = self.ctx.topo
            route = join_route(tensors[0], topo, self.backend, comm=self.comm)
            # ...on the same wire, in the dtype it sums in (process groups add 16-bit natively)
            native = (route[0] != "mpi" and Transport(self.comm, self.backend).carrier(
                tensors[0]) in process_groups.LIBRARIES)
            join = (tuple((dtype_name(t) if native else reduce_dtype(dtype_name(t)), t.numel())
                          for t in tensors), MPI.SUM, False, route)
        signature = ("bucket", ("algorithm", self.algorithm.name), ("index", bucket.index),
                     ("sizes", tuple(t.numel() for t in tensors)), ("dense", dense_plain),
                     ("zero_stage", self.zero_stage), ("frozen", bucket.frozen_names()))
        optimizer = self.wrapped_optimizer
        if bucket.index == 0 and optimizer is not None:  # once a step: ranks must step alike
            signature += ((hyperparameters.FIELD,
                           hyperparameters.digest(optimizer.param_groups)),)
        return self.verify_naming_hyperparameters(
            signature, step, "checked as its first bucket is exchanged, before any rank steps "
            "with them", join, cache=bucket.index != 0)

    def verify_naming_hyperparameters(self, signature: tuple, step: int, when: str, join=None,
                                      cache: bool = True) -> bool:
        """``consistency.verify`` of ``signature``; where it ends with the hyperparameters'
        digest and only the digests differ, the ``MismatchError`` names each value and the
        ranks holding it (``when``: where the check sits in the step)."""
        comm = self.ctx.topo.comm
        try:
            return consistency.verify(comm, signature, join, cache=cache)
        except MismatchError as exc:
            # decided from the gathered signatures alone, which every rank saw alike, so that
            # every rank takes part in the gather below or none does
            if not hyperparameters.digests_differ(getattr(exc, "signatures", [])):
                raise
            differ = hyperparameters.differences(
                comm.allgather(hyperparameters.summary(self.wrapped_optimizer.param_groups)))
            error = MismatchError(
                f"rank {self.ctx.topo.rank}: the wrapped optimizer's hyperparameters differ "
                f"across the ranks at step {step} ({when}):\n  " + "\n  ".join(differ) +
                "\n" + hyperparameters.ADVICE)
            error.signatures = exc.signatures  # raised on every rank alike
            raise error from None

    def setup_buckets(self, buckets: "list[Bucket]") -> None:
        """Main thread, once: hand the buckets over, then allocate the state (state held since
        a load is applied as it is allocated):

        1. ``init_buckets`` on every rank;
        2. ``init_exchange`` on the ranks that exchange (``setup_exchange``).
        """
        self.buckets = buckets
        self.init_buckets(buckets)
        self.setup_exchange()

    def setup_exchange(self) -> None:
        """Allocate the exchange's state: ``init_exchange`` on the ranks that exchange (every
        rank, or the node leaders when hierarchical: the other ranks of a node never exchange
        and keep no such state). Runs once the buckets exist; an algorithm runs it again when a
        stage switch starts an exchange with state of its own."""
        self._plans.clear()   # new buckets, or state made afresh
        if self.comm is not None:
            self.init_exchange(self.buckets)

    @classmethod
    def exchanges_dense_gradients(cls) -> bool:
        """Whether the exchange is the framework's dense allreduce: neither ``reduce_bucket``
        nor ``reduce_tensor`` is overridden (the agreement check and ZeRO stage 2 ask)."""
        return (cls.reduce_bucket is AlgorithmImpl.reduce_bucket
                and cls.reduce_tensor is AlgorithmImpl.reduce_tensor)

    def state_dict(self) -> dict:
        out = {"step": self.step, "tensors": self.state.state_dict(),
               "extra": self.extra_state()}
        if self.state.param_strides:  # absent: every parameter row-major (older files too)
            out["layouts"] = self.state.layouts()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.state.check_layouts(state.get("tensors", {}), state.get("layouts", {}))
        self.state.load_state_dict(state.get("tensors", {}))  # first: it may refuse them
        self.step = int(state.get("step", 0))
        self.load_extra_state(state.get("extra", {}))
        self._state_checked = False

    def check_state_claimed(self) -> None:
        """Main thread, at the end of each step until it has run once with buckets: every
        loaded state tensor must have been claimed by an allocation by then (in
        ``init_buckets`` or during the step), or the checkpoint does not fit this run."""
        if self.buckets and not self._state_checked:
            self.state.check_claimed()
            self._state_checked = True

    # -- hooks for implementations -------------------------------------------------------------
    def bind_optimizer(self, optimizer) -> None:
        """Called by the wrapper with the wrapped optimizer (again after it loads state)."""

    def init_buckets(self, buckets: "list[Bucket]") -> None:
        """Every rank: allocate the state it keeps whether or not it exchanges."""

    def init_exchange(self, buckets: "list[Bucket]") -> None:
        """The ranks that exchange: allocate the exchange's state. Default: ``init_tensor`` for
        each communicated tensor of each bucket."""
        for bucket in buckets:
            for segments in bucket.communication_segments():
                self.init_tensor(segments, bucket.device)

    def init_tensor(self, segments: list[tuple[str, int]], device) -> None:
        """The state of the communicated tensor over parameters ``segments`` (allocated through
        ``self.tensor_state``, which ``reduce_tensor`` finds again)."""

    def reduce_bucket(self, bucket: "Bucket", step: int) -> None:
        """Synchronize the bucket's gradients. Default: ``reduce_tensor`` for each communicated
        tensor (the flat bucket, or each gradient when flattening is off)."""
        if type(self).reduce_tensor is AlgorithmImpl.reduce_tensor:
            # the dense default reads no segments: one call, none built (per-tensor buckets)
            self.dense_allreduce_(bucket.communication_tensors())
            return
        for grad, segments in zip(bucket.communication_tensors(),
                                  bucket.communication_segments()):
            self.reduce_tensor(grad, segments, step)

    def reduce_tensor(self, grad: torch.Tensor, segments: list[tuple[str, int]],
                      step: int) -> None:
        """Synchronize one communicated tensor over parameters ``segments``. Default: C_FP_S
        (gradient_allreduce)."""
        self.dense_allreduce_([grad])

    def reduce_scatter_bucket(self, bucket: "Bucket", step: int, out: torch.Tensor) -> None:
        """ZeRO stage 2: ``out`` <- this rank's slice (``bucket.part`` elements) of the
        synchronized gradient. Default: the dense reduce-scatter."""
        self.dense_reduce_scatter_(bucket, out)

    def dense_reduce_scatter_(self, bucket: "Bucket", out: torch.Tensor) -> None:
        """Reduce-scatter of the bucket's padded gradient with the wrapper's compression (a
        16-bit wire) and scaling."""
        ctx = self.ctx
        dense.reduce_scatter_(bucket.grad_storage, out, self.comm, prescale=ctx.prescale,
                              postscale=ctx.postscale, wire_dtype=ctx.compression.wire_dtype,
                              stats=self.wire, backend=self.backend)

    def two_level_reduce_scatter_(self, bucket: "Bucket", out: torch.Tensor) -> None:
        """Hierarchical stage 2: a full-precision reduce-scatter inside the node leaves local
        rank l the node's sum of slices [l*M, (l+1)*M) (M nodes), then one across the nodes
        (ranks of local rank l) leaves it slice l*M + m: its shard (``sharding.shard_index``)."""
        ctx, topo = self.ctx, self.ctx.topo
        node_block = torch.empty(bucket.part * topo.cross_size, dtype=out.dtype,
                                 device=out.device)
        dense.reduce_scatter_(bucket.grad_storage, node_block, topo.intra, prescale=ctx.prescale,
                              postscale=1.0, wire_dtype=None, stats=self.wire,
                              backend=self.backend)
        dense.reduce_scatter_(node_block, out, topo.inter, prescale=1.0, postscale=ctx.postscale,
                              wire_dtype=ctx.compression.wire_dtype, stats=self.wire,
                              backend=self.backend)

    def exchanged_tensors(self, bucket: "Bucket", step: int) -> list[torch.Tensor]:
        """What the exchange of ``step`` leaves synchronized on the leaders, for the node
        broadcast: the gradients, unless the algorithm exchanges something else."""
        return bucket.communication_tensors()

    def on_step_start(self, step: int) -> None:
        """Main thread, start of ``step()``: stage switches."""

    # state a step's gradients flow into during the exchange, before the step is taken
    # (error feedback, L-GreCo's accumulators, PowerSGD's warm-started Q); see on_step_skipped
    SKIPPED_STEP_ZEROED = ("residual", "worker_error", "server_error", "error", "accumulator")
    SKIPPED_STEP_RESTARTED = ("q",)
    STATE_WORDS = {"residual": "error feedback", "worker_error": "error feedback",
                   "server_error": "error feedback", "error": "error feedback",
                   "accumulator": "gradient sums", "q": "warm-started Q"}

    def on_step_skipped(self) -> list[str]:
        """Main thread, when a backward pass starts after gradients were synchronized and no
        ``step()`` followed (``torch.amp.GradScaler`` skips the step when they hold inf or
        NaN). The exchange already fed them into the algorithm's state; without this, one
        overflow left an error memory non-finite (or huge), and every later step was skipped
        too. Returns what it dropped, in words (``STATE_WORDS``: for the message that tells a
        user what a discarded exchange cost)."""
        kinds = self.state.forget_skipped_step(self.SKIPPED_STEP_ZEROED,
                                               self.SKIPPED_STEP_RESTARTED)
        return list(dict.fromkeys(self.STATE_WORDS.get(k, k) for k in kinds))

    def on_loss_scaling(self) -> None:
        """Main thread: ``torch.amp.GradScaler`` reads the optimizer's groups, to unscale this
        step's gradients and check them for inf and NaN."""

    def before_step(self, optimizer) -> None:
        pass

    def optimizer_step(self, optimizer, closure=None):
        return optimizer.step(closure) if closure is not None else optimizer.step()

    def after_step(self, optimizer) -> None:
        pass

    def extra_state(self) -> dict:
        """Per-rank scalars to checkpoint (numbers, strings, small dicts)."""
        return {}

    def load_extra_state(self, extra: dict) -> None:
        pass

    def close(self) -> None:
        """Stop background work (threads) cleanly; called by ``DistributedOptimizer.close``."""


def _as_flat(t: torch.Tensor, move: Callable[[torch.Tensor], None]) -> None:
    """``move(flat)`` in place on a 1-D tensor holding ``t``'s elements, for a transport verb:
    MPI, gloo and NCCL take contiguous buffers only (a ``channels_last`` gradient raised
    ``BufferError`` through MPI). A dense ``t``, whatever its strides, is seen in memory order
    (``layout.flat_alias``: the same memory, no copy). One with gaps (a gradient set by hand:
    autograd's are dense) goes through a row-major copy, written back, as the dense allreduce
    does; one with overlaps (expanded) cannot hold the result, and torch refuses the write."""
    if is_dense(t):
        move(flat_alias(t))
        return
    work = t.contiguous().view(-1)
    move(work)
    t.copy_(work.view(t.shape))


@dataclass(frozen=True)
class WrapOptions:
    """The ``DistributedOptimizer`` options an algorithm may have to refuse."""

    compression: Any  # Compressor
    hierarchical: bool
    average: bool  # op=Average (else Sum)
    gradient_predivide_factor: float
    zero_stage: int = 0


@dataclass(frozen=True)
class Algorithm:
    """Base of algorithm configs: subclasses are frozen dataclasses of hyperparameters.

    Class attributes say how the framework treats the algorithm:

    * ``dense_warmup``: ``warmup_steps`` of dense allreduce come first;
    * ``averages_models``: the algorithm averages parameters, not gradients, so ``op`` and
      ``gradient_predivide_factor`` have no meaning for it;
    * ``hierarchical_refusal``: why ``hierarchical=True`` cannot work (None: it does).
    * ``sharding_refusal``: why ``zero_stage`` 1 and 2 cannot work (None: they do; stage 2
      also needs an impl that reduce-scatters, see the module docstring);
    * ``validators``: ``{field name: Validator}`` (``validation.py``), exactly one per field,
      checked by ``__post_init__`` at construction.
    """

    name: ClassVar[str] = ""
    impl_class: ClassVar[type] = AlgorithmImpl
    dense_warmup: ClassVar[bool] = False
    averages_models: ClassVar[bool] = False
    hierarchical_refusal: ClassVar[str | None] = None
    sharding_refusal: ClassVar[str | None] = None
    validators: ClassVar[dict] = {}

    def __post_init__(self):
        validate_fields(self)

    def reify(self, ctx: AlgorithmContext) -> AlgorithmImpl:
        return self.impl_class(self, ctx)

    def config(self) -> dict:
        """JSON-serialisable hyperparameters (stored in checkpoints)."""
        return {"name": self.name, **dataclasses.asdict(self)}

    def compression_use(self) -> str | None:
        """Where a 16-bit ``compression`` applies, or None when it would have no effect."""
        if self.dense_warmup and getattr(self, "warmup_steps", 0) > 0:
            return "the dense warm-up stage"
        return None

    def compression_refusal(self) -> str:
        return (f"{self.name} already compresses every exchange, so a 16-bit wire would have no "
                f"effect; use compression=none")

    def check_options(self, opts: WrapOptions) -> None:
        """Raise ``UnsupportedOptionError`` for an option this algorithm would ignore."""
        if opts.compression.wire_dtype is not None and self.compression_use() is None:
            raise UnsupportedOptionError(f"algorithm {self.name!r}: compression="
                                         f"{opts.compression.name} is not supported: "
                                         f"{self.compression_refusal()}")
        if opts.hierarchical and self.hierarchical_refusal is not None:
            raise UnsupportedOptionError(f"algorithm {self.name!r}: hierarchical=True is not "
                                         f"supported: {self.hierarchical_refusal}")
        if self.averages_models and not opts.average:
            raise UnsupportedOptionError(
                f"algorithm {self.name!r}: op=Sum is not supported: it averages models, not "
                f"gradients (each rank steps on its own gradient); use op=Average")
        if opts.zero_stage:
            self._check_sharding(opts)
        if self.averages_models and opts.gradient_predivide_factor != 1.0:
            raise UnsupportedOptionError(
                f"algorithm {self.name!r}: gradient_predivide_factor="
                f"{opts.gradient_predivide_factor} is not supported: gradients are never "
                f"summed across ranks; leave it at 1.0")

    def sharding_refusal_reason(self, stage: int) -> str | None:
        """Why ``zero_stage=stage`` cannot work with this algorithm (None: it can)."""
        if self.averages_models:
            return ("it averages models, so each rank steps its whole model with its own "
                    "optimizer state")
        if self.sharding_refusal is not None:
            return self.sharding_refusal
        impl = self.impl_class
        if (impl.optimizer_step is not AlgorithmImpl.optimizer_step
                or impl.before_step is not AlgorithmImpl.before_step):
            return ("it runs its own optimizer update (its state is not the wrapped "
                    "optimizer's to shard)")
        if (stage == 2 and not impl.exchanges_dense_gradients()
                and impl.reduce_scatter_bucket is AlgorithmImpl.reduce_scatter_bucket):
            return ("its exchange gives every rank the whole gradient and has no reduce-scatter "
                    "form; use zero_stage=1 (sharded optimizer state, the same exchange)")
        return None

    def _check_sharding(self, opts: WrapOptions) -> None:
        reason = self.sharding_refusal_reason(opts.zero_stage)
        if reason is not None:
            raise UnsupportedOptionError(f"algorithm {self.name!r}: zero_stage={opts.zero_stage} "
                                         f"is not supported: {reason}")
        if (opts.zero_stage == 2 and opts.hierarchical
                and self.impl_class.reduce_scatter_bucket is not AlgorithmImpl.reduce_scatter_bucket):
            raise UnsupportedOptionError(
                f"algorithm {self.name!r}: zero_stage=2 with hierarchical=True is not supported: "
                f"the two-level reduce-scatter is dense (full precision in the node, the 16-bit "
                f"wire across nodes); use hierarchical=False for its compressed reduce-scatter")
