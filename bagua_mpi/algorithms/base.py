"""The algorithm interface (SPEC §3): a config object reified into a stateful implementation.

An ``Algorithm`` holds hyperparameters only (plain, comparable, serialisable as JSON through
``config()``). ``Algorithm.reify(ctx)`` makes its ``AlgorithmImpl``, which owns all running
state (per-bucket residuals, peer models, stage, ...) and says what runs on each hook:

=====================  ==============================  ============================================
hook                   runs on                          used for
=====================  ==============================  ============================================
``init_buckets``       main thread, once buckets exist  allocate per-bucket state
``reduce_bucket``      communication thread             a bucket's gradients are all ready: make
                                                        them the synchronized gradients (gets the
                                                        step index; never read main-thread state
                                                        that changes between steps)
``before_step``        main thread, in ``step()``       model-side ops before the optimizer update
``optimizer_step``     main thread, in ``step()``       the update itself (default: the wrapped
                                                        optimizer's ``step``; 1-bit Adam's
                                                        compressed stage replaces it)
``after_step``         main thread, in ``step()``       model-side ops after it (decentralized
                                                        averaging, local SGD, async)
``on_step_start``      main thread, start of ``step``   stage switches (e.g. warm-up over)
``state_dict`` /       anywhere                         per-rank state for checkpoints (tensors
``load_state_dict``                                     and numbers only, no pickle)
=====================  ==============================  ============================================

Flags: ``communicates_gradients`` (False for algorithms that average models instead; the engine
then skips gradient communication) and ``wants_flat_params`` (the engine also flattens each
bucket's parameters so model-side operations run once per bucket).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..primitives.codecs import WireStats

if TYPE_CHECKING:
    from ..engine.buckets import Bucket


@dataclass(frozen=True)
class AlgorithmContext:
    """What an implementation may use: communicators and the wrapper's reduction settings."""

    topo: Any  # bagua_mpi.topology.Topology
    average: bool  # op=Average (else Sum)
    prescale: float  # multiply gradients by this before the sum (gradient_predivide_factor)
    postscale: float  # ...and by this after it (1/n for Average is folded in here)
    hierarchical: bool  # use the two-level primitives
    compression: Any  # bagua_mpi.compression.Compressor


class AlgorithmImpl:
    communicates_gradients: ClassVar[bool] = True
    wants_flat_params: ClassVar[bool] = False

    def __init__(self, algorithm: "Algorithm", ctx: AlgorithmContext):
        self.algorithm = algorithm
        self.ctx = ctx
        self.buckets: list[Bucket] = []
        self.wire = WireStats()  # bytes this rank sent, for communication_stats()

    def bind_optimizer(self, optimizer) -> None:
        """Called once by the wrapper with the wrapped optimizer."""

    def init_buckets(self, buckets: "list[Bucket]") -> None:
        self.buckets = buckets

    def reduce_bucket(self, bucket: "Bucket", step: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not reduce gradients")

    def on_step_start(self, step: int) -> None:
        pass

    def before_step(self, optimizer) -> None:
        pass

    def optimizer_step(self, optimizer, closure=None):
        return optimizer.step(closure) if closure is not None else optimizer.step()

    def after_step(self, optimizer) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state but got keys {sorted(state)}")

    def close(self) -> None:
        """Stop background work (threads) cleanly; called by ``DistributedOptimizer.close``."""


@dataclass(frozen=True)
class Algorithm:
    """Base of algorithm configs: subclasses are frozen dataclasses of hyperparameters."""

    name: ClassVar[str] = ""
    impl_class: ClassVar[type] = AlgorithmImpl

    def reify(self, ctx: AlgorithmContext) -> AlgorithmImpl:
        return self.impl_class(self, ctx)

    def config(self) -> dict:
        """JSON-serialisable hyperparameters (stored in checkpoints)."""
        return {"name": self.name, **dataclasses.asdict(self)}
