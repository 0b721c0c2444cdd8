"""The execution engine (BAGUA paper §3.4, docs/design.md): profiling, bucketing, flattening, overlap, hierarchy.

Life of an iteration, after the first one:

1. backward runs; each parameter's post-accumulate-grad hook counts it. When every parameter of
   a bucket has been accumulated ``backward_passes_per_step`` times, the bucket is *ready*;
2. (**O**verlap on) ready buckets are launched strictly in bucket order: bucket i+1 waits for
   bucket i to be launched, so all ranks issue the same sequence of collectives even if autograd
   finishes gradients in a different order on different ranks. The algorithm's
   ``communicate_bucket`` (``reduce_bucket``, or ``reduce_scatter_bucket`` at ZeRO stage 2)
   runs on the communication thread while backward continues;
3. ``synchronize()`` (when the step's last backward pass ends, from an autograd callback, as
   DDP finishes its reduction; ``step()`` calls it for the algorithms that average models)
   launches whatever is left (all of it with overlap off), giving parameters that got no
   gradient this iteration a zero gradient so no rank waits for a bucket that never
   completes, and waits for the outstanding handles only. So ``backward()`` returns with the
   gradients averaged, and code before ``step()`` (clipping) sees them alike on every rank.
   A parameter frozen since wrapping (``requires_grad`` off) sends zeros and gets ``grad =
   None`` back, so the step leaves it alone, as without wrapping; every rank must freeze it
   alike (the bucket's agreement check compares them).

The first iteration is the **profiling** phase: hooks only record the order in which gradients
become ready, and ``synchronize()`` builds the buckets from rank 0's observed order (broadcast, so
every rank buckets alike; parameters never seen go last, in reverse declaration order), by a
byte budget. **F**lattening: each bucket then owns one contiguous gradient buffer of which the
parameters' ``.grad`` are views. **H**ierarchical: the algorithm context's flag (two-level
primitives over the node-local and cross-node communicators).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import backends, collectives, consistency, node_shared, runtime
from ..primitives.sparse_grads import sparse_allgather
from ..transport import Transport
from ..exceptions import MismatchError, MisuseError
from ..layout import real_dtype
from ..ops import Max
from ..timeline import Timeline
from . import ownership
from .buckets import Bucket, plan_buckets
from .clock import StepClock

# what the first synchronize() calls itself in the agreement check and its JoinedRankError
_FIRST_STEP = ("the first step of a DistributedOptimizer (it builds the buckets, which a rank "
               "inside join() cannot take part in: join() only after the first step)",)
# check_same_start: a tensor's 16-bit words sum to less than 2**55 in magnitude (under 2**40
# words), so sum + OFFSET lies in (0, 2**61) and SPAN - (sum + OFFSET) is positive too
_OFFSET = np.int64(1) << 60
_SPAN = np.int64(1) << 62
# the backward pass (graph task) running on this thread, -1 outside one
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
# the autograd node being evaluated on this thread: as a backward pass ends, None unless that
# pass runs inside another's node (reentrant activation checkpointing)
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class Engine:
    def __init__(self, params: list[torch.Tensor], names: list[str], impl, *, bucket_bytes: int,
                 overlap: bool, flatten: bool, profile_order: bool, backward_passes_per_step: int,
                 find_unused_parameters: bool, timeline: Timeline | None,
                 clock: StepClock | None = None, shard_parts: int = 1,
                 sparse_as_dense: bool = False, process_set=None):
        self.params = params
        self.names = names
        self.impl = impl
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.flatten = flatten
        self.profile_order = profile_order
        self.passes = backward_passes_per_step
        self.find_unused = find_unused_parameters
        # the ranks that train together (None: all of them), for the engine's own collectives
        self.process_set = process_set
        self.shard_parts = shard_parts  # ZeRO: buckets padded to this many equal slices
        # Sparse gradients (nn.Embedding(sparse=True)) stay sparse, outside the buckets, and
        # are all-gathered (primitives/sparse_grads.py), as Horovod does without
        # sparse_as_dense. Dense instead: when asked, when the algorithm averages models
        # (they average parameters through the buckets) and for sharded buckets (a slice
        # of a sparse gradient is not what the optimizer steps on).
        self.keep_sparse = (not sparse_as_dense and impl.communicates_gradients
                            and shard_parts == 1)
        self.sparse: set[int] = set()  # parameters whose gradients are exchanged sparse
        self.timeline = timeline
        self.worker = runtime.get().worker
        if timeline is not None:
            self.worker.observer = self._observe
        self.buckets: list[Bucket] | None = None  # None until the profiling iteration ends
        self.profiled_order: list[int] = []  # first-ready order seen on this rank
        self._bucket_of: dict[int, tuple[Bucket, int]] = {}
        self._counts = [0] * len(params)  # hook calls since the last synchronize
        # a gradient since the last synchronize, inside no_sync() too (find_unused_parameters)
        self._used = [False] * len(params)
        self._remaining: list[int] = []  # per bucket: parameters not yet ready
        self._launched = 0  # buckets [0, _launched) have been handed to the comm thread
        self._handles: list = []
        self._ready_buckets = 0
        self._generation = 0  # one per iteration of bucket launches (advanced by _reset)
        self._disagreed_in: int | None = None  # the generation whose agreement check failed
        # The step passed to communicate_bucket at launch: read from the optimizer's clock (which
        # only the optimizer advances); an engine built without one keeps its own and advances
        # it at each synchronize (completed synchronizations).
        self._owns_clock = clock is None
        self.clock = StepClock() if clock is None else clock
        self.communicating = True  # False inside DistributedOptimizer.no_sync()
        # synchronize() finished and no step has been taken since (see step_taken)
        self.awaiting_step = False
        # torch.amp.GradScaler read the synchronized gradients (it may skip their step)
        self.loss_scaler_read = False
        self.worker_rank = runtime.get().topo.rank
        # seconds the training thread spent blocked on communication (the handles below, and
        # DistributedOptimizer's after-step exchanges): what overlap did not hide
        self.wait_seconds = 0.0
        self._finish_queued_in: int | None = None  # the backward pass that will finish
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                       for i, p in enumerate(params)]
        # why this engine no longer exchanges its parameters' gradients (None while open)
        self.closed_because: str | None = None
        self.serial = ownership.register(self)

    # -- hooks ----------------------------------------------------------------------------------
    def _hook_for(self, i: int):
        def hook(_param):
            self._on_grad_ready(i)
        return hook

    def _on_grad_ready(self, i: int) -> None:
        self._used[i] = True  # before no_sync()'s return: its passes use parameters too
        if not self.communicating:
            return
        if self.awaiting_step:  # gradients were synchronized and their step() never came
            if not self.loss_scaler_read:
                # adding to gradients already exchanged would exchange them again, and feed
                # the algorithm's state (error feedback, momenta) twice in one step
                raise MisuseError(
                    f"rank {self.worker_rank}: parameter {self.names[i]!r} got a gradient "
                    f"again after this step's exchange and before step() "
                    f"(backward_passes_per_step={self.passes}); raise backward_passes_per_step, "
                    f"run the extra backward passes inside opt.no_sync(), or call "
                    f"opt.zero_grad() first to discard the exchanged gradients")
            self.discard_synchronized()  # the loss scaler skipped the step
        if self.impl.communicates_gradients:
            self._finish_when_backward_ends()
        count = self._counts[i] = self._counts[i] + 1
        if count > self.passes:
            # gradient exchange: its bucket is already being communicated, and accumulating
            # into it now would change what other ranks receive (or leave this gradient out
            # of this step). Model averaging: this rank skipped a step() (the exchange), and
            # the others wait for it in theirs
            why = ("" if self.impl.communicates_gradients else
                   f"; {self.impl.algorithm.name} averages the models in step(), so every rank "
                   f"must step after each of them (a step skipped on this rank alone, as a "
                   f"GradScaler does with local gradients, leaves the others waiting)")
            raise MisuseError(
                f"rank {self.worker_rank}: parameter {self.names[i]!r} got a gradient "
                f"{count} times before step() (backward_passes_per_step={self.passes}); "
                f"raise backward_passes_per_step, or run the extra backward passes inside "
                f"opt.no_sync(){why}. Within one backward pass, a parameter shared by "
                f"several blocks under torch.utils.checkpoint(use_reentrant=True) gets one "
                f"gradient per block: use use_reentrant=False")
        if self.keep_sparse and (i in self.sparse or self.buckets is None and _sparse_grad(
                self.params[i])):
            self.sparse.add(i)  # new ones only while profiling: the buckets are fixed after
            return
        if self.buckets is None:
            if count == 1:
                self.profiled_order.append(i)
            return
        bucket, k = self._bucket_of[i]
        try:
            bucket.absorb_grad(k)
        except RuntimeError:
            self._check_not_converted(bucket)
            raise
        if count == self.passes and self.impl.communicates_gradients:
            self._remaining[bucket.index] -= 1
            if self._remaining[bucket.index] == 0:
                self._bucket_ready(bucket)

    def _check_not_converted(self, bucket: Bucket) -> None:
        """Raise ``MisuseError`` if a parameter of ``bucket`` changed dtype, device or shape
        since the buckets were built (called when moving a gradient into the bucket failed, so
        the hot path pays nothing)."""
        changed = [(bucket.names[k], c) for k in range(len(bucket.params))
                   if (c := bucket.conversion(k)) is not None]
        if changed:
            name, change = changed[0]
            raise MisuseError(
                f"rank {self.worker_rank}: parameter {name!r} ({change}) "
                f"{f'and {len(changed) - 1} more ' if len(changed) > 1 else ''}changed after "
                f"the optimizer was wrapped: the model was converted (.to(), .double(), "
                f".half()) or a parameter's data replaced after the first step, and its "
                f"gradient no longer fits its bucket; convert the model before wrapping it, "
                f"or wrap a new optimizer after converting (it takes the parameters over)")

    def _finish_when_backward_ends(self) -> None:
        """Have the backward pass that is running call ``_backward_ended`` as it ends (once)."""
        task = _graph_task_id()
        if task == -1 or task != self._finish_queued_in:
            self._finish_queued_in = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        """A backward pass has ended: if it was the step's last, finish the exchange now, so
        that ``backward()`` returns with every gradient synchronized, as with DDP. Code that
        reads or changes the gradients before ``step()`` (``clip_grad_norm_``) then sees the
        averaged ones on every rank; with overlap it used to run while buckets were on the wire,
        and the ranks drifted apart.

        A pass nested in another's node (reentrant activation checkpointing) leaves it to the
        outer pass: the outer one's later hooks still have gradients to add. Its own end
        finishes the exchange when one of its hooks queued it (a model with parameters outside
        the checkpointed blocks); else ``step()`` does."""
        self._finish_queued_in = None
        if _current_autograd_node() is not None:
            return
        if self.exchange_due():
            self.synchronize()

    def _bucket_ready(self, bucket: Bucket) -> None:
        self._note_ready(bucket)
        if self.overlap:
            self._launch_in_order()

    def _note_ready(self, bucket: Bucket) -> None:
        self._ready_buckets += 1
        if self.timeline is not None:
            self.timeline.instant("ready", bucket=bucket.index)
            if self._ready_buckets == len(self.buckets):
                self.timeline.instant("backward end")

    def _launch_in_order(self) -> None:
        buckets = self.buckets
        while self._launched < len(buckets) and self._remaining[self._launched] == 0:
            self._launch(buckets[self._launched])
            self._launched += 1

    def _launch(self, bucket: Bucket) -> None:
        # Read here, on the main thread: the comm thread may run the task after the main
        # thread has moved on, and every rank must pass the same step (warm-up, seeds).
        step = self.clock.step
        generation = self._generation

        def task():
            if self._disagreed_in == generation:
                # an earlier bucket's agreement check failed, on every rank that met it: none
                # of them sends the rest. A rank that met it from outside a step (rank 0 in a
                # collective of its own) has no buckets queued, so the next collectives match
                return
            try:
                self.impl.communicate_bucket(bucket, step)
            except MismatchError as error:
                if consistency.raised_on_every_rank(error):
                    self._disagreed_in = generation
                raise

        if self.timeline is not None:
            self.timeline.instant("launch", bucket=bucket.index)
        # run with the bucket's GPU current on the communication thread, whatever device this
        # thread has current (a model put on cuda:k without set_device); backward's kernels on
        # this thread's stream come first (the executor's entry event, streams.py)
        self._handles.append(self.worker.submit(
            task, ("bucket", bucket.index, bucket.nbytes),
            device=bucket.device if bucket.device.type == "cuda" else None))

    def _observe(self, describe, start: float, end: float) -> None:
        if isinstance(describe, tuple) and describe and describe[0] == "bucket":
            self.timeline.span(f"comm bucket {describe[1]}", start, end, tid=Timeline.COMM_TID,
                               bucket=describe[1], bytes=describe[2])

    # -- buckets ----------------------------------------------------------------------------------
    def _build_buckets(self) -> None:
        if consistency.enabled():
            # the set-up's collectives cannot take zeros from a rank inside join(): with one
            # there, the agreement check raises JoinedRankError on the others instead of a hang
            comm = self.impl.ctx.topo.comm
            self.worker.run(lambda: consistency.verify(comm, _FIRST_STEP), _FIRST_STEP)
        if self.keep_sparse:  # a rank that saw no gradient of a sparse parameter learns here
            everyone = self.worker.run(
                lambda: self.impl.ctx.topo.comm.allgather(sorted(self.sparse)),
                ("sparse parameters",))
            self.sparse = set().union(*map(set, everyone))
        seen = set(self.profiled_order) | self.sparse
        unseen = [i for i in reversed(range(len(self.params))) if i not in seen]
        if self.profile_order:
            order = collectives.broadcast_object(self.profiled_order + unseen, root_rank=0)
        else:  # what DDP and Horovod assume: gradients arrive in reverse declaration order
            order = list(reversed(range(len(self.params))))
        order = [i for i in order if i not in self.sparse]
        groups = plan_buckets(self.params, order, self.bucket_bytes)
        allocators = self._shared_allocators(groups)
        self.buckets = []
        for b, idx in enumerate(groups):
            first = self.params[idx[0]]
            allocate = allocators.get((real_dtype(first.dtype), first.device))

            def make(b=b, idx=idx, allocate=allocate):
                return Bucket(b, idx, self.params, self.names, self.flatten, allocate,
                              parts=self.shard_parts)
            # a shared window is collective on the node: made through the serial executor
            self.buckets.append(make() if allocate is None
                                else self.worker.run(make, ("shared bucket", b)))
        for bucket in self.buckets:
            for k, i in enumerate(bucket.indices):
                self._bucket_of[i] = (bucket, k)
            if self.impl.wants_flat_params:
                bucket.flatten_params()
        self.impl.setup_buckets(self.buckets)
        self._reset()

    def _shared_allocators(self, groups: list[list[int]]) -> dict:
        """(dtype, device) -> allocator of node-shared gradient buffers, for the buckets that
        can use them (``node_shared.py``): flattened CPU float buckets of an algorithm that
        communicates gradients, when MPI carries host payloads. Collective: every rank decides
        alike."""
        if not (self.flatten and self.impl.communicates_gradients) or self.impl.zero_stage == 2:
            return {}  # (stage 2 frees each bucket's gradients after its exchange)
        if backends.host_carrier(backends.resolve(self.impl.backend)) != "mpi":
            return {}  # only the MPI carrier reduces in them: gloo would leave them unused
        topo = self.impl.ctx.topo
        kinds, total = {}, 0
        for idx in groups:
            p = self.params[idx[0]]
            kind = (real_dtype(p.dtype), p.device)
            allocate = node_shared.allocator(topo, *kind)
            if allocate is not None:
                kinds[kind] = allocate
                total += sum(self.params[i].numel() * self.params[i].element_size()
                             for i in idx)
        usable = self.worker.run(lambda: node_shared.usable(topo, total, bool(kinds)),
                                 ("shared buckets?",))
        return kinds if usable else {}

    def _reset(self) -> None:
        self._generation += 1  # the buckets launched from now on belong to a new iteration
        self._counts = [0] * len(self.params)
        self._used = [False] * len(self.params)
        self._remaining = [len(b.indices) for b in self.buckets]
        self._launched = 0
        self._handles = []
        self._ready_buckets = 0

    # -- synchronize ------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish this iteration's gradient communication (launch the rest, wait for all)."""
        if self.buckets is None:
            counts, used = self._counts, self._used
            self._build_buckets()
            self._counts, self._used = counts, used
        if not self.impl.communicates_gradients:
            self._tick()
            self._reset()
            return
        frozen = []  # frozen after wrapping (requires_grad off): no gradient, none to step on
        for b in range(self._launched, len(self.buckets)):
            if self._remaining[b]:
                bucket = self.buckets[b]
                try:
                    missing = bucket.fill_missing_grads()
                except RuntimeError:
                    self._check_not_converted(bucket)
                    raise
                frozen += [bucket.params[k] for k in missing if not bucket.params[k].requires_grad]
                self._remaining[b] = 0
                self._note_ready(bucket)
        self._launch_in_order()
        started = time.monotonic()  # the timeline's clock
        wait_start = time.perf_counter()
        try:
            for handle in self._handles:
                handle.wait()
        finally:
            self.wait_seconds += time.perf_counter() - wait_start
            if self.timeline is not None:
                self.timeline.span("wait", started, time.monotonic(), handles=len(self._handles))
        if self.sparse:
            self._exchange_sparse()
        for p in frozen:  # the zeros they sent would move them (weight decay, momentum)
            p.grad = None
        if self.find_unused:
            self._drop_globally_unused_grads()
        self._tick()
        self._reset()
        self.awaiting_step = True
        self.loss_scaler_read = False

    def _exchange_sparse(self) -> None:
        """Every sparse gradient, all-gathered and coalesced, scaled as the buckets are (after
        them, in parameter order: the same sequence on every rank)."""
        impl = self.impl
        wire = Transport(impl.ctx.topo.comm, impl.backend)
        started = time.perf_counter()
        for i in sorted(self.sparse):
            p = self.params[i]
            grad = _as_sparse(p)
            gathered = self.worker.run(
                lambda grad=grad: sparse_allgather(grad, wire, scale=impl.scale,
                                                   stats=impl.wire),
                ("sparse gradient", self.names[i], tuple(p.shape)), p.device)
            # frozen after wrapping: exchanged with the others (every rank calls the same
            # sequence), then no gradient, as the buckets' frozen parameters get; an empty
            # sparse one would still move it (momentum, weight decay)
            p.grad = gathered if p.requires_grad else None
        self.wait_seconds += time.perf_counter() - started

    @property
    def iteration(self) -> int:
        """The step the next launched bucket is passed (read-only view of ``self.clock``)."""
        return self.clock.step

    def _tick(self) -> None:
        if self._owns_clock:
            self.clock.step += 1

    def _drop_globally_unused_grads(self) -> None:
        """Parameters no rank used this iteration get ``grad = None``, as without wrapping. A
        parameter used only in ``no_sync()`` passes counts as used: its accumulated gradient
        was exchanged with the bucket and must be stepped (it was dropped)."""
        used = torch.from_numpy(((np.asarray(self._counts) > 0)
                                 | np.asarray(self._used, dtype=bool)).astype(np.uint8))
        collectives.allreduce_(used, op=Max, **self._among())
        for i in np.flatnonzero(used.numpy() == 0):
            self.params[i].grad = None

    def check_same_start(self) -> None:
        """Raise ``MismatchError`` on every rank unless the parameters are the same on every
        rank: called before the first step of an algorithm that exchanges gradients, which
        applies the same averaged gradient everywhere, so ranks that start apart (a forgotten
        ``broadcast_parameters``) would each train their own model, silently.

        Each tensor's bytes are summed as 16-bit integers into an int64: exact, so the sum is
        the same whatever order a device adds in (a float sum's last bits need not be, across
        GPU models). One MAX allreduce of ``[w, SPAN - w]`` gives the maximum and the minimum
        of w = sum + OFFSET, which is positive, so that the zeros a rank inside ``join()`` adds
        to the library's allreduce change neither."""
        words = [p.detach().contiguous().view(-1) for p in self.params]
        sums = (torch.stack([t.view(torch.int16 if t.element_size() % 2 == 0 else torch.int8)
                             .sum(dtype=torch.int64) for t in words]).cpu().numpy()
                if words else np.zeros(0, dtype=np.int64))
        w = sums + _OFFSET
        both = torch.from_numpy(np.concatenate([w, _SPAN - w]))
        collectives.allreduce_(both, op=Max, **self._among())
        high, low = both[:len(w)].numpy(), _SPAN - both[len(w):].numpy()
        differ = [self.names[i] for i in np.flatnonzero(high != low)]
        if differ:
            raise MismatchError(
                f"rank {self.worker_rank}: the parameters differ from rank to rank at the first "
                f"step ({len(differ)} of {len(self.params)} tensors: {', '.join(differ[:3])}"
                f"{', ...' if len(differ) > 3 else ''}): {self.impl.algorithm.name} applies "
                f"the same averaged gradients on every rank, so each rank would train a model "
                f"of its own. Call bm.broadcast_parameters(model.state_dict(), root_rank=0) "
                f"before the first step (DDP broadcasts when it wraps a model; Horovod and "
                f"bagua_mpi leave it to you)")

    def _among(self) -> dict:
        """The keyword that runs a collective among the ranks that train together."""
        return {} if self.process_set is None else {"process_set": self.process_set}

    def check_params_in_buckets(self) -> None:
        """Raise ``MisuseError`` when a parameter left its bucket's flat buffer (see
        ``Bucket.params_moved_out``): the algorithms that average the flat buffers would go on
        averaging copies while the model trains alone on this rank."""
        moved = [self.names[bucket.indices[k]] for bucket in self.buckets or ()
                 for k in bucket.params_moved_out()]
        if moved:
            raise MisuseError(
                f"rank {self.worker_rank}: {len(moved)} parameter(s) ({', '.join(moved[:3])}"
                f"{', ...' if len(moved) > 3 else ''}) no longer live in the buffers "
                f"{self.impl.algorithm.name} averages: the model was converted (.to(), "
                f".half(), a memory format) or its parameters' data replaced after the first "
                f"step; convert the model before wrapping it")

    def synchronized_for_step(self) -> bool:
        """Whether synchronize() has run for the coming step: it finished, no backward pass
        has produced gradients since, and no step() has been taken since."""
        return self.awaiting_step and not any(self._counts)

    def exchange_due(self) -> bool:
        """Whether this step's last backward pass has run (some gradient has been accumulated
        ``backward_passes_per_step`` times) and its exchange not finished yet."""
        return (self.communicating and self.impl.communicates_gradients
                and max(self._counts, default=0) >= self.passes)

    def step_taken(self) -> None:
        self.awaiting_step = False

    def discard_synchronized(self) -> list[str] | None:
        """The synchronized gradients will not be stepped on (the loss scaler skipped the step,
        or ``zero_grad()`` dropped them): what the exchange fed into the algorithm's state
        goes too (``on_step_skipped``). Returns None unless the caller discarded exchanged
        gradients that no loss scaler had read (its own choice, not a scaler's skip); then
        what the algorithm's state lost, in words."""
        if not self.awaiting_step:
            return None
        by_user = not self.loss_scaler_read
        self.awaiting_step = False
        self.loss_scaler_read = False
        dropped = self.impl.on_step_skipped()
        return dropped if by_user else None

    def abandon_iteration(self) -> None:
        """Forget the iteration under way: the gradients counted since the last exchange, the
        buckets launched (waited for, their results dropped) and synchronized gradients that no
        ``step()`` took. For a restore of state saved between steps after an error (elastic's
        ``TorchState``): nothing of the abandoned iteration may reach the restored state, and a
        discarded exchange would clear the restored error feedback at the next backward pass."""
        for handle in self._handles:
            if not handle.done():
                handle.wait()  # launched on every rank: finish it (and drop what it did)
        if self.buckets is None:
            self._counts = [0] * len(self.params)
            self._used = [False] * len(self.params)
        else:
            self._reset()
        self.awaiting_step = False
        self.loss_scaler_read = False
        self._finish_queued_in = None

    def pending_description(self) -> str:
        """What of this iteration is under way (gradients counted or buckets launched since
        the last synchronize), or '' when nothing is (always, for algorithms that do not
        communicate gradients)."""
        if not self.impl.communicates_gradients:
            return ""
        launched = sum(1 for h in self._handles if not h.done())
        counted = sum(1 for c in self._counts if c)
        if launched:
            return f"{launched} gradient bucket(s) are being communicated"
        if counted:
            return (f"gradients of {counted} parameter(s) are waiting to be communicated "
                    f"(backward ran, step() did not)")
        return ""

    def zero_grads(self) -> None:
        if self.buckets is None:
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
            return
        for bucket in self.buckets:
            bucket.zero_grads()

    def close(self, reason: str = "close() was called") -> None:
        """Stop the algorithm's background work (its ``close``: collective where it has a
        closing exchange), remove the hooks (the parameters' gradients are no longer
        exchanged) and write the timeline; ``reason`` is what a later ``step()`` of the
        optimizer reports. A second call does nothing."""
        if self.closed_because is not None:
            return
        self.impl.close()
        self.closed_because = reason
        ownership.forget(self)
        for bucket in self.buckets or ():
            bucket.privatize()  # p.grad must outlive the shared window (freed at shutdown)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.timeline is not None:
            if self.worker.observer == self._observe:
                self.worker.observer = None
            self.timeline.close()


def _sparse_grad(p: torch.Tensor) -> bool:
    return p.grad is not None and p.grad.is_sparse


def _as_sparse(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient as a sparse COO tensor: an empty one when it got none this step."""
    if p.grad is None:
        return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                       torch.empty((0,) + tuple(p.shape[1:]), dtype=p.dtype,
                                                   device=p.device), tuple(p.shape),
                                       check_invariants=False)  # empty: nothing to check
    return p.grad if p.grad.is_sparse else p.grad.to_sparse(1)
