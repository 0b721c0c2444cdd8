"""Run-time settings read from the environment: the one place that reads ``BAGUA_MPI_*``.

Every variable the library reads has an accessor below that parses and validates it; other
modules call the accessor, never ``os.environ``, so a value is checked the same way everywhere
and a bad one fails with a ``ConfigError`` (a ``ValueError``) naming the variable and the value.
``init()`` calls ``check_environment()``, which reads them all once (a typo fails at start-up on
every rank, not an hour later deep in a step) and warns about ``BAGUA_MPI_*`` names it does not
know (a misspelt variable would otherwise be a silent no-op).

Most settings can also be changed from Python (see the functions that mention them); the
variable gives the starting value, so jobs can be tuned without code changes.

==============================  =======  =========================================================
variable                        default  meaning
==============================  =======  =========================================================
BAGUA_MPI_RANKS_PER_NODE        (unset)  testing override: pretend each node holds this many
                                         ranks (consecutive ranks), so hierarchical code runs on
                                         one host; a positive integer
BAGUA_MPI_CHECK                 1        cross-rank agreement check of op, dtype and shape before
                                         each collective (one 40-byte allreduce); 0 turns it off
BAGUA_MPI_HIERARCHICAL          0        default for ``allreduce(..., hierarchical=None)`` and
                                         ``DistributedOptimizer(hierarchical=None)``
BAGUA_MPI_STALL_WARNING_S       60       a collective waiting longer than this is logged (> 0)
BAGUA_MPI_STALL_ABORT_S         600      ...and past this the whole job is aborted (0: never)
BAGUA_MPI_EXIT_TIMEOUT_S        600      how long a finishing rank waits at shutdown for the
                                         others to finish too before it aborts the job, naming
                                         the ranks still missing (0: wait for ever)
BAGUA_MPI_ABORT_ON_EXCEPTION    1        an uncaught exception in any thread, or a non-zero
                                         ``sys.exit``, on any rank aborts the whole job
BAGUA_MPI_CUDA_AWARE            auto     1/0 force CUDA-aware MPI on/off instead of probing
BAGUA_MPI_BACKEND               auto     who carries the payloads: auto, mpi, nccl,
                                         nccl_hierarchical or gloo (``bagua_mpi.backends``)
BAGUA_MPI_KERNEL_THREADS        (auto)   Numba threads per rank for the CPU compression kernels
                                         (default: cores / ranks on the node); positive integer
BAGUA_MPI_SHARED_BUCKETS        1        CPU gradient buckets in node-shared memory (0: via MPI)
BAGUA_MPI_TIMELINE              (unset)  path prefix of a Chrome-trace timeline per rank
BAGUA_MPI_CHECKPOINT_SCHEME     auto     checkpoint write scheme: auto, mpio (parallel h5py) or
                                         token (one rank writes at a time)
BAGUA_MPI_CHECKPOINT_FAULT      (unset)  crash tests only: ``<phase>[@rank]`` makes that rank
                                         (default 0) SIGKILL itself at that phase of ``save``
BAGUA_MPI_ELASTIC_DIR           (unset)  default ``checkpoint_dir`` of ``elastic.TorchState``:
                                         every commit is also written there, and a restarted
                                         job resumes from it
BAGUA_MPI_FLIGHT_RECORDER_SIZE  256      library operations each rank remembers for the hang
                                         reports and the dump at a stall abort (0: off; the
                                         stall messages then name only this rank's operation)
BAGUA_MPI_HANG_DIR              (unset)  directory every rank can read where ranks leave their
                                         state and flight records (``docs/hangs.md``); default
                                         ``/dev/shm`` (else the temp dir), which only ranks on
                                         one node share: set a shared one for multi-node jobs
BAGUA_MPI_COMM_LOG              0        communication log: per-operation and per-bucket
                                         calls, bytes, time and bus bandwidth; rank 0 prints the
                                         table at shutdown (``docs/comm_log.md``)
BAGUA_MPI_STORE_ADDR            (auto)   address of rank 0's host where the NCCL and gloo
                                         groups' ranks meet (its TCP store); default: the
                                         loopback on one host, else its outward interface's
==============================  =======  =========================================================

Flags accept 1/0, true/false, yes/no, on/off (any case); an empty value means the default.
The test suite also reads ``BAGUA_MPI_PARALLEL_PYTHON`` (see ``tests/``), and the launch
scripts under ``slurm/`` read the ``LAUNCHER_ONLY`` names below (``docs/settings.md``); the
library reads neither, and does not take them for typos.
"""
from __future__ import annotations

import logging
import math
import os

from .exceptions import ConfigError

logger = logging.getLogger(__name__)

# Read by the library (accessors below) or by the test suite; anything else is a likely typo.
KNOWN = (
    "BAGUA_MPI_RANKS_PER_NODE", "BAGUA_MPI_CHECK", "BAGUA_MPI_HIERARCHICAL",
    "BAGUA_MPI_STALL_WARNING_S", "BAGUA_MPI_STALL_ABORT_S", "BAGUA_MPI_EXIT_TIMEOUT_S",
    "BAGUA_MPI_ABORT_ON_EXCEPTION", "BAGUA_MPI_CUDA_AWARE", "BAGUA_MPI_KERNEL_THREADS",
    "BAGUA_MPI_TIMELINE", "BAGUA_MPI_CHECKPOINT_SCHEME", "BAGUA_MPI_CHECKPOINT_FAULT",
    "BAGUA_MPI_ELASTIC_DIR", "BAGUA_MPI_BACKEND", "BAGUA_MPI_SHARED_BUCKETS",
    "BAGUA_MPI_FLIGHT_RECORDER_SIZE", "BAGUA_MPI_HANG_DIR", "BAGUA_MPI_COMM_LOG",
    "BAGUA_MPI_STORE_ADDR",
)
TEST_ONLY = ("BAGUA_MPI_PARALLEL_PYTHON",)
# Read by the shell scripts under slurm/ (the sbatch templates, local_cluster.sh; the tests read
# BAGUA_MPI_SLURM_DIR too): exported for the job, so the ranks see them in their environment.
LAUNCHER_ONLY = (
    "BAGUA_MPI_SRUN_MPI", "BAGUA_MPI_BIND_GPU",
    "BAGUA_MPI_SLURM_DIR", "BAGUA_MPI_SLURM_CPUS", "BAGUA_MPI_SLURMCTLD_PORT",
    "BAGUA_MPI_SLURMD_PORT",
)

CHECKPOINT_SCHEMES = ("auto", "mpio", "token")


# -- generic parsers (``name`` is always reported with the value) ---------------------------------
def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value


def env_flag(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r}: expected one of 1/0, true/false, yes/no, on/off")


def env_float(name: str, default: float, *, minimum: float | None = None,
              exclusive: bool = False) -> float:
    """A finite number of seconds; ``minimum`` (inclusive unless ``exclusive``) when given."""
    value = _raw(name)
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected a number of seconds") from None
    if not math.isfinite(parsed):
        raise ConfigError(f"{name}={value!r}: expected a finite number of seconds")
    if minimum is not None and (parsed < minimum or (exclusive and parsed == minimum)):
        bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
        raise ConfigError(f"{name}={value!r}: expected a number of seconds {bound}")
    return parsed


def env_int(name: str, default: int | None) -> int | None:
    """A positive integer."""
    value = _raw(name)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected a positive integer") from None
    if parsed <= 0:
        raise ConfigError(f"{name}={value!r}: expected a positive integer")
    return parsed


def env_tristate(name: str) -> bool | None:
    """``None`` for unset/'auto', else the flag's value."""
    value = _raw(name)
    if value is None or value.strip().lower() == "auto":
        return None
    return env_flag(name, False)


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered not in choices:
        listed = ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]
        raise ConfigError(f"{name}={value!r}: expected {listed}")
    return lowered


# -- one accessor per variable --------------------------------------------------------------------
def ranks_per_node() -> int | None:
    """``BAGUA_MPI_RANKS_PER_NODE``: simulated ranks per node (testing), or None."""
    return env_int("BAGUA_MPI_RANKS_PER_NODE", None)


def consistency_check() -> bool:
    """``BAGUA_MPI_CHECK``: the per-collective agreement check (default on)."""
    return env_flag("BAGUA_MPI_CHECK", True)


def shared_buckets() -> bool:
    """``BAGUA_MPI_SHARED_BUCKETS``: CPU gradient buckets in node-shared memory, reduced in
    place (``node_shared.py``; default on)."""
    return env_flag("BAGUA_MPI_SHARED_BUCKETS", True)


def hierarchical() -> bool:
    """``BAGUA_MPI_HIERARCHICAL``: default of the hierarchical switch (default off)."""
    return env_flag("BAGUA_MPI_HIERARCHICAL", False)


def stall_warning_s() -> float:
    """``BAGUA_MPI_STALL_WARNING_S``: seconds before a waiting collective is logged (> 0)."""
    return env_float("BAGUA_MPI_STALL_WARNING_S", 60.0, minimum=0.0, exclusive=True)


def stall_abort_s() -> float:
    """``BAGUA_MPI_STALL_ABORT_S``: seconds before a waiting collective aborts the job (0: never)."""
    return env_float("BAGUA_MPI_STALL_ABORT_S", 600.0, minimum=0.0)


def exit_timeout_s() -> float:
    """``BAGUA_MPI_EXIT_TIMEOUT_S``: how long shutdown waits for the other ranks (0: for ever)."""
    return env_float("BAGUA_MPI_EXIT_TIMEOUT_S", 600.0, minimum=0.0)


def abort_on_exception() -> bool:
    """``BAGUA_MPI_ABORT_ON_EXCEPTION``: abort the job on an uncaught exception (default on)."""
    return env_flag("BAGUA_MPI_ABORT_ON_EXCEPTION", True)


def cuda_aware() -> bool | None:
    """``BAGUA_MPI_CUDA_AWARE``: True/False forced, None to probe."""
    return env_tristate("BAGUA_MPI_CUDA_AWARE")


BACKENDS = ("auto", "mpi", "nccl", "nccl_hierarchical", "gloo")


def backend() -> str:
    """``BAGUA_MPI_BACKEND``: auto (default), mpi, nccl, nccl_hierarchical or gloo."""
    return env_choice("BAGUA_MPI_BACKEND", BACKENDS, "auto")


def kernel_threads() -> int | None:
    """``BAGUA_MPI_KERNEL_THREADS``: Numba threads per rank, or None for cores / local ranks."""
    return env_int("BAGUA_MPI_KERNEL_THREADS", None)


def elastic_dir() -> str | None:
    """``BAGUA_MPI_ELASTIC_DIR``: the elastic state's checkpoint directory, or None."""
    value = _raw("BAGUA_MPI_ELASTIC_DIR")
    return None if value is None else value.strip()


DEFAULT_FLIGHT_RECORDER_SIZE = 256


def flight_recorder_size() -> int:
    """``BAGUA_MPI_FLIGHT_RECORDER_SIZE``: operations remembered per rank (0: recorder off)."""
    name = "BAGUA_MPI_FLIGHT_RECORDER_SIZE"
    value = _raw(name)
    if value is None:
        return DEFAULT_FLIGHT_RECORDER_SIZE
    try:
        parsed = int(value)
    except ValueError:
        parsed = -1
    if parsed < 0:
        raise ConfigError(f"{name}={value!r}: expected a number of operations >= 0 (0: off)")
    return parsed


def hang_dir() -> str | None:
    """``BAGUA_MPI_HANG_DIR``: the directory for the hang reports' files, or None (default)."""
    value = _raw("BAGUA_MPI_HANG_DIR")
    return None if value is None else value.strip()


def comm_log() -> bool:
    """``BAGUA_MPI_COMM_LOG``: the communication log (``comm_log.py``; default off)."""
    return env_flag("BAGUA_MPI_COMM_LOG", False)


def store_address() -> str | None:
    """``BAGUA_MPI_STORE_ADDR``: where the process groups' ranks reach rank 0's store, or None
    (the library picks: ``process_groups._host_address``)."""
    value = _raw("BAGUA_MPI_STORE_ADDR")
    return None if value is None else value.strip()


def timeline_prefix() -> str | None:
    """``BAGUA_MPI_TIMELINE``: path prefix of the per-rank timeline files, or None."""
    value = _raw("BAGUA_MPI_TIMELINE")
    return None if value is None else value.strip()


def checkpoint_scheme() -> str:
    """``BAGUA_MPI_CHECKPOINT_SCHEME``: ``auto``, ``mpio`` or ``token`` (lower-cased)."""
    return env_choice("BAGUA_MPI_CHECKPOINT_SCHEME", CHECKPOINT_SCHEMES, "auto")


def checkpoint_fault(phases: tuple[str, ...] | None = None) -> tuple[str, int] | None:
    """``BAGUA_MPI_CHECKPOINT_FAULT=<phase>[@rank]`` as ``(phase, rank)``, or None when unset.

    ``phases``: the valid phase names (the checkpoint writer's ``PHASES``), checked when given.
    """
    name = "BAGUA_MPI_CHECKPOINT_FAULT"
    value = _raw(name)
    if value is None:
        return None
    phase, _, who = value.strip().partition("@")
    if phases is not None and phase not in phases:
        raise ConfigError(f"{name}={value!r}: unknown phase {phase!r}; expected one of "
                          f"{', '.join(phases)}")
    try:
        rank = int(who) if who else 0
    except ValueError:
        rank = -1
    if rank < 0:
        raise ConfigError(f"{name}={value!r}: expected <phase>[@rank] with a rank >= 0")
    return phase, rank


_ACCESSORS = {
    "BAGUA_MPI_RANKS_PER_NODE": ranks_per_node, "BAGUA_MPI_CHECK": consistency_check,
    "BAGUA_MPI_HIERARCHICAL": hierarchical, "BAGUA_MPI_STALL_WARNING_S": stall_warning_s,
    "BAGUA_MPI_STALL_ABORT_S": stall_abort_s, "BAGUA_MPI_EXIT_TIMEOUT_S": exit_timeout_s,
    "BAGUA_MPI_ABORT_ON_EXCEPTION": abort_on_exception, "BAGUA_MPI_CUDA_AWARE": cuda_aware,
    "BAGUA_MPI_KERNEL_THREADS": kernel_threads, "BAGUA_MPI_TIMELINE": timeline_prefix,
    "BAGUA_MPI_CHECKPOINT_SCHEME": checkpoint_scheme,
    "BAGUA_MPI_CHECKPOINT_FAULT": checkpoint_fault, "BAGUA_MPI_ELASTIC_DIR": elastic_dir,
    "BAGUA_MPI_BACKEND": backend, "BAGUA_MPI_SHARED_BUCKETS": shared_buckets,
    "BAGUA_MPI_FLIGHT_RECORDER_SIZE": flight_recorder_size, "BAGUA_MPI_HANG_DIR": hang_dir,
    "BAGUA_MPI_COMM_LOG": comm_log, "BAGUA_MPI_STORE_ADDR": store_address,
}
assert set(_ACCESSORS) == set(KNOWN)


def settings() -> dict:
    """Every setting's current value (validated), keyed by variable name."""
    return {name: accessor() for name, accessor in _ACCESSORS.items()}


def unknown_variables(environ=None) -> list[str]:
    """``BAGUA_MPI_*`` names in the environment that neither the library, the tests nor the
    launch scripts read (``LAUNCHER_ONLY``: a job submitted with ``BAGUA_MPI_SRUN_MPI=pmix``
    hands it to every rank, where it is no typo)."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("BAGUA_MPI_") and k not in KNOWN
                  and k not in TEST_ONLY and k not in LAUNCHER_ONLY)


def check_environment() -> dict:
    """Validate every setting (raises ``ConfigError``) and warn about unknown variables."""
    values = settings()
    unknown = unknown_variables()
    if unknown:
        logger.warning("bagua_mpi: ignoring unknown environment variable(s) %s (known: %s)",
                       ", ".join(unknown), ", ".join(KNOWN))
    return values
