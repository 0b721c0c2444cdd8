"""How one model replica is cut into partitions, and which data must cross the cuts (paper §3).

Pure bookkeeping (no MPI, no torch), so every check runs before any message is sent:

* ``split_units(n, parts)`` / ``check_bounds(bounds, n, parts)``: a partition of ``n`` units
  (layers of a pipeline, or rows/features of a layer) into ``parts`` consecutive blocks, given as
  ``bounds = [0, b_1, ..., n]``; block m is ``[bounds[m], bounds[m+1])``.
* ``exchange_plan(needs, owns)``: which partition sends which unit range to which. Partition m
  *owns* ``owns[m]`` of a layer's input units and *needs* ``needs[m]`` (the receptive fields of
  its output block); it receives ``needs[m] & owns[j]`` from every j != m. Each needed unit is
  sent once per receiving partition, however many of its edges cross the cut -- the paper's
  "its state is only sent to the machine on the other side of that boundary once".

``PartitionError`` (``errors``: a ``DistBeliefError`` and a ``ValueError``) names the offending
values.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import PartitionError


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise PartitionError(f"{name} must be an integer, got {value!r}")
    return int(value)


def split_units(n_units: int, parts: int) -> list[int]:
    """Bounds of ``parts`` blocks of ``n_units`` whose sizes differ by at most one.

    >>> split_units(10, 4)
    [0, 3, 6, 8, 10]
    """
    n_units, parts = _int("n_units", n_units), _int("parts", parts)
    if parts < 1:
        raise PartitionError(f"the number of partitions must be >= 1, got {parts}")
    if parts > n_units:
        raise PartitionError(f"{parts} partitions for {n_units} units: every partition needs at "
                             f"least one unit; use at most {n_units} partitions")
    base, extra = divmod(n_units, parts)
    bounds = [0]
    for m in range(parts):
        bounds.append(bounds[-1] + base + (1 if m < extra else 0))
    return bounds


def check_bounds(bounds, n_units: int, parts: int, what: str = "units") -> list[int]:
    """Validate user bounds (or make even ones when ``bounds`` is None); return them as ints."""
    if bounds is None:
        try:
            return split_units(n_units, parts)
        except PartitionError as exc:
            raise PartitionError(f"{what}: {exc}") from None
    bounds = [_int("bound", b) for b in bounds]
    if parts > n_units:
        raise PartitionError(f"{what}: {parts} partitions for {n_units} units; every partition "
                             f"needs at least one unit")
    if len(bounds) != parts + 1:
        raise PartitionError(f"{what}: {parts} partitions need {parts + 1} bounds, got "
                             f"{len(bounds)}: {bounds}")
    if bounds[0] != 0 or bounds[-1] != n_units:
        raise PartitionError(f"{what}: bounds {bounds} do not cover the {n_units} units "
                             f"(they must start at 0 and end at {n_units})")
    empty = [m for m in range(parts) if bounds[m + 1] <= bounds[m]]
    if empty:
        raise PartitionError(f"{what}: bounds {bounds} leave partition(s) {empty} with no unit "
                             f"(bounds must increase strictly)")
    return bounds


@dataclass(frozen=True)
class Transfer:
    """``units [lo, hi)`` of a layer's input go from partition ``src`` to partition ``dst``."""

    src: int
    dst: int
    lo: int
    hi: int


def exchange_plan(needs: list[tuple[int, int]], owns: list[tuple[int, int]]) -> list[Transfer]:
    """Every transfer of one layer's input, in (dst, src) order (so both sides agree on it)."""
    if len(needs) != len(owns):
        raise PartitionError(f"{len(needs)} needed ranges for {len(owns)} owners")
    plan = []
    for dst, (nlo, nhi) in enumerate(needs):
        covered = 0
        for src, (olo, ohi) in enumerate(owns):
            lo, hi = max(nlo, olo), min(nhi, ohi)
            if lo < hi:
                covered += hi - lo
                if src != dst:
                    plan.append(Transfer(src, dst, lo, hi))
        if covered != nhi - nlo:
            raise PartitionError(f"partition {dst} needs input units [{nlo}, {nhi}) but the "
                                 f"owners {owns} hold only {covered} of them")
    return plan
