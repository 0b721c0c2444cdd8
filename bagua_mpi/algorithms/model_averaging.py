"""Algorithms that average *models* instead of gradients (SPEC §3).

Each rank steps its optimizer on its own gradients; the engine flattens every bucket's
parameters into one buffer (``wants_flat_params``) so the averaging runs once per bucket.

* ``decentralized``: after each step (every ``communication_interval`` steps) average the
  model with the peers of D_FP_S: one random partner per step (``peer_selection="random"``,
  a pairing all ranks draw from a shared seed) or both ring neighbours (``"ring"``).
* ``low_precision_decentralized``: D_LP_S on a ring with 8-bit min-max compression of the
  change of each model since its peers last saw it.
* ``local_sgd``: average all models every ``period`` steps (C_FP_S on weights).

Hierarchical (``hierarchical=True``): models are first averaged inside each node, the
decentralized exchange runs among node leaders (peers drawn over nodes), then leaders
broadcast in their node.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from .. import collectives, runtime
from ..buffers import host_view
from ..ops import Average
from ..primitives.codecs import MinMaxCodec
from ..primitives.decentralized import (PeerEstimates, decentralized_average_,
                                        low_precision_decentralized_, peers_for)
from .base import Algorithm, AlgorithmImpl
from .registry import register


class ModelAveragingImpl(AlgorithmImpl):
    communicates_gradients = False
    wants_flat_params = True

    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.step = 0

    def on_step_start(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state.get("step", 0))

    def after_step(self, optimizer) -> None:
        if (self.step + 1) % self.interval() == 0:
            worker = runtime.get().worker  # in order with every other library operation
            for bucket in self.buckets:
                worker.run(lambda b=bucket: self.average_bucket(b), ("average", bucket.index))

    def interval(self) -> int:
        return 1

    def average_bucket(self, bucket) -> None:
        raise NotImplementedError

    def exchange_comm(self):
        """(communicator, rank, size) of the peer exchange, or None off the leaders."""
        topo = self.ctx.topo
        if not self.ctx.hierarchical:
            return topo.comm, topo.rank, topo.size
        if topo.leaders is None:
            return None
        return topo.leaders, topo.leaders.Get_rank(), topo.leaders.Get_size()

    def two_level(self, flat, exchange) -> None:
        """Node average, ``exchange(comm, rank, size)`` among leaders, node broadcast."""
        topo = self.ctx.topo
        if not self.ctx.hierarchical:
            exchange(topo.comm, topo.rank, topo.size)
            return
        buf = host_view(flat)
        topo.intra.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        buf /= topo.intra.Get_size()
        if topo.leaders is not None:
            exchange(topo.leaders, topo.leaders.Get_rank(), topo.leaders.Get_size())
        topo.node_broadcast_(buf)


class DecentralizedImpl(ModelAveragingImpl):
    def interval(self) -> int:
        return self.algorithm.communication_interval

    def average_bucket(self, bucket) -> None:
        algo = self.algorithm

        def exchange(comm, rank, size):
            peers = peers_for(algo.peer_selection, rank, size, self.step, algo.seed)
            decentralized_average_(bucket.flat_param, comm, peers, stats=self.wire)

        self.two_level(bucket.flat_param, exchange)


@register
@dataclass(frozen=True)
class Decentralized(Algorithm):
    """32-bit decentralized SGD: average the model with peers after each local step."""

    name = "decentralized"
    impl_class = DecentralizedImpl
    peer_selection: str = "random"
    communication_interval: int = 1
    seed: int = 0

    def __post_init__(self):
        if self.peer_selection not in ("random", "ring"):
            raise ValueError(f"peer_selection must be 'random' or 'ring', got "
                             f"{self.peer_selection!r}")
        if self.communication_interval < 1:
            raise ValueError(f"communication_interval must be >= 1, got "
                             f"{self.communication_interval!r}")


class LowPrecisionDecentralizedImpl(ModelAveragingImpl):
    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.codec = MinMaxCodec(algorithm.bits, algorithm.chunk)
        self.estimates: dict[int, PeerEstimates] = {}

    def interval(self) -> int:
        return self.algorithm.communication_interval

    def average_bucket(self, bucket) -> None:
        est = self.estimates.setdefault(bucket.index, PeerEstimates(bucket.numel))

        def exchange(comm, rank, size):
            low_precision_decentralized_(bucket.flat_param, comm, peers_for("ring", rank, size),
                                         self.codec, est, gamma=self.algorithm.gamma,
                                         stats=self.wire)

        self.two_level(bucket.flat_param, exchange)

    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "estimates": {str(b): e.state_dict() for b, e in self.estimates.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for b, est_state in state.get("estimates", {}).items():
            est = PeerEstimates(est_state["own"].numel())
            est.load_state_dict(est_state)
            self.estimates[int(b)] = est


@register
@dataclass(frozen=True)
class LowPrecisionDecentralized(Algorithm):
    """8-bit decentralized SGD on a ring, exchanging compressed model differences."""

    name = "low_precision_decentralized"
    impl_class = LowPrecisionDecentralizedImpl
    bits: int = 8
    chunk: int = 1024
    gamma: float = 1.0
    communication_interval: int = 1


class LocalSGDImpl(ModelAveragingImpl):
    def interval(self) -> int:
        return self.algorithm.period

    def average_bucket(self, bucket) -> None:
        collectives.allreduce_(bucket.flat_param, Average, hierarchical=self.ctx.hierarchical,
                               check=False)
        self.wire.allreduce(bucket.flat_param.numel() * bucket.flat_param.element_size(),
                            self.ctx.topo.size)


@register
@dataclass(frozen=True)
class LocalSGD(Algorithm):
    """Periodic model averaging: local steps, then average the models every ``period`` steps."""

    name = "local_sgd"
    impl_class = LocalSGDImpl
    period: int = 4

    def __post_init__(self):
        if not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"local_sgd period must be a positive integer, got {self.period!r}")
