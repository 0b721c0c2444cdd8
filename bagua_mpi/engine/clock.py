"""The one step clock of a ``DistributedOptimizer``.

The optimizer owns it and advances it once per ``step()``; the engine (which passes the step
to ``communicate_bucket``, read on the main thread when a bucket is launched) and the algorithm
implementation (``AlgorithmImpl.step``) only read it. Between steps it holds the index of the
next step, which is also what a checkpoint records.
"""
from __future__ import annotations


class StepClock:
    """A mutable step count shared by reference (``clock.step``)."""

    __slots__ = ("step",)

    def __init__(self, step: int = 0):
        self.step = int(step)

    def __repr__(self) -> str:
        return f"StepClock(step={self.step})"
