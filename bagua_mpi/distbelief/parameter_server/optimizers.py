"""Update rules a Downpour shard applies to its slice when a push arrives.

Each rule is a small frozen config (validated at construction, the same on every shard) whose
``apply`` updates a parameter slice in place from a pushed gradient, with per-coordinate state
kept in plain NumPy arrays so the shard can checkpoint it.

Adagrad (Duchi et al.; paper §4.1) gives each coordinate its own step size from the squared
gradients it has seen, so each shard can run it on its slice with no knowledge of the others::

    acc += g * g
    w   -= lr * g / (sqrt(acc) + eps)

(``torch.optim.Adagrad``'s formula with ``lr_decay=0``, ``weight_decay=0``.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _check_positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SGD:
    """Plain SGD on the shard: ``w -= lr * g``."""

    lr: float = 0.01
    code = 1  # identifies the rule in the setup handshake (all shards must agree)

    def __post_init__(self):
        _check_positive("lr", self.lr)

    def init_state(self, size: int, dtype) -> dict[str, np.ndarray]:
        return {}

    def apply(self, params: np.ndarray, grad: np.ndarray, state: dict, lo: int, hi: int) -> None:
        """Update ``params[lo:hi]`` (a view into the shard) with ``grad`` (length hi - lo)."""
        params[lo:hi] -= self.lr * grad


@dataclass(frozen=True)
class Adagrad:
    """Adagrad on the shard; ``accumulator`` is checkpointed with the parameters.

    The paper's advice: Adagrad's ``lr`` can be about ten times the best fixed SGD step.
    """

    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator: float = 0.0
    code = 2

    def __post_init__(self):
        _check_positive("lr", self.lr)
        _check_positive("eps", self.eps)
        if not (isinstance(self.initial_accumulator, (int, float))
                and math.isfinite(self.initial_accumulator) and self.initial_accumulator >= 0):
            raise ValueError(f"initial_accumulator must be a finite number >= 0, got "
                             f"{self.initial_accumulator!r}")

    def init_state(self, size: int, dtype) -> dict[str, np.ndarray]:
        return {"accumulator": np.full(size, self.initial_accumulator, dtype=dtype)}

    def apply(self, params: np.ndarray, grad: np.ndarray, state: dict, lo: int, hi: int) -> None:
        acc = state["accumulator"][lo:hi]
        acc += grad * grad
        params[lo:hi] -= self.lr * (grad / (np.sqrt(acc) + self.eps))

