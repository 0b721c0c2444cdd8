"""Run-time settings read from the environment, each with a documented default.

Every setting can also be changed from Python (see the functions that mention it); the
environment variable only gives the starting value, so jobs can be tuned without code changes.

=============================  =======  ==========================================================
variable                       default  meaning
=============================  =======  ==========================================================
BAGUA_MPI_RANKS_PER_NODE       (unset)  testing override: pretend each node holds this many ranks
                                        (consecutive ranks), so hierarchical code runs on one host
BAGUA_MPI_CHECK                1        cross-rank agreement check of op, dtype and shape before
                                        each collective (one 16-byte allreduce); 0 turns it off
BAGUA_MPI_HIERARCHICAL         0        default for ``allreduce(..., hierarchical=None)``
BAGUA_MPI_STALL_WARNING_S      60       a collective waiting longer than this is logged
BAGUA_MPI_STALL_ABORT_S        600      ...and past this the whole job is aborted (0: never)
BAGUA_MPI_CUDA_AWARE           auto     1/0 force CUDA-aware MPI on/off instead of probing
BAGUA_MPI_ABORT_ON_EXCEPTION   1        an uncaught exception on any rank aborts the whole job
=============================  =======  ==========================================================
"""
from __future__ import annotations

import os


def env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected one of 1/0, true/false, yes/no, on/off")


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of seconds") from None


def env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a positive integer") from None
    if parsed <= 0:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return parsed


def env_tristate(name: str) -> bool | None:
    """``None`` for unset/'auto', else the flag's value."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    return env_flag(name, False)
