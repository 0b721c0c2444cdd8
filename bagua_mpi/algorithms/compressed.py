"""QSGD and ByteGrad: 8-bit centralized gradient compression (C_LP_S).

Each bucket's gradient goes through C_LP_S (a ``lowprec.CompressedExchange``, planned once a
flattened bucket and kept across steps; ``compressed_allreduce_`` for each gradient of an
unflattened one): quantized partitions are scattered to their "servers", summed there,
re-quantized and all-gathered, so each rank sends ~1/4 of the bytes of a float32 allreduce. As
in the paper, neither uses error feedback by default (``error_feedback=True`` adds worker and
server error compensation, checkpointed per rank and parameter). Hierarchy, scaling and byte
counts are the framework's.

* ``qsgd``: stochastic rounding to ``levels`` levels of each chunk's norm (unbiased); the random
  stream is seeded per (seed, step, names of the parameters the tensor covers, rank,
  partition), so runs are reproducible and another bucketing keeps each tensor's stream.
* ``bytegrad``: per-chunk min-max to uint8 (deterministic).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..primitives.codecs import Codec, MinMaxCodec, QSGDCodec, call_seed
from ..primitives.lowprec import (CompressedExchange, Segment, compressed_allreduce_,
                                  compressed_reduce_scatter_, padded_length, partition_length)
from .base import Algorithm, AlgorithmImpl
from .forms import float32, float32_flat
from .registry import register
from .state import names_key
from .validation import (boolean, minmax_bits, positive_int, qsgd_levels, random_seed,
                         word_aligned_chunk)


class CompressedAllReduceImpl(AlgorithmImpl):
    """Gradient averaging through C_LP_S with ``codec``; optional error feedback."""

    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.codec: Codec = algorithm.codec()
        self.error_feedback = bool(getattr(algorithm, "error_feedback", False))

    def error_state(self, segments: list[tuple[str, int]], device="cpu"):
        """(worker error, server error) of the exchanged vector over ``segments``, or (None,
        None) without error feedback. The worker error covers the vector padded to n
        partitions; the server error is this rank's partition of it (C_LP_S's "server" part)."""
        if not self.error_feedback:
            return None, None
        n, r = self.comm.Get_size(), self.comm.Get_rank()
        numel = sum(k for _, k in segments)
        part = partition_length(numel, n)
        worker = self.tensor_state("worker_error", segments, padded_length(numel, n),
                                   device=device)
        worker.zero_padding()  # padding is not checkpointed: keep it zero in every run
        if self.zero_stage == 2:  # a reduce-scatter re-compresses nothing: no server error
            return worker.data, None
        server = self.tensor_state("server_error", segments, part * n,
                                   window=(r * part, (r + 1) * part), device=device)
        server.zero_padding()
        return worker.data, server.data

    def init_tensor(self, segments, device) -> None:
        self.error_state(segments, device)

    def reduce_bucket(self, bucket, step: int) -> None:
        """One C_LP_S of the bucket's flat gradient, planned once and kept across steps
        (``kept_plan``: the checks and the views of the gradient and error memories), run
        with this step's seed. Without flattening, each gradient on its own
        (``reduce_tensor``)."""
        if bucket.flat_grad is None:
            super().reduce_bucket(bucket, step)
            return
        segments = bucket.segments()
        seed = self.stream_seed(step, segments)
        with float32_flat(bucket) as grad:
            errors = self.error_state(segments, grad.device)   # their padding zeroed each step
            exchange = self.kept_plan(bucket, grad, lambda: CompressedExchange(
                [Segment(grad, self.codec, *errors, seed=seed)], self.comm.Get_size()))
            exchange.run(self.transport, scale=self.scale, stats=self.wire, seeds=[seed])

    def reduce_tensor(self, grad, segments, step: int) -> None:
        worker_error, server_error = self.error_state(segments, grad.device)
        compressed_allreduce_(grad, self.transport, self.codec, worker_error=worker_error,
                              server_error=server_error, scale=self.scale,
                              seed=self.stream_seed(step, segments), stats=self.wire)

    def stream_seed(self, step: int, segments) -> int:
        """The random stream of ``step``'s exchange of the tensor over ``segments``: the same on
        every rank, and the tensor's whatever the bucketing (QSGD's; ByteGrad reads none)."""
        return call_seed(getattr(self.algorithm, "seed", 0), step, names_key(segments))

    def reduce_scatter_bucket(self, bucket, step: int, out) -> None:
        """ZeRO stage 2: the first half of C_LP_S on the padded bucket: this rank receives the
        sum of its partition, each rank's part compressed once (worker error feedback on what
        it sends, the same state as the stage-0 exchange of the flat bucket); no server error
        (nothing is re-compressed)."""
        segments = bucket.segments()
        worker_error, _ = self.error_state(segments, bucket.device)
        with float32(bucket.grad_storage) as padded, float32(out) as mine:
            compressed_reduce_scatter_(padded, self.transport, self.codec, mine,
                                       worker_error=worker_error, scale=self.scale,
                                       seed=self.stream_seed(step, segments), stats=self.wire)


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
    validators = {"levels": qsgd_levels(), "chunk": positive_int(because="values per norm"),
                  "seed": random_seed(), "error_feedback": boolean()}

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
    validators = {"bits": minmax_bits(), "chunk": word_aligned_chunk(),
                  "error_feedback": boolean()}

    def codec(self) -> Codec:
        return MinMaxCodec(self.bits, self.chunk)
