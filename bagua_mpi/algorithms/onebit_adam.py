"""1-bit Adam : Adam whose momentum is averaged with 1-bit compression.

How users set it up::

    opt = bagua_mpi.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                         weight_decay=0.0),                 # or torch.optim.AdamW
        algorithm=bagua_mpi.algorithms.OneBitAdam(warmup_steps=100))

lr, betas, eps and weight decay are the wrapped Adam's (read from ``param_groups`` at every step,
so LR schedulers keep working); the warm-up length is the algorithm's.

Stages:

1. **warm-up** (steps < ``warmup_steps``): ordinary Adam on gradients averaged in full
   precision (the wrapped optimizer steps);
2. **switch** (after step ``warmup_steps - 1``): the second moment v is frozen (Adam's
   ``exp_avg_sq``, bias-corrected) and the momentum m taken over from Adam's ``exp_avg``;
3. **compressed stage**: each rank updates its momentum with its *local* gradient,
   ``m <- beta1 m + (1 - beta1) g`` (plus ``weight_decay * p`` for Adam's L2 form), then m is
   averaged with C_LP_S under 1-bit compression (signs + ||.||/sqrt(n) scale per chunk) with error
   feedback on both phases (worker and server errors, per rank, checkpointed); the update is
   ``p <- p - lr m / (sqrt(v) + eps)`` (AdamW also ``p <- p (1 - lr wd)``).

An element whose v is 0 at the switch (its parameter had no gradient in the whole warm-up, a
dead ReLU unit's weights for example) is not updated in the compressed stage: 1-bit compression
gives every element of a chunk the chunk's scale, so its step would be that scale divided by
eps alone (1e8 times it for the default eps), and the model would diverge within steps. Its v is
frozen as +inf, so its step is 0; the switch logs how many such elements there are.

A parameter whose ``.grad`` is None at a compressed step (frozen with ``requires_grad_(False)``
after wrapping, or used by no rank with ``find_unused_parameters=True``) is left where it is, as
Adam leaves it: no step, no L2 term, no AdamW decay. The engine decides that set alike on every
rank (the bucket's agreement check compares the frozen names; the unused ones come from one
allreduce), so the ranks stay identical. Its elements of m still travel in its bucket's exchange:
every rank sends the same sizes and chunks each step (the plans and error feedback are laid over
them), and which parameters no rank used is known only after the exchange. So its m goes on as
the averaged momentum of a zero gradient (with Adam's L2 form, plus its weight decay term), the
same on every rank, and it resumes from that m when it trains again; Adam would resume from the
m it had, which only a copy of the whole momentum at every step could keep here.

Each rank then sends ~1/32 of the float32 bytes per step. The stage follows from the step
(the optimizer's count), so a resumed job continues in the right one; m, v and the errors are
per-rank state keyed by parameter. ``op=Sum`` sums the momenta (the momentum of the summed
gradient); with ``hierarchical=True`` the leaders exchange m and broadcast it in their node.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..buffers import HOST_PIECE, host_pieces
from ..exceptions import MisuseError
from ..layout import real_view
from ..optimizer_hooks import step_in_place_of
from ..primitives.codecs import OneBitCodec
from ..primitives.lowprec import CompressedExchange, Segment
from .base import Algorithm
from .compressed import CompressedAllReduceImpl
from .registry import register
from .validation import positive_int, random_seed, word_aligned_chunk

logger = logging.getLogger(__name__)


class OneBitAdamImpl(CompressedAllReduceImpl):
    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.error_feedback = True
        self.betas: tuple[float, float] | None = None
        self.decoupled = False
        self._group_of: dict = {}
        self.switched = False  # this process ran the switch (_freeze)
        self._grad_versions: dict[int, tuple] = {}  # bucket -> its gradients' at the exchange

    @property
    def compressed(self) -> bool:
        return not self.in_dense_stage(self.step)

    @property
    def stage(self) -> str:
        """'warmup' or 'compressed': the stage of the step being run (between steps, of the
        next one)."""
        return "compressed" if self.compressed else "warmup"

    def moments(self, bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, frozen v) of ``bucket``, laid out as its flat vector, keyed by parameter."""
        segments = bucket.segments()
        return (self.tensor_state("exp_avg", segments, device=bucket.device).data,
                self.tensor_state("exp_avg_sq", segments, device=bucket.device).data)

    def momentum_errors(self, bucket):
        """(worker error, server error) of the 1-bit exchange of ``bucket``'s momentum."""
        return self.error_state(bucket.segments(), bucket.device)

    def init_buckets(self, buckets) -> None:
        if self.compressed:  # resumed in the compressed stage: claim the loaded moments
            for bucket in buckets:
                self.moments(bucket)
            self._freeze_unseen()   # a checkpoint written before the rule holds v = 0

    def init_exchange(self, buckets) -> None:
        """The momentum exchange's error feedback, from the switch on (a run resumed in the
        compressed stage claims the loaded errors here)."""
        if self.compressed or self.switched:
            for bucket in buckets:
                self.momentum_errors(bucket)

    # -- communication (comm thread) ------------------------------------------------------------
    def reduce_bucket(self, bucket, step: int) -> None:
        """m_i <- beta1 m + (1 - beta1) c_i on each of the c exchanging ranks, then m <- the
        1-bit average of the m_i. With c_i = scale x c x (this rank's gradient, or its node's
        summed one) + L2 x p, the average is beta1 m + (1 - beta1) (scale x sum of all
        gradients + L2 x p): the momentum of the averaged (or, op=Sum, summed) gradient, as
        Adam's warm-up had it, flat or hierarchical."""
        m, _ = self.moments(bucket)
        c = self.comm.Get_size()
        # in m's dtype (float32): lerp_ takes one dtype, and a bfloat16 or float16 gradient is
        # scaled in float32 rather than in its own precision
        contribution = bucket.grad_vector().to(m.dtype)
        if self.scale * c != 1.0:
            contribution = contribution * (self.scale * c)
        if self.l2:
            contribution = contribution + self.l2 * bucket.param_vector()
        # one pass over m (a device launch) where mul_ then add_ made two
        m.lerp_(contribution, 1 - self.betas[0])
        errors = self.momentum_errors(bucket)   # their padding zeroed each step
        seed = self.stream_seed(step, bucket.segments())
        # the momentum and its errors are the state's: planned once, kept while they stay
        exchange = self.kept_plan(bucket, None, lambda: CompressedExchange(
            [Segment(m, self.codec, *errors, seed=seed)], c))
        exchange.run(self.transport, scale=1.0 / c, stats=self.wire, seeds=[seed])
        self._grad_versions[bucket.index] = _versions(bucket)

    def exchanged_tensors(self, bucket, step: int) -> list[torch.Tensor]:
        if self.in_dense_stage(step):
            return super().exchanged_tensors(bucket, step)
        return [self.moments(bucket)[0]]

    # -- main thread ------------------------------------------------------------------------------
    def after_step(self, optimizer) -> None:
        if self.step + 1 == self.algorithm.warmup_steps:
            self._freeze(optimizer)

    def _freeze(self, optimizer) -> None:
        """The switch: take m and (bias-corrected) v over from Adam's state, bucket by bucket,
        v = 0 frozen as +inf (see the module docstring), then allocate the momentum exchange's
        error feedback."""
        self.bind_optimizer(optimizer)
        for bucket in self.buckets:
            m, v = self.moments(bucket)
            for p, m_p, v_p in self.param_slices(bucket, m, v):
                state = optimizer.state[p]  # complex parameters: Adam's moments are complex
                m_p.copy_(real_view(state["exp_avg"]))
                v_p.copy_(real_view(state["exp_avg_sq"])
                          / (1 - self.betas[1] ** float(state["step"])))
        self._freeze_unseen()
        self.switched = True
        self.setup_exchange()

    def _freeze_unseen(self) -> None:
        """v = 0 (no gradient in the whole warm-up) becomes +inf, so that element's step is 0
        (see the module docstring); logs how many there were. One host read per bucket, at
        the switch or on resuming in the compressed stage."""
        unseen = 0
        for bucket in self.buckets:
            v = self.moments(bucket)[1]
            never = v == 0
            unseen += int(never.sum())
            v.masked_fill_(never, math.inf)
        if unseen and self.ctx.topo.rank == 0:
            logger.warning("onebit_adam: %d parameter elements had no gradient in the %d warm-up "
                           "steps (Adam's variance is 0); they stay as they are in the compressed "
                           "stage", unseen, self.algorithm.warmup_steps)

    @property
    def l2(self) -> float:
        if self.decoupled or not self.buckets:
            return 0.0
        return float(self._group_of[self.buckets[0].params[0]]["weight_decay"])

    def optimizer_step(self, optimizer, closure=None):
        if not self.compressed:
            return super().optimizer_step(optimizer, closure)
        # Adam's own step is not called: its step hooks and LR schedulers still see a step
        return step_in_place_of(optimizer, self._frozen_variance_step, closure)

    def _frozen_variance_step(self, _optimizer, closure=None):
        """The compressed stage's update: p -= lr * m / (sqrt(v) + eps), with the averaged
        momentum m and the variance v frozen at the switch (AdamW's decay first).

        A parameter whose ``.grad`` is None (see the module docstring) is skipped, decay
        included, as Adam skips it; the engine gives every rank the same such set, so the
        ranks stay alike."""
        loss = closure() if closure is not None else None
        for bucket in self.buckets:
            if _changed(self._grad_versions.get(bucket.index, ()), _versions(bucket)):
                raise MisuseError(self._too_late("the gradients were changed in place "
                                                 "after their exchange (clipped?)"))
        by_group: dict = {}  # the parameters of each param group, with their m and v
        for bucket in self.buckets:
            for p, m_p, v_p in self.param_slices(bucket, *self.moments(bucket)):
                if p.grad is None:
                    continue
                group = self._group_of[p]
                # a complex parameter steps as pairs of reals, as in Adam
                by_group.setdefault(id(group), (group, []))[1].append((real_view(p), m_p, v_p))
        with torch.no_grad():
            for group, slices in by_group.values():
                lr, eps = group["lr"], group["eps"]
                if self.decoupled and group["weight_decay"]:
                    torch._foreach_mul_([p for p, _, _ in slices],
                                        1 - lr * group["weight_decay"])
                _frozen_variance_updates_(slices, lr, eps)
        return loss

    def on_loss_scaling(self) -> None:
        if self.compressed:  # its momentum holds scaled gradients, which the step would use
            raise MisuseError(self._too_late("torch.amp.GradScaler unscales the gradients "
                                             "after their exchange"))

    def on_step_skipped(self) -> list[str]:
        if self.compressed:  # the momentum took in the skipped step's gradients already
            raise MisuseError(self._too_late("a step was skipped after its gradients had been "
                                             "exchanged (a GradScaler that found inf or NaN, "
                                             "or zero_grad() before step())"))
        return super().on_step_skipped()

    def _too_late(self, what: str) -> str:
        return (f"rank {self.ctx.topo.rank}: onebit_adam, compressed stage (step {self.step}): "
                f"{what}. This stage averages the momentum, which each rank forms from its "
                f"gradients during backward, so a change made to them afterwards cannot reach "
                f"the update. Train it without torch.amp.GradScaler (bf16 autocast needs none) "
                f"and without clipping the gradients")

    def bind_optimizer(self, optimizer) -> None:
        """Check the optimizer and know its groups (and betas), also when resuming."""
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"onebit_adam needs torch.optim.Adam or AdamW, got "
                            f"{type(optimizer).__name__}")
        betas = {tuple(g["betas"]) for g in optimizer.param_groups}
        if len(betas) != 1:
            raise ValueError(f"onebit_adam needs the same betas in every param group, got {betas}")
        decays = {g["weight_decay"] for g in optimizer.param_groups}
        if not isinstance(optimizer, torch.optim.AdamW) and len(decays) > 1:
            raise ValueError("onebit_adam with Adam's L2 weight decay needs one weight_decay for "
                             f"all param groups, got {sorted(decays)} (AdamW allows several)")
        self.betas = betas.pop()
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        self._group_of = {p: g for g in optimizer.param_groups for p in g["params"]}


def _versions(bucket) -> tuple:
    """The in-place change counters of ``bucket``'s gradients (one per tensor, None where the
    parameter has no gradient)."""
    return tuple(None if p.grad is None else p.grad._version for p in bucket.params)


def _changed(before: tuple, now: tuple) -> bool:
    """A gradient present at both times was changed in place between them (one dropped by
    ``find_unused_parameters`` after the exchange is not a change)."""
    return any(a is not None and b is not None and a != b for a, b in zip(before, now))


@register
@dataclass(frozen=True)
class OneBitAdam(Algorithm):
    """Adam with 1-bit compressed momentum averaging after ``warmup_steps`` of plain Adam."""

    name = "onebit_adam"
    impl_class = OneBitAdamImpl
    dense_warmup = True
    warmup_steps: int = 100
    chunk: int = 4096
    seed: int = 0
    validators = {"warmup_steps": positive_int(because="the frozen variance comes from the "
                                               "warm-up"),
                  "chunk": word_aligned_chunk(), "seed": random_seed()}

    def codec(self):
        return OneBitCodec(self.chunk)


def _frozen_variance_update_(p, m, v, lr, eps) -> None:
    """p -= lr * (m / (sqrt(v) + eps)), rounded exactly as that expression is, in place.

    A host parameter laid out row-major (as are its slices of m and v, which follow its
    layout) is updated in pieces of ``HOST_PIECE`` elements through one buffer of that size;
    any other, a device tensor or a channels_last one, in one piece through one temporary (a
    device's caching allocator reuses it). The whole-parameter expression allocated three
    temporaries of the parameter's size at every step: in a profile of a 23M-parameter MLP at
    2 ranks, more time than the backward pass."""
    n = p.numel()
    pieces = (not p.is_cuda and n > HOST_PIECE
              and p.is_contiguous() and m.is_contiguous() and v.is_contiguous())
    if not pieces:
        b = torch.sqrt(v)
        b.add_(eps)
        torch.div(m, b, out=b)
        p.add_(b, alpha=-lr)
        return
    buffer = torch.empty(HOST_PIECE, dtype=v.dtype)
    p, m, v = p.view(-1), m.view(-1), v.view(-1)
    for start, stop in host_pieces(n):
        b = buffer[:stop - start]
        torch.sqrt(v[start:stop], out=b)
        b.add_(eps)
        torch.div(m[start:stop], b, out=b)
        p[start:stop].add_(b, alpha=-lr)


def _together(p) -> bool:
    """Whether ``p`` is updated with others in foreach operations: device parameters. (Host
    ones keep ``_frozen_variance_update_``, whose one temporary, reused, stays in cache: lists
    of host parameters took a second one and were 1.06-1.14x slower.)"""
    return p.device.type != "cpu"


# device parameters are updated together in lists of about this many elements (the update's two
# temporaries are as large as the list)
_FOREACH_ELEMENTS = 1 << 24


def _frozen_variance_updates_(slices, lr, eps) -> None:
    """``_frozen_variance_update_`` of every ``(p, m, v)`` of ``slices``: device parameters
    together in foreach operations (the same elementwise steps: sqrt, + eps, m / it,
    p - lr * that) over lists of about ``_FOREACH_ELEMENTS`` elements, host ones one by one.
    On a GPU that is four operations, each a few launches, per list, where a parameter at a
    time made the step's launches grow with the model's tensors."""
    batch, elements = [], 0
    for p, m, v in slices:
        if not _together(p):
            _frozen_variance_update_(p, m, v, lr, eps)
            continue
        batch.append((p, m, v))
        elements += p.numel()
        if elements >= _FOREACH_ELEMENTS:
            _update_together(batch, lr, eps)
            batch, elements = [], 0
    if batch:
        _update_together(batch, lr, eps)


def _update_together(batch, lr, eps) -> None:
    params, ms, vs = (list(column) for column in zip(*batch))
    denominators = torch._foreach_sqrt(vs)
    torch._foreach_add_(denominators, eps)
    steps = torch._foreach_div(ms, denominators)
    del denominators
    torch._foreach_add_(params, steps, alpha=-lr)
