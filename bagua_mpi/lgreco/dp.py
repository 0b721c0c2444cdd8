"""L-GreCo's dynamic programme: per-layer compression levels under an error budget.

Given for each layer l and candidate level c an error ``err[l][c]`` and a cost ``cost[l][c]``
(bytes, or predicted seconds in the time-aware variant), choose one level per layer to

    minimise  sum_l cost[l][c_l]   subject to   sum_l err[l][c_l] <= E_max.

Errors are discretized in steps of E_max / ``steps`` (10000 by default), rounding *up* so that
a solution that fits the discrete budget also fits the real one. Then a knapsack DP:

    DP[l][e] = min over c of DP[l-1][e - d(l, c)] + cost[l][c]      (e = 0 .. steps)

answer = min over e of DP[L][e], with the choice per layer recovered by backtracking.
O(steps x L x |C|) time (a compiled loop, over the candidates no other beats on both error
and cost), O(steps x L) memory for the choices.
Because rounding up can make the uniform default itself exceed the discrete budget, the
default is also evaluated and kept whenever the DP finds nothing cheaper: the result never
costs more than the default and never exceeds E_max.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # index into each layer's candidate list
    cost: float
    error: float
    from_dp: bool  # False: the DP found nothing better than the default


def solve(err: np.ndarray, cost: np.ndarray, e_max: float, default: list[int] | None = None,
          steps: int = 10_000) -> Solution:
    """err, cost: (L, C) arrays (np.inf marks a candidate a layer cannot use)."""
    err = np.asarray(err, dtype=np.float64)
    cost = np.asarray(cost, dtype=np.float64)
    if err.shape != cost.shape or err.ndim != 2:
        raise ValueError(f"err and cost must be (layers, candidates) arrays of one shape, got "
                         f"{err.shape} and {cost.shape}")
    if not e_max >= 0 or steps < 1:
        raise ValueError(f"need e_max >= 0 and steps >= 1, got {e_max!r}, {steps!r}")
    layers, _ = err.shape
    unit = e_max / steps if e_max > 0 else 1.0
    with np.errstate(invalid="ignore", over="ignore"):
        units = np.where(np.isfinite(err), np.ceil(err / unit - 1e-9), np.inf)
    if e_max == 0:
        units = np.where(err <= 0, 0, np.inf)
    units = np.where(units > steps, np.inf, units)
    best = np.full(steps + 1, np.inf)
    best[0] = 0.0
    choices = np.zeros((layers, steps + 1), dtype=np.int32)
    for layer in range(layers):
        front = np.array(pareto_front(units[layer], cost[layer]), dtype=np.int64)
        best = _relax()(best, front, units[layer, front].astype(np.int64), cost[layer, front],
                        choices[layer])
    solution = None
    if np.isfinite(best).any():
        e = int(np.argmin(best))
        picked = []
        for layer in reversed(range(layers)):
            c = int(choices[layer, e])
            picked.append(c)
            e -= int(units[layer, c])
        picked.reverse()
        solution = _evaluate(picked, err, cost, True)
    if default is not None:
        fallback = _evaluate(list(default), err, cost, False)
        if solution is None or fallback.cost < solution.cost:
            solution = fallback
    if solution is None:
        raise ValueError("no assignment fits the error budget and no default was given")
    return solution


@functools.cache
def _relax():
    """``_relax_layer`` compiled, on first use: importing numba costs every rank about 0.3 s,
    and most ranks never solve a knapsack."""
    import numba
    return numba.njit(cache=True, nogil=True)(_relax_layer)


def _relax_layer(best, cands, units, cost, pick):
    """One layer of the knapsack: new[e] = min over c of best[e - units[c]] + cost[c], with
    ``pick[e]`` the first candidate reaching the minimum (the lowest index on ties)."""
    new = np.full(best.size, np.inf)
    for j in range(cands.size):
        d, price = units[j], cost[j]
        for e in range(d, best.size):
            value = best[e - d] + price
            if value < new[e]:
                new[e] = value
                pick[e] = cands[j]
    return new


def pareto_front(units: np.ndarray, cost: np.ndarray) -> list[int]:
    """Candidates that no other beats on both error units and cost (ties: the lower index).

    Only these can be in an optimal choice; with rounded errors many candidates of a layer
    share a unit count (all zero for a sparse layer at high densities), so this prunes most
    of the DP's work for wide searches such as the 100 top-k densities.
    """
    usable = np.flatnonzero(np.isfinite(units) & np.isfinite(cost))
    order = usable[np.lexsort((usable, cost[usable], units[usable]))]
    front, cheapest = [], np.inf
    for c in order:
        if cost[c] < cheapest:
            front.append(int(c))
            cheapest = cost[c]
    return sorted(front)


def _evaluate(choice, err, cost, from_dp: bool) -> Solution:
    rows = np.arange(len(choice))
    return Solution(tuple(int(c) for c in choice), float(cost[rows, choice].sum()),
                    float(err[rows, choice].sum()), from_dp)
