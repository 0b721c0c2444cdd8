"""Reduction operations (Horovod's names) and how each maps to MPI for each dtype.

``Adasum`` (Horovod's adaptive summation) is no MPI reduction: ``allreduce`` and
``grouped_allreduce`` run it themselves (``primitives/adasum.py``); ``mpi_op`` refuses it.
"""
from __future__ import annotations

import enum

from mpi4py import MPI

from .buffers import FLOATING


class ReduceOp(enum.Enum):
    Average = "average"
    Sum = "sum"
    Min = "min"
    Max = "max"
    Product = "product"
    Adasum = "adasum"

    @classmethod
    def parse(cls, op) -> "ReduceOp":
        if isinstance(op, cls):
            return op
        if isinstance(op, UnsupportedOp):
            raise ValueError(op.why)
        if isinstance(op, str):
            for member in cls:
                if op.lower() in (member.value, member.name.lower()):
                    return member
        raise ValueError(f"unknown reduction op {op!r}; valid: "
                         + ", ".join(m.name for m in cls))


class UnsupportedOp:
    """A Horovod reduction bagua_mpi does not implement; using it raises ``ValueError``."""

    def __init__(self, name: str, why: str):
        self.name = name
        self.why = why

    def __repr__(self) -> str:
        return self.name


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product
Adasum = ReduceOp.Adasum

_NUMERIC = {ReduceOp.Average: MPI.SUM, ReduceOp.Sum: MPI.SUM, ReduceOp.Min: MPI.MIN,
            ReduceOp.Max: MPI.MAX, ReduceOp.Product: MPI.PROD}
# Booleans reduce logically: Min and Product mean "all" (logical and), Max means "any".
_BOOLEAN = {ReduceOp.Min: MPI.LAND, ReduceOp.Max: MPI.LOR, ReduceOp.Product: MPI.LAND}


def mpi_op(op: ReduceOp, dtype: str) -> MPI.Op:
    """The MPI operation for ``op`` on ``dtype``; ``TypeError`` where it has no meaning,
    ``ValueError`` for Adasum (no MPI operation: only the allreduce family implements it)."""
    if op is ReduceOp.Adasum:
        raise ValueError("op=Adasum is not an MPI reduction: only allreduce and grouped_allreduce "
                         "(and their in-place and async forms) implement it")
    if dtype == "bool":
        if op not in _BOOLEAN:
            raise TypeError(f"{op.name} is not defined for bool tensors; use Min (logical and), "
                            f"Max (logical or) or Product, or cast to an integer dtype")
        return _BOOLEAN[op]
    if op is ReduceOp.Average and dtype not in FLOATING:
        raise TypeError(f"Average of {dtype} tensors would truncate; use Sum, or a floating dtype")
    return _NUMERIC[op]
