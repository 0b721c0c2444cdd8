"""The small instruction set Sandblaster's coordinator runs on the shards' slices.

The coordinator never holds the parameters (paper §4.2): it sends each shard a *program*, a list
of vector operations on named slots (the parameters, the gradient, the search direction, the
L-BFGS history...), and gets back only the partial results of the reductions (dot products),
which it sums over shards. A program travels as a float64 array of shape (n, 6), one row per
operation, ``[opcode, dst, a, b, alpha, beta]``; slot ids and counts are small integers, exact in
float64. Slots are created (as zeros) when first written.

==============  =======================================================================
opcode          effect on the shard's slice
==============  =======================================================================
ZERO dst        dst = 0
COPY dst a      dst = a
SCALE dst       dst *= alpha
AXPY dst a      dst += alpha * a
LINCOMB dst a b dst = alpha * a + beta * b     (dst may be a or b)
DOT a b         append a . b (this shard's part) to the results
BEGIN_EVAL a    start evaluation number alpha at the point in slot a: workers fetching for it get
                slot a, the gradient accumulator is zeroed, the portion ledger emptied
END_EVAL dst    dst = alpha * (gradient accumulator); the ledger must hold beta portions
==============  =======================================================================

Example -- the trial point of a line search and the squared norm of the direction::

    prog = Program()
    prog.lincomb(XT, 1.0, X, t, D)
    i = prog.dot(D, D)
    results = run_on_all_shards(prog)      # summed over shards by the coordinator
    dd = results[i]
"""
from __future__ import annotations

from enum import IntEnum
from typing import Callable

import numpy as np

from ..errors import DistBeliefError

ROW = 6


class VOp(IntEnum):
    ZERO = 1
    COPY = 2
    SCALE = 3
    AXPY = 4
    LINCOMB = 5
    DOT = 6
    BEGIN_EVAL = 7
    END_EVAL = 8


# Named slots used by Sandblaster L-BFGS; history pairs live at HISTORY + 2i (s) and +2i+1 (y).
X, G, D, XT, GT, GACC = 0, 1, 2, 3, 4, 5
HISTORY = 8


def s_slot(i: int) -> int:
    return HISTORY + 2 * i


def y_slot(i: int) -> int:
    return HISTORY + 2 * i + 1


class Program:
    """Builder of a program; methods return ``self`` except ``dot`` (the result's index)."""

    def __init__(self):
        self.rows: list[tuple[float, ...]] = []
        self.n_results = 0

    def _add(self, op: VOp, dst=0, a=0, b=0, alpha=0.0, beta=0.0) -> "Program":
        self.rows.append((float(op), float(dst), float(a), float(b), float(alpha), float(beta)))
        return self

    def zero(self, dst: int) -> "Program":
        return self._add(VOp.ZERO, dst)

    def copy(self, dst: int, a: int) -> "Program":
        return self._add(VOp.COPY, dst, a)

    def scale(self, dst: int, alpha: float) -> "Program":
        return self._add(VOp.SCALE, dst, alpha=alpha)

    def axpy(self, dst: int, alpha: float, a: int) -> "Program":
        return self._add(VOp.AXPY, dst, a, alpha=alpha)

    def lincomb(self, dst: int, alpha: float, a: int, beta: float, b: int) -> "Program":
        return self._add(VOp.LINCOMB, dst, a, b, alpha, beta)

    def dot(self, a: int, b: int) -> int:
        self._add(VOp.DOT, 0, a, b)
        self.n_results += 1
        return self.n_results - 1

    def begin_eval(self, src: int, eval_id: int) -> "Program":
        return self._add(VOp.BEGIN_EVAL, 0, src, alpha=eval_id)

    def end_eval(self, dst: int, scale: float, n_portions: int) -> "Program":
        return self._add(VOp.END_EVAL, dst, alpha=scale, beta=n_portions)

    def array(self) -> np.ndarray:
        return np.array(self.rows, dtype=np.float64).reshape(-1, ROW)

    def __len__(self) -> int:
        return len(self.rows)


class SlotStore:
    """A shard's named vectors and the interpreter of programs over them."""

    def __init__(self, size: int, dtype):
        self.size = int(size)
        self.dtype = np.dtype(dtype)
        self.slots: dict[int, np.ndarray] = {}
        # Evaluation hooks, set by the shard server (they touch state beyond the slots).
        self.on_begin_eval: Callable[[int, int], None] | None = None
        self.on_end_eval: Callable[[int, float, int], None] | None = None

    def get(self, slot: int) -> np.ndarray:
        try:
            return self.slots[slot]
        except KeyError:
            raise DistBeliefError(f"vector slot {slot} read before it was written "
                                  f"(slots held: {sorted(self.slots)})") from None

    def out(self, slot: int) -> np.ndarray:
        vec = self.slots.get(slot)
        if vec is None:
            vec = self.slots[slot] = np.zeros(self.size, dtype=self.dtype)
        return vec

    def run(self, program: np.ndarray) -> np.ndarray:
        """Execute ``program`` (shape (n, 6)) in order; return the DOT results (float64)."""
        if program.ndim != 2 or program.shape[1] != ROW:
            raise DistBeliefError(f"a program is an (n, {ROW}) array, got shape {program.shape}")
        results = []
        for row in program:
            op, dst, a, b = (int(v) for v in row[:4])
            alpha, beta = float(row[4]), float(row[5])
            if op == VOp.ZERO:
                self.out(dst)[:] = 0
            elif op == VOp.COPY:
                src = self.get(a)
                np.copyto(self.out(dst), src)
            elif op == VOp.SCALE:
                self.get(dst)[:] *= alpha
            elif op == VOp.AXPY:
                src = self.get(a)
                self.out(dst)[:] += alpha * src
            elif op == VOp.LINCOMB:
                va, vb = self.get(a), self.get(b)
                combined = alpha * va + beta * vb  # a temporary, so dst may alias a or b
                np.copyto(self.out(dst), combined)
            elif op == VOp.DOT:
                results.append(float(np.dot(self.get(a).astype(np.float64, copy=False),
                                            self.get(b).astype(np.float64, copy=False))))
            elif op == VOp.BEGIN_EVAL:
                self.get(a)
                if self.on_begin_eval is None:
                    raise DistBeliefError("BEGIN_EVAL needs a shard server")
                self.on_begin_eval(int(alpha), a)
            elif op == VOp.END_EVAL:
                if self.on_end_eval is None:
                    raise DistBeliefError("END_EVAL needs a shard server")
                self.on_end_eval(dst, alpha, int(beta))
            else:
                raise DistBeliefError(f"unknown vector operation code {op}")
        return np.array(results, dtype=np.float64)
