"""L-BFGS arithmetic for a coordinator that never sees a vector: only dot products.

The textbook two-loop recursion (Nocedal & Wright, Algorithm 7.4) computes ``H g`` from the last
k pairs ``s_i = x_{i+1} - x_i``, ``y_i = g_{i+1} - g_i``::

    q = g
    for i = k-1 .. 0:   a_i = rho_i s_i.q ;  q -= a_i y_i    (rho_i = 1 / s_i.y_i)
    r = gamma q          (gamma = s_{k-1}.y_{k-1} / y_{k-1}.y_{k-1})
    for i = 0 .. k-1:   b = rho_i y_i.r ;    r += (a_i - b) s_i
    return r             (the direction is -r)

Every vector it builds is a linear combination of the 2k+1 basis vectors
``[s_0..s_{k-1}, y_0..y_{k-1}, g]``, and every dot product it needs is a combination of the
entries of their Gram matrix. So the same recursion can run on *coefficients* (the "vector-free"
form of Chen et al., NeurIPS 2014) with the Gram matrix as the only input: the coordinator keeps
(2k+1)^2 numbers, the shards keep the vectors and compute the Gram entries as dot products, and
the direction is formed on the shards as one linear combination. Two round trips per iteration,
whatever k, instead of 2k with the vector form.

The line search is a weak-Wolfe bisection (Lewis & Overton): it needs f and the directional
derivative g.d at each trial point, both obtained from the shards.
"""
from __future__ import annotations

import math

import numpy as np

from .vector_ops import G, s_slot, y_slot


def two_loop_coefficients(gram: np.ndarray, k: int) -> np.ndarray:
    """Coefficients ``c`` with ``H g = sum_j c_j b_j`` over ``b = [s_0..s_{k-1}, y_0..y_{k-1}, g]``.

    ``gram`` is the (2k+1, 2k+1) Gram matrix of that basis (oldest pair first). With k = 0 the
    result is ``[1]`` (steepest descent).
    """
    n = 2 * k + 1
    if gram.shape != (n, n):
        raise ValueError(f"gram must be ({n}, {n}) for {k} pairs, got {gram.shape}")
    coef = np.zeros(n)
    coef[2 * k] = 1.0
    alpha = np.zeros(k)
    rho = np.array([1.0 / gram[i, k + i] for i in range(k)])
    for i in reversed(range(k)):
        alpha[i] = rho[i] * (gram[i] @ coef)
        coef[k + i] -= alpha[i]
    if k:
        coef *= gram[k - 1, 2 * k - 1] / gram[2 * k - 1, 2 * k - 1]
    for i in range(k):
        beta = rho[i] * (gram[k + i] @ coef)
        coef[i] += alpha[i] - beta
    return coef


class History:
    """The coordinator's view of the L-BFGS memory: slot numbers and their Gram matrix.

    Pair slots 0..m-1 name shard vectors ``s_slot(i)``/``y_slot(i)``; the Gram matrix is kept
    in a fixed (2m+1)^2 index space: ``s_i -> i``, ``y_i -> m + i``, ``g -> 2m``.
    """

    def __init__(self, m: int):
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"history must be a positive integer, got {m!r}")
        self.m = m
        self.order: list[int] = []  # pair slots in use, oldest first
        self.gram = np.zeros((2 * m + 1, 2 * m + 1))

    @property
    def g(self) -> int:
        return 2 * self.m

    def next_slot(self) -> int:
        """Slot for the next pair: a free one, else the oldest (which is dropped)."""
        if len(self.order) < self.m:
            used = set(self.order)
            return next(i for i in range(self.m) if i not in used)
        return self.order[0]

    def index_of(self, shard_slot: int) -> int:
        """Gram index of a shard slot (an s or y of the history, or the gradient)."""
        if shard_slot == G:
            return self.g
        rel = shard_slot - s_slot(0)
        return rel // 2 + (self.m if rel % 2 else 0)

    def vectors(self, pending: int | None = None) -> list[int]:
        """Shard slots of the current basis (plus a pending pair slot), gradient last."""
        slots = list(self.order)
        if pending is not None and pending not in slots:
            slots.append(pending)
        return [s_slot(i) for i in slots] + [y_slot(i) for i in slots] + [G]

    def set_dot(self, a: int, b: int, value: float) -> None:
        i, j = self.index_of(a), self.index_of(b)
        self.gram[i, j] = self.gram[j, i] = value

    def push(self, slot: int) -> None:
        if slot in self.order:
            self.order.remove(slot)
        self.order.append(slot)

    def drop(self, slot: int) -> None:
        if slot in self.order:
            self.order.remove(slot)

    def clear(self) -> None:
        self.order.clear()

    def ordered_gram(self) -> np.ndarray:
        idx = ([i for i in self.order] + [self.m + i for i in self.order] + [self.g])
        return self.gram[np.ix_(idx, idx)]

    def direction_terms(self) -> list[tuple[int, float]]:
        """``(shard slot, coefficient)`` pairs with ``d = sum coef * slot`` = -H g."""
        coef = two_loop_coefficients(self.ordered_gram(), len(self.order))
        return [(slot, -c) for slot, c in zip(self.vectors(), coef)]


class WolfeSearch:
    """Weak-Wolfe line search by bisection/expansion, driven one trial at a time.

    Accepts t when ``f(t) <= f0 + c1 t g0.d`` (sufficient decrease) and ``g(t).d >= c2 g0.d``
    (curvature, which also keeps s.y > 0 for the next L-BFGS pair).

    >>> ls = WolfeSearch(f0=1.0, gd0=-2.0)       # f(t) = (1 - t)^2 along d
    >>> ls.update((1 - ls.t) ** 2, -2 * (1 - ls.t))
    'accept'
    """

    def __init__(self, f0: float, gd0: float, t0: float = 1.0, c1: float = 1e-4,
                 c2: float = 0.9, max_trials: int = 30):
        if not gd0 < 0:
            raise ValueError(f"the search direction must descend (g.d < 0), got g.d = {gd0!r}")
        if not 0 < c1 < c2 < 1:
            raise ValueError(f"need 0 < c1 < c2 < 1, got c1={c1!r}, c2={c2!r}")
        self.f0, self.gd0, self.c1, self.c2 = f0, gd0, c1, c2
        self.t = float(t0)
        self.lo, self.hi = 0.0, math.inf
        self.trials = 0
        self.max_trials = max_trials

    def update(self, ft: float, gdt: float) -> str:
        """Report f and g.d at ``self.t``: 'accept', 'continue' (new ``self.t``) or 'fail'."""
        self.trials += 1
        if not math.isfinite(ft) or ft > self.f0 + self.c1 * self.t * self.gd0:
            self.hi = self.t
        elif gdt < self.c2 * self.gd0:
            self.lo = self.t
        else:
            return "accept"
        if self.trials >= self.max_trials:
            return "fail"
        self.t = 0.5 * (self.lo + self.hi) if math.isfinite(self.hi) else 2.0 * self.lo
        return "continue"
