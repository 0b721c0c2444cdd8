"""QSGD and ByteGrad: 8-bit centralized gradient compression (C_LP_S), SPEC §3.

Each bucket's gradient goes through ``primitives.compressed_allreduce_``: quantized partitions
are scattered to their "servers", summed there, re-quantized and all-gathered, so each rank sends
~1/4 of the bytes of a float32 allreduce. As in the paper, neither uses error feedback by default
(``error_feedback=True`` adds worker and server error compensation, checkpointed per rank).

* ``qsgd``: stochastic rounding to ``levels`` levels of each chunk's norm (unbiased); the random
  stream is seeded per (seed, step, bucket, rank, partition), so runs are reproducible.
* ``bytegrad``: per-chunk min-max to uint8 (deterministic).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..primitives.codecs import Codec, MinMaxCodec, QSGDCodec, call_seed
from ..primitives.lowprec import (compressed_allreduce_, hierarchical_compressed_allreduce_,
                                  padded_length, partition_length)
from .base import Algorithm, AlgorithmImpl
from .registry import register


class CompressedAllReduceImpl(AlgorithmImpl):
    """Gradient averaging through C_LP_S with ``codec``; optional error feedback."""

    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.codec: Codec = algorithm.codec()
        self.error_feedback = bool(getattr(algorithm, "error_feedback", False))
        self.step = 0
        # per (bucket, tensor): worker error (padded length) and server error (one partition)
        self.errors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def comm(self):
        """The communicator C_LP_S runs on (node leaders when hierarchical; None elsewhere)."""
        topo = self.ctx.topo
        return topo.leaders if self.ctx.hierarchical else topo.comm

    def init_buckets(self, buckets) -> None:
        super().init_buckets(buckets)
        if not self.error_feedback or self.comm is None:
            return
        n = self.comm.Get_size()
        for bucket in buckets:
            for j, t in enumerate(bucket.communication_tensors()):
                self.errors.setdefault((bucket.index, j), (
                    torch.zeros(padded_length(t.numel(), n)),
                    torch.zeros(partition_length(t.numel(), n))))

    def on_step_start(self, step: int) -> None:
        self.step = step

    def reduce_bucket(self, bucket, step: int) -> None:
        for j, grad in enumerate(bucket.communication_tensors()):
            self.reduce_tensor(grad, bucket.index, j, step)

    def reduce_tensor(self, t: torch.Tensor, bucket_index: int, j: int, step: int,
                      scale: float | None = None) -> None:
        ctx = self.ctx
        if scale is None:
            scale = ctx.prescale * ctx.postscale
        worker_error, server_error = self.errors.get((bucket_index, j), (None, None))
        seed = call_seed(getattr(self.algorithm, "seed", 0), step, bucket_index, j)
        if ctx.hierarchical:
            hierarchical_compressed_allreduce_(t, ctx.topo, self.codec, worker_error=worker_error,
                                               server_error=server_error, scale=scale, seed=seed,
                                               stats=self.wire)
        else:
            compressed_allreduce_(t, ctx.topo.comm, self.codec, worker_error=worker_error,
                                  server_error=server_error, scale=scale, seed=seed,
                                  stats=self.wire)

    def state_dict(self) -> dict:
        return {"step": self.step,
                "errors": {f"{b}.{j}": {"worker": w.clone(), "server": s.clone()}
                           for (b, j), (w, s) in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state.get("step", 0))
        for key, pair in state.get("errors", {}).items():
            b, j = (int(v) for v in key.split("."))
            if (b, j) not in self.errors:
                raise ValueError(f"checkpoint has error-feedback state for bucket tensor {key} "
                                 f"that this model's buckets do not have")
            w, s = self.errors[(b, j)]
            if w.shape != pair["worker"].shape or s.shape != pair["server"].shape:
                raise ValueError(f"error-feedback state {key} has shapes "
                                 f"{tuple(pair['worker'].shape)}/{tuple(pair['server'].shape)}, "
                                 f"expected {tuple(w.shape)}/{tuple(s.shape)} (another world size?)")
            w.copy_(pair["worker"])
            s.copy_(pair["server"])


@register
@dataclass(frozen=True)
class QSGD(Algorithm):
    """8-bit QSGD: unbiased stochastic quantization of gradients, no error feedback."""

    name = "qsgd"
    impl_class = CompressedAllReduceImpl
    levels: int = 127
    chunk: int = 1024
    seed: int = 0
    error_feedback: bool = False

    def codec(self) -> Codec:
        return QSGDCodec(self.levels, self.chunk)


@register
@dataclass(frozen=True)
class ByteGrad(Algorithm):
    """8-bit per-chunk min-max quantization of gradients, no error feedback."""

    name = "bytegrad"
    impl_class = CompressedAllReduceImpl
    bits: int = 8
    chunk: int = 1024
    error_feedback: bool = False

    def codec(self) -> Codec:
        return MinMaxCodec(self.bits, self.chunk)
