"""Gradient compression for the optimizer wrapper, with Horovod's names.

``Compression.none``, ``Compression.fp16`` and ``Compression.bf16`` (and ``hvd.Compression``-style
objects with the same attributes). A 16-bit compressor sends 16-bit words on the wire: the bucket
is reduced by scatter-reduce (alltoall of 16-bit partitions, local sum in float32) then an
allgather of the 16-bit partial results (see ``primitives/centralized.py``), so it halves the
bytes of a float32 allreduce while every addition still runs in float32.
"""
from __future__ import annotations

import torch


class Compressor:
    """``wire_dtype`` None means no compression; ``compress``/``decompress`` as in Horovod."""

    wire_dtype: torch.dtype | None = None
    name = "none"

    def compress(self, tensor: torch.Tensor):
        if self.wire_dtype is None or not tensor.is_floating_point():
            return tensor, None
        return tensor.to(self.wire_dtype), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class _FP16(Compressor):
    wire_dtype = torch.float16
    name = "fp16"


class _BF16(Compressor):
    wire_dtype = torch.bfloat16
    name = "bf16"


class Compression:
    none = Compressor()
    fp16 = _FP16()
    bf16 = _BF16()

    @staticmethod
    def parse(value) -> Compressor:
        if value is None:
            return Compression.none
        if isinstance(value, Compressor):
            return value
        if isinstance(value, str) and value.lower() in ("none", "fp16", "bf16"):
            return getattr(Compression, value.lower())
        # A Horovod compressor object or class: map it by name.
        name = getattr(value, "__name__", type(value).__name__).lower()
        for key in ("fp16", "bf16", "none"):
            if key in name:
                return getattr(Compression, key)
        raise ValueError(f"unknown compression {value!r}; valid: none, fp16, bf16")
