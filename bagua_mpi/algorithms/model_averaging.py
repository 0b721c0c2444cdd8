"""Algorithms that average *models* instead of gradients .

Each rank steps its optimizer on its own gradients; the engine flattens every bucket's
parameters into one buffer (``wants_flat_params``) so the averaging runs once per bucket.

* ``decentralized``: after each step (every ``communication_interval`` steps) average the
  model with the peers of D_FP_S: one random partner per step (``peer_selection="random"``,
  a pairing all ranks draw from a shared seed) or both ring neighbours (``"ring"``).
* ``low_precision_decentralized``: D_LP_S on a ring with 8-bit min-max compression of the
  change of each model since its peers last saw it.
* ``local_sgd``: average all models every ``period`` steps (C_FP_S on weights).

Hierarchical (``hierarchical=True``): models are first averaged inside each node, the
exchange runs among node leaders (peers drawn over nodes), then leaders broadcast in their
node. ``op`` and ``gradient_predivide_factor`` are refused (no gradient is summed);
``compression`` makes ``decentralized`` and ``local_sgd`` send 16-bit models. Models on a GPU
stay there (``forms.float32``; the primitives' device paths).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import consistency, runtime
from ..primitives.codecs import MinMaxCodec
from ..primitives.decentralized import (PeerEstimates, decentralized_average_,
                                        low_precision_decentralized_, peers_for)
from . import hyperparameters
from .base import Algorithm, AlgorithmImpl
from .registry import register
from .forms import float32
from .validation import (fraction, minmax_bits, one_of, positive_int, random_seed,
                         word_aligned_chunk)


class ModelAveragingImpl(AlgorithmImpl):
    communicates_gradients = False
    wants_flat_params = True

    def after_step(self, optimizer) -> None:
        """Every ``interval()`` steps: compare the optimizer's hyperparameters across the ranks
        (with the agreement check on), then average each bucket. The check runs in the first
        bucket's call: a call of its own (a hand-over to the communication thread and back)
        made a 70K-parameter model's step about 7% slower at 2 ranks."""
        if (self.step + 1) % self.interval() == 0:
            worker = runtime.get().worker  # in order with every other library operation
            check = consistency.enabled() and self.wrapped_optimizer is not None

            def average(bucket, first: bool) -> None:
                if first and check:
                    self.check_hyperparameters()
                self.average_bucket(bucket)

            for i, bucket in enumerate(self.buckets):
                worker.run(lambda b=bucket, first=i == 0: average(b, first),
                           ("average", bucket.index), bucket.device)

    def check_hyperparameters(self) -> None:
        """Comm thread: with the ring neighbours only (``hyperparameters.check_ring_neighbours``),
        so that no step waits for every rank, which the decentralized algorithms avoid; ranks
        whose learning rates parted ways raise ``MismatchError`` naming them."""
        hyperparameters.check_ring_neighbours(
            self.ctx.topo.comm, self.wrapped_optimizer.param_groups, self.step,
            self._checked_when())

    def _checked_when(self) -> str:
        steps = "local step" if self.interval() == 1 else f"{self.interval()} local steps"
        return f"checked before the models are averaged; the last {steps} used them"

    def interval(self) -> int:
        return 1

    def average_bucket(self, bucket) -> None:
        raise NotImplementedError

    def peer_exchange(self, flat, exchange) -> None:
        """``exchange(flat float model, wire)`` over ``self.transport``: among all ranks, or
        with ``hierarchical=True`` among the node leaders on their node's average model."""
        def among():
            with float32(flat, keep_float64=True) as work:
                exchange(work, self.transport)

        self.synchronize_([flat], among, node_average=True)


class DecentralizedImpl(ModelAveragingImpl):
    def interval(self) -> int:
        return self.algorithm.communication_interval

    def average_bucket(self, bucket) -> None:
        algo = self.algorithm
        wire_dtype = self.ctx.compression.wire_dtype

        def exchange(x, transport):
            peers = peers_for(algo.peer_selection, transport.rank, transport.size, self.step,
                              algo.seed)
            decentralized_average_(x, transport, peers, stats=self.wire, wire_dtype=wire_dtype)

        self.peer_exchange(bucket.flat_param, exchange)


@register
@dataclass(frozen=True)
class Decentralized(Algorithm):
    """32-bit decentralized SGD: average the model with peers after each local step."""

    name = "decentralized"
    impl_class = DecentralizedImpl
    averages_models = True
    peer_selection: str = "random"
    communication_interval: int = 1
    seed: int = 0
    validators = {"peer_selection": one_of(("random", "ring")),
                  "communication_interval": positive_int(because="steps between averagings"),
                  "seed": random_seed()}

    def compression_use(self) -> str | None:
        return "the model exchange (models travel as 16-bit words, averaged in float64)"


class LowPrecisionDecentralizedImpl(ModelAveragingImpl):
    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.codec = MinMaxCodec(algorithm.bits, algorithm.chunk)

    def interval(self) -> int:
        return self.algorithm.communication_interval

    def estimates(self, bucket) -> PeerEstimates:
        """This rank's public copy of its model and of each ring neighbour's, per parameter."""
        transport, segments, device = self.transport, bucket.segments(), bucket.device
        own = self.tensor_state("estimate_own", segments, device=device).data
        peers = {p: self.tensor_state(f"estimate_of_peer_{p}", segments, device=device).data
                 for p in peers_for("ring", transport.rank, transport.size)}
        return PeerEstimates(bucket.numel, own, peers)

    def init_exchange(self, buckets) -> None:
        for bucket in buckets:
            self.estimates(bucket)

    def average_bucket(self, bucket) -> None:
        def exchange(x, transport):
            peers = peers_for("ring", transport.rank, transport.size)
            low_precision_decentralized_(x, transport, peers, self.codec, self.estimates(bucket),
                                         gamma=self.algorithm.gamma, stats=self.wire)

        self.peer_exchange(bucket.flat_param, exchange)


@register
@dataclass(frozen=True)
class LowPrecisionDecentralized(Algorithm):
    """8-bit decentralized SGD on a ring, exchanging compressed model differences."""

    name = "low_precision_decentralized"
    impl_class = LowPrecisionDecentralizedImpl
    averages_models = True
    bits: int = 8
    chunk: int = 1024
    gamma: float = 1.0
    communication_interval: int = 1
    validators = {"bits": minmax_bits(), "chunk": word_aligned_chunk(),
                  # CHOCO-gossip's consensus step, analysed for (0, 1]; 1 averages the
                  # estimates plainly (on a ring of n > 2 ranks, above 1.5 it diverges)
                  "gamma": fraction(because="the consensus step size"),
                  "communication_interval": positive_int(because="steps between averagings")}


class LocalSGDImpl(ModelAveragingImpl):
    def interval(self) -> int:
        return self.algorithm.period

    def check_hyperparameters(self) -> None:
        """Among all ranks: one 40-byte allreduce per averaging, beside an allreduce of the
        whole model, so every rank raises the ``MismatchError`` alike."""
        signature = ("local_sgd average", ("buckets", len(self.buckets)),
                     (hyperparameters.FIELD,
                      hyperparameters.digest(self.wrapped_optimizer.param_groups)))
        # cache=False: a schedule's learning rate makes every digest new
        self.verify_naming_hyperparameters(signature, self.step, self._checked_when(),
                                           cache=False)

    def average_bucket(self, bucket) -> None:
        flat = bucket.flat_param
        self.synchronize_([flat], lambda: self.dense_allreduce_([flat], average_models=True))


@register
@dataclass(frozen=True)
class LocalSGD(Algorithm):
    """Periodic model averaging: local steps, then average the models every ``period`` steps."""

    name = "local_sgd"
    impl_class = LocalSGDImpl
    averages_models = True
    period: int = 4
    validators = {"period": positive_int(because="steps between averagings")}

    def compression_use(self) -> str | None:
        return "the model averaging (16-bit wire, float32 sums)"
