"""``python -m bagua_mpi doctor``: what this machine and this launch give bagua_mpi.

    python -m bagua_mpi doctor                  # this process: versions, MPI, GPUs, memory...
    mpiexec -n 4 python -m bagua_mpi doctor     # ...plus topology and a ~1 s allreduce check
    python -m bagua_mpi doctor --json           # the same as a list of {check, status, value, fix}

Every line is ``OK``, ``WARN`` or ``FAIL``, a check name and what was found; each ``WARN`` and
``FAIL`` is followed by a one-line fix. The exit status is 1 when any rank found a ``FAIL`` (all
ranks agree on it), else 0. ``docs/doctor.md`` explains each line.

Steps (every rank runs them; only rank 0 prints):

1. the settings (``BAGUA_MPI_*``) and the backend choice, which decide whether ``init`` can run;
2. with several ranks, and when every rank's settings are valid, ``bagua_mpi.init()``;
3. this process's facts: versions, the MPI library, CUDA-aware MPI, NCCL, GPUs and which one
   this rank would use, ``/dev/shm``, HDF5, Slurm, the backend;
4. with several ranks: every rank's facts gathered to rank 0 (a fact that differs between ranks
   is shown per group of ranks), the topology, whether node-shared buckets will be used, and
   ``bagua_mpi.allreduce_`` timed against mpi4py's ``Allreduce`` on the same communicator;
5. the worst status is agreed by an allreduce and ``bagua_mpi.shutdown()`` ends cleanly, so a
   ``FAIL`` exits 1 on every rank instead of aborting the job.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import os
import socket
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from mpi4py import MPI

OK, WARN, FAIL = "OK", "WARN", "FAIL"
_SEVERITY = {OK: 0, WARN: 1, FAIL: 2}

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedOptimizer(bucket_size_mb=25)
LATENCY_BYTES = 8  # two float32: a pure latency measurement
BANDWIDTH_BYTES = 16 * 1024 * 1024  # large enough for the wire, small enough for ~1 s in all
# bagua_mpi against raw MPI, measured on 2 ranks of a 2-core machine: x2 (x4.5 with the
# agreement check) for 8 bytes, x1.0-1.15 for 16 MiB; far beyond that, something is wrong.
LATENCY_WARN_RATIO = 10.0
BANDWIDTH_WARN_RATIO = 1.5
OVERSUBSCRIBED_FIX = ("give each rank cores of its own (ranks x OMP_NUM_THREADS <= cores, no "
                      "other job on them) and run again; if it persists, report this output")
MAX_VARIANTS = 8  # per-rank variants of one check shown before the rest are summarized
PACKAGES = ("torch", "mpi4py", "numba", "h5py")  # installed alike on every rank, or trouble
SLURM_JOB_VARIABLES = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NODELIST",
                       "SLURM_NODELIST", "SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK",
                       "SLURM_GPUS_ON_NODE")
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                 MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    check: str  # what was looked at
    status: str  # OK, WARN or FAIL
    value: str  # what was found
    fix: str | None = None  # one line telling what to do; required for WARN and FAIL

    def __post_init__(self):
        if self.status not in _SEVERITY:
            raise ValueError(f"status must be OK, WARN or FAIL, got {self.status!r}")
        if self.status != OK and not self.fix:
            raise ValueError(f"{self.status} {self.check} needs a fix")


def ok(check: str, value: str) -> Check:
    return Check(check, OK, value)


def warn(check: str, value: str, fix: str) -> Check:
    return Check(check, WARN, value, fix)


def fail(check: str, value: str, fix: str) -> Check:
    return Check(check, FAIL, value, fix)


def guarded(check: str, probe, *args) -> list[Check]:
    """``probe(*args)`` (a list of checks), or one FAIL naming what went wrong: the doctor
    reports a broken installation, it must not die of it."""
    from .exceptions import ConfigError

    try:
        return probe(*args)
    except ConfigError as exc:
        return [fail(check, str(exc), f"correct or unset {_variable_in(str(exc))}")]
    except Exception as exc:  # noqa: BLE001 - any failure is a finding
        return [fail(check, f"could not check: {type(exc).__name__}: {exc}",
                     "report this output to the bagua_mpi maintainers")]


def _variable_in(message: str) -> str:
    """The ``BAGUA_MPI_*`` name a ``ConfigError`` message starts with."""
    return message.split("=", 1)[0] if message.startswith("BAGUA_MPI_") else "the variable"


# -- settings and backend: whether init can run ----------------------------------------------------

def settings_checks() -> list[Check]:
    """One FAIL per malformed ``BAGUA_MPI_*`` variable, else one OK listing those set."""
    from . import config

    # Each accessor on its own, so every malformed variable is named, not just the first.
    accessors = getattr(config, "_ACCESSORS", None) or {"all": config.settings}
    bad = []
    for accessor in accessors.values():
        try:
            accessor()
        except ValueError as exc:  # ConfigError is a ValueError
            bad.append(fail(f"setting {_variable_in(str(exc))}", str(exc),
                            f"correct or unset {_variable_in(str(exc))} (see bagua_mpi/config.py)"))
    checks = bad or [ok("settings", _settings_in_use(config))]
    unknown = config.unknown_variables()
    if unknown:
        checks.append(warn("unknown settings", ", ".join(unknown) + " (bagua_mpi ignores them)",
                           "check the spelling against bagua_mpi/config.py, or unset them"))
    return checks


def _settings_in_use(config) -> str:
    chosen = [f"{k}={os.environ[k]}" for k in config.KNOWN if os.environ.get(k, "").strip()]
    return "all valid; " + (", ".join(chosen) if chosen else "none set (defaults)")


def backend_checks() -> list[Check]:
    """The configured backend, whether it can run here, and what ``auto`` picks."""
    from . import backends

    configured = backends.resolve()
    try:
        backends.check_available(configured)
    except backends.BackendUnavailableError as exc:
        return [fail("backend", f"{configured}: {exc}",
                     "set BAGUA_MPI_BACKEND=auto or mpi, or run where the GPU/NCCL it needs is")]
    auto_backend = getattr(backends, "auto_backend", None)
    if auto_backend is None:
        return [ok("backend", f"configured backend: {configured}")]
    name, reason = auto_backend()
    return [ok("backend", f"configured {configured}; auto would choose {name}: {reason}")]


# -- this process ----------------------------------------------------------------------------------

def version_checks(gpus: list[str]) -> list[Check]:
    """Versions of bagua_mpi and what it runs on; a missing requirement is a FAIL."""
    from . import __version__

    checks = [ok("bagua_mpi version", __version__)]
    for package in PACKAGES:
        try:
            module = importlib.import_module(package)
        except ImportError as exc:
            checks.append(fail(f"{package} version", f"not importable: {exc}",
                               f"pip install {package}"))
            continue
        checks.append(ok(f"{package} version", str(module.__version__)))
    checks.append(numba_cuda_check(gpus))
    return checks


def numba_cuda_check(gpus: list[str]) -> Check:
    """numba-cuda runs the GPU compression kernels; only a GPU needs it."""
    try:
        version = importlib.metadata.version("numba-cuda")
    except importlib.metadata.PackageNotFoundError:
        if gpus:
            return warn("numba-cuda version", "not installed: compression kernels cannot run on "
                        "the GPU", "pip install 'bagua_mpi[cuda]'")
        return ok("numba-cuda version", "not installed (not needed without a GPU)")
    return ok("numba-cuda version", version)


NVVM_CHECK = "libNVVM (numba-cuda)"
NVVM_FIX = ("pip install 'bagua_mpi[cuda]' (it installs numba-cuda[cu12], whose CUDA 12 toolkit "
            "wheels hold libNVVM; numba-cuda[cu13] for a CUDA 13 torch), or load a CUDA "
            "toolkit (module load cuda) or point CUDA_HOME at one")


def nvvm_checks(gpus: list[str]) -> list[Check]:
    """Whether Numba finds libNVVM, the compiler of the GPU compression kernels. torch's CUDA
    wheels do not ship it, so without a toolkit the first compressed step fails ("libNVVM
    cannot be found") while gradient_allreduce, which compiles nothing, runs. Asked only where
    a GPU is visible and numba-cuda installed: elsewhere nothing needs it, or the numba-cuda
    line already says what to do."""
    if not gpus:
        return [ok(NVVM_CHECK, "not checked: no GPU visible (only GPU kernels need it)")]
    try:
        importlib.metadata.version("numba-cuda")
    except importlib.metadata.PackageNotFoundError:
        return [ok(NVVM_CHECK, "not checked: numba-cuda is not installed (see its line)")]
    from numba.core import config as numba_config

    if numba_config.ENABLE_CUDASIM:  # numba.cuda is then the simulator, whose NVVM is a stub
        return [ok(NVVM_CHECK, "not checked: NUMBA_ENABLE_CUDASIM=1 (Numba's CUDA simulator "
                   "compiles nothing)")]
    try:
        version = find_libnvvm()
    except Exception as exc:  # noqa: BLE001 - whatever numba raises, it found no usable one
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return [warn(NVVM_CHECK, f"numba.cuda cannot load it ({reason}): the compressed "
                     "algorithms cannot compile their GPU kernels (gradient_allreduce runs)",
                     NVVM_FIX)]
    path = nvvm_path()
    return [ok(NVVM_CHECK, f"libNVVM {version} loaded by numba.cuda"
               + (f" from {path}" if path else ""))]


def find_libnvvm() -> str:
    """libNVVM's version by numba.cuda's own lookup: ``nvvm.NVVM()``, the object its compiler
    uses, loads the library and asks its version. A host library: no kernel is compiled and no
    CUDA context is made, so it is quick on any node. Raises what numba raises where it finds
    none (``NvvmSupportError``, or the library loader's error)."""
    from numba.cuda.cudadrv import nvvm

    return ".".join(map(str, nvvm.NVVM().get_version()))


def nvvm_path() -> str | None:
    """The file numba.cuda's path search names for libNVVM, for the report; None where it
    names only the bare library (left to the system loader) or cannot say."""
    try:
        from numba.cuda.cudadrv import libs

        path = libs.get_cudalib("nvvm")
    except Exception:  # noqa: BLE001 - the version alone answers the check
        return None
    return path if isinstance(path, str) and os.path.isabs(path) else None


def mpi_checks() -> list[Check]:
    """The MPI library and the thread level it granted (the comm thread needs ``multiple``)."""
    major, minor = MPI.Get_version()
    library = MPI.Get_library_version().strip().splitlines()[0].strip()
    checks = [ok("MPI library", f"{' '.join(library.split())} (MPI {major}.{minor})")]
    level = MPI.Query_thread()
    name = THREAD_LEVELS.get(level, str(level))
    if level == MPI.THREAD_MULTIPLE:
        checks.append(ok("MPI thread level", name))
    else:
        checks.append(warn(
            "MPI thread level", f"{name}: one thread at a time may call MPI, so the watchdog "
            "cannot see peers leave mid-collective",
            "use an MPI built with thread support (MPI_THREAD_MULTIPLE), and leave "
            "mpi4py.rc.thread_level at its default"))
    return checks


def visible_gpus() -> list[str]:
    """Names of the CUDA devices torch sees (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def cuda_aware_checks(gpus: list[str]) -> list[Check]:
    """What the MPI says of itself, and what the library will do with device buffers."""
    from . import config, cuda

    reported = cuda.mpi_reports_cuda_support()
    library = {True: "yes (MPIX_Query_cuda_support)", False: "no (MPIX_Query_cuda_support)",
               None: "unknown: this MPI exports no MPIX_Query_cuda_support"}[reported]
    checks = [ok("CUDA-aware MPI (library)", library)]
    forced = config.cuda_aware()
    name = "CUDA-aware MPI (used)"
    if forced and not gpus:
        checks.append(fail(name, f"forced CUDA-aware without a GPU ({_cuda_aware_variable()})",
                           "unset BAGUA_MPI_CUDA_AWARE (or set it to auto) where no GPU is "
                           "visible"))
    elif forced is None and not gpus:
        checks.append(ok(name, "not needed: no GPU visible (not probed)"))
    else:
        checks.append(_cuda_aware_verdict(cuda, forced, reported))
    return checks


def _cuda_aware_verdict(cuda, forced: bool | None, reported: bool | None) -> Check:
    """The library's own decision (forced, the MPIX answer, or the probe) and how it got it."""
    name = "CUDA-aware MPI (used)"
    aware = cuda.mpi_is_cuda_aware()  # cached per process: what training will use
    how_decided = getattr(cuda, "how_decided", None)
    if how_decided is not None:
        how = how_decided()
    elif forced is not None:
        how = f"forced by {_cuda_aware_variable()}"
    else:
        how = "probe: a device buffer through MPI in a child process"
    value = f"{'yes' if aware else 'no'} ({how})"
    if aware and forced and reported is False:
        return warn(name, value + "; the library itself reports no CUDA support",
                    "unset BAGUA_MPI_CUDA_AWARE so the library decides: a device pointer may "
                    "crash an MPI that is not CUDA-aware")
    if not aware and forced is None:
        return warn(name, value + ": device payloads are staged through pinned host memory",
                    "use a CUDA-aware MPI build, or the NCCL backend (BAGUA_MPI_BACKEND=auto "
                    "or nccl)")
    return ok(name, value)


def _cuda_aware_variable() -> str:
    return f"BAGUA_MPI_CUDA_AWARE={os.environ.get('BAGUA_MPI_CUDA_AWARE', '').strip()}"


def nccl_checks(gpus: list[str]) -> list[Check]:
    """Whether torch can run NCCL here, and its version."""
    import torch
    import torch.distributed as dist

    built = dist.is_available() and dist.is_nccl_available()
    if not gpus:
        has = "has" if built else "has no"
        return [ok("NCCL", f"not used without a GPU (this torch {has} NCCL)")]
    if not built:
        return [warn("NCCL", "this torch has no NCCL: only MPI can carry device payloads",
                     "install a CUDA build of torch (it ships NCCL) to use the NCCL backend")]
    version = torch.cuda.nccl.version()
    text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return [ok("NCCL", f"{text} (torch.distributed.is_nccl_available())")]


def local_rank_and_source(topo) -> tuple[int, str]:
    """This rank's index on its node: the running topology's, else the launcher's variable."""
    if topo is not None:
        return topo.local_rank, "topology"
    for variable in LOCAL_RANK_VARIABLES:
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value), variable
    return 0, "single process"


def local_size_and_source(topo) -> tuple[int, str]:
    """Ranks on this node: the running topology's, else the launcher's variable, else 1."""
    if topo is not None:
        return topo.local_size, "topology"
    for variable in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(variable, "").split("(")[0]  # Slurm writes "4(x2)"
        if value.isdigit():
            return int(value), variable
    return 1, "single process"


def gpu_checks(gpus: list[str], topo) -> list[Check]:
    """The GPUs this process sees and the one its local rank maps to (local rank % count).
    Under ``init`` the node's ranks compare the GPUs' ids (``backends.shared_gpus``), so ranks
    that each see only their own GPU are not taken for ranks sharing one; alone, the
    process can only count what it sees."""
    from . import backends
    from .consistency import ranks_text

    local, source = local_rank_and_source(topo)
    local_size, _ = local_size_and_source(topo)
    if not gpus:
        return [ok("GPUs", "none visible (torch.cuda.is_available() is False)"),
                ok("GPU mapping", f"local rank {local} ({source}) -> CPU")]
    names = ", ".join(sorted(set(gpus)))
    checks = [ok("GPUs", f"{len(gpus)} visible: {names}")]
    device = local % len(gpus)
    mapping = f"local rank {local} ({source}) -> cuda:{device} {gpus[device]}"
    shared = backends.shared_gpus() if topo is not None else None
    if shared is not None:
        mine = next((ranks for ranks in shared if local in ranks), None)
        if mine is None:
            checks.append(ok("GPU mapping", f"{mapping}, a GPU no other local rank maps to"))
        else:
            checks.append(warn("GPU mapping", f"{mapping}, which local {ranks_text(mine)} "
                               f"share: NCCL refuses that",
                               "give each rank of a node a GPU of its own (at most one rank "
                               "per GPU), or use BAGUA_MPI_BACKEND=mpi"))
    elif local_size > len(gpus):
        checks.append(warn("GPU mapping", f"{mapping}; {local_size} ranks share {len(gpus)} "
                           "GPU(s), which NCCL refuses",
                           f"launch at most {len(gpus)} rank(s) per node, or use "
                           "BAGUA_MPI_BACKEND=mpi"))
    else:
        checks.append(ok("GPU mapping", mapping))
    return checks


def shm_checks(topo) -> list[Check]:
    """``/dev/shm`` against ``node_shared.usable``'s rule: free >= gradient bytes per rank x
    ranks on the node x headroom."""
    from . import config
    from .node_shared import _SHM_HEADROOM  # the rule's own constant, so the two cannot drift

    try:
        st = os.statvfs("/dev/shm")
    except OSError as exc:
        return [warn("/dev/shm", f"unavailable ({exc}): node-shared buckets cannot be used",
                     "mount a tmpfs on /dev/shm (docker: --shm-size)")]
    free = st.f_bavail * st.f_frsize
    ranks, _ = local_size_and_source(topo)
    if ranks == 1:
        return [ok("/dev/shm", f"{_size(free)} free (node-shared buckets need 2+ ranks per "
                   "node)")]
    fits = free / (ranks * _SHM_HEADROOM)
    text = (f"{_size(free)} free: node-shared buckets fit up to {_size(fits)} of gradients per "
            f"rank at {ranks} ranks per node (rule: free >= bytes x ranks x {_SHM_HEADROOM:g})")
    if fits < DEFAULT_BUCKET_BYTES and config.shared_buckets():
        return [warn("/dev/shm", text + f"; less than one default bucket "
                     f"({_size(DEFAULT_BUCKET_BYTES)})",
                     "enlarge /dev/shm (docker: --shm-size=8g), or set "
                     "BAGUA_MPI_SHARED_BUCKETS=0")]
    return [ok("/dev/shm", text)]


def hdf5_checks() -> list[Check]:
    """Parallel HDF5 or not, and the checkpoint write scheme that follows."""
    import h5py

    from .checkpoint import CheckpointError, scheme

    parallel = bool(h5py.get_config().mpi)
    kind = "parallel (MPI-IO)" if parallel else "serial"
    try:
        chosen = scheme()
    except CheckpointError as exc:
        return [fail("HDF5", f"{kind} h5py: {exc}",
                     "set BAGUA_MPI_CHECKPOINT_SCHEME=auto or token, or install h5py built on "
                     "parallel HDF5")]
    how = {"mpio": "all ranks write one file at once (mpio scheme)",
           "token": "ranks write in turn, passing a token (token scheme)"}[chosen]
    note = "" if parallel else "; parallel h5py would let all ranks write at once"
    return [ok("HDF5", f"{kind} h5py (HDF5 {h5py.version.hdf5_version}): checkpoints: "
               f"{how}{note}")]


def launcher_checks() -> list[Check]:
    """Whether MPI started this process with the job's other processes: under ``torchrun``
    (``WORLD_SIZE`` > 1) MPI sees a job of one rank in each process, and ``init`` refuses it
    (``topology.refuse_lone_process_of_a_larger_job``)."""
    from . import topology
    from .exceptions import MisuseError

    size = MPI.COMM_WORLD.Get_size()
    world_size = os.environ.get("WORLD_SIZE")
    try:
        topology.refuse_lone_process_of_a_larger_job(size)
    except MisuseError:
        return [fail("launcher", f"MPI sees a job of 1 rank, WORLD_SIZE={world_size}: started "
                                 f"by torchrun or another torch.distributed launcher, so "
                                 f"bagua_mpi.init() refuses it",
                     f"launch with mpiexec -n {world_size} or srun --ntasks={world_size} "
                     f"--mpi=pmi2")]
    return [ok("launcher", f"MPI started {size} rank(s)"
               + (f" (WORLD_SIZE={world_size})" if world_size else ""))]


def slurm_checks(topo) -> list[Check]:
    """The Slurm job variables seen, and whether Slurm's ranks agree with MPI's: a FAIL where
    ``init`` would refuse this process (a lone task of a ``srun`` step of several), else a
    WARN for any disagreement (a ``srun`` inside ``mpiexec``, python run from the batch script)."""
    from . import topology

    seen = [f"{v}={os.environ[v]}" for v in SLURM_JOB_VARIABLES if v in os.environ]
    if "SLURM_PROCID" not in os.environ:
        return [ok("Slurm", "not a Slurm task (no SLURM_PROCID)"
                   + (f"; job variables: {' '.join(seen)}" if seen else ""))]
    checks = [ok("Slurm", " ".join(seen) or "SLURM_PROCID only")]
    # Alone (no init), this process is its own node: only rank and size are compared.
    view = topo or SimpleNamespace(local_rank=0, simulated_ranks_per_node=1)
    with warnings.catch_warnings(), _quiet(topology.logger):
        warnings.simplefilter("ignore")  # reported here as a line instead
        problems = topology.check_slurm_agreement(view)
    refusal = _slurm_step_refusal()
    if refusal:
        checks.append(fail("Slurm vs MPI", "; ".join(problems + [refusal]),
                           f"launch with {topology.SRUN_MPI_FIX}"))
    elif problems:
        checks.append(warn("Slurm vs MPI", "; ".join(problems),
                           f"launch with {topology.SRUN_MPI_FIX}, not srun inside mpiexec"))
    else:
        local_compared = topo is not None and topo.simulated_ranks_per_node is None
        checks.append(ok("Slurm vs MPI", "SLURM_PROCID/SLURM_NTASKS"
                         + ("/SLURM_LOCALID" if local_compared else "") + " match MPI"))
    return checks


def _slurm_step_refusal() -> str | None:
    """Why ``bagua_mpi.init()`` would refuse this process as a lone task of a ``srun`` step
    (``topology.refuse_lone_task_of_a_slurm_step``: each task its own 1-rank MPI job), or
    None. The doctor alone never calls ``init``, so the rule is asked here; its FAIL says what
    a WARN would understate: training would not start."""
    from . import topology
    from .exceptions import MisuseError

    try:
        topology.refuse_lone_task_of_a_slurm_step(MPI.COMM_WORLD.Get_size())
    except MisuseError:
        tasks = os.environ["SLURM_STEP_NUM_TASKS"]
        return (f"SLURM_STEP_NUM_TASKS={tasks}: srun started {tasks} tasks, each an MPI job "
                f"of 1 rank, so bagua_mpi.init() refuses it")
    return None


@contextlib.contextmanager
def _quiet(logger):
    """Silence ``logger`` for a moment (its warning becomes a report line instead)."""
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def process_checks(topo) -> list[Check]:
    """Everything one process can tell about itself (``topo``: the running topology or None)."""
    try:
        gpus, checks = visible_gpus(), []
    except Exception as exc:  # noqa: BLE001 - a broken CUDA set-up is a finding
        gpus, checks = [], [fail("GPUs", f"could not list: {type(exc).__name__}: {exc}",
                                 "check the CUDA driver (nvidia-smi) and torch's CUDA build")]
    checks += guarded("versions", version_checks, gpus)
    checks += guarded(NVVM_CHECK, nvvm_checks, gpus)
    checks += guarded("MPI library", mpi_checks)
    checks += guarded("CUDA-aware MPI (used)", cuda_aware_checks, gpus)
    checks += guarded("NCCL", nccl_checks, gpus)
    checks += guarded("GPU mapping", gpu_checks, gpus, topo)
    checks += guarded("/dev/shm", shm_checks, topo)
    checks += guarded("HDF5", hdf5_checks)
    checks += guarded("launcher", launcher_checks)
    checks += guarded("Slurm", slurm_checks, topo)
    return checks


# -- several ranks ---------------------------------------------------------------------------------

def merge_ranks(per_rank: list[list[Check]]) -> list[Check]:
    """One list from every rank's checks: a check alike everywhere once, else one line per
    variant with the ranks that have it (the first ``MAX_VARIANTS``, then a summary)."""
    order = list(dict.fromkeys(c.check for checks in per_rank for c in checks))
    merged = []
    for name in order:
        variants: dict[Check, list[int]] = {}
        for rank, checks in enumerate(per_rank):
            for c in checks:
                if c.check == name:
                    variants.setdefault(c, []).append(rank)
        if len(variants) == 1 and len(next(iter(variants.values()))) == len(per_rank):
            merged.append(next(iter(variants)))
            continue
        merged += _variant_lines(variants)
    merged += _disagreeing_versions(per_rank)
    return merged


def _variant_lines(variants: dict) -> list[Check]:
    from .consistency import ranks_text
    shown = list(variants.items())[:MAX_VARIANTS]
    lines = [Check(c.check, c.status, f"{c.value} [{ranks_text(ranks)}]", c.fix)
             for c, ranks in shown]
    rest = list(variants.items())[MAX_VARIANTS:]
    if rest:
        worst = max((c for c, _ in rest), key=lambda c: _SEVERITY[c.status])
        ranks = sorted(r for _, rs in rest for r in rs)
        lines.append(Check(worst.check, worst.status, f"{len(rest)} more variants, worst: "
                           f"{worst.value} [{ranks_text(ranks)}]", worst.fix))
    return lines


def _disagreeing_versions(per_rank: list[list[Check]]) -> list[Check]:
    """A FAIL when ranks run different versions of bagua_mpi or what it builds on."""
    differing = []
    for name in ("bagua_mpi",) + PACKAGES:
        values = {c.value for checks in per_rank for c in checks if c.check == f"{name} version"}
        if len(values) > 1:
            differing.append(f"{name} ({', '.join(sorted(values))})")
    if not differing:
        return []
    return [fail("versions across ranks", "ranks differ: " + "; ".join(differing),
                 "install the same environment on every node")]


def topology_checks(topo) -> list[Check]:
    """Nodes and ranks per node (collective over ``topo.comm``)."""
    per_rank = topo.comm.allgather((socket.gethostname(), topo.local_size))
    nodes = topo.comm.bcast(topo.cross_size, root=0)  # rank 0 is a leader: one per node
    sizes = sorted({size for _, size in per_rank})
    hosts = sorted({host for host, _ in per_rank})
    if len(hosts) > 4:
        hosts = hosts[:3] + [f"... ({len(hosts)} hosts)"]
    simulated = (f", simulated by BAGUA_MPI_RANKS_PER_NODE={topo.simulated_ranks_per_node}"
                 if topo.simulated_ranks_per_node is not None else "")
    text = (f"{topo.size} ranks on {nodes} node(s){simulated}, "
            f"{'/'.join(map(str, sizes))} rank(s) per node; hosts: {', '.join(hosts)}")
    if len(sizes) > 1:
        return [warn("topology", text + " (uneven)", "launch the same number of ranks on every "
                     "node (e.g. srun --ntasks-per-node); node-shared buckets need it")]
    return [ok("topology", text)]


def shared_buckets_checks(rt) -> list[Check]:
    """``node_shared.usable`` itself (collective) for one default bucket per rank, and why."""
    from . import backends, config, node_shared

    topo = rt.topo
    usable = rt.worker.run(lambda: node_shared.usable(topo, DEFAULT_BUCKET_BYTES),
                           ("doctor: shared buckets?",))
    sizes = set(topo.comm.allgather(topo.local_size))
    name = "node-shared buckets"
    mpi_carries = backends.host_carrier(backends.resolve(None)) == "mpi"  # else gloo
    if usable and mpi_carries:
        return [ok(name, "used for CPU float32/float64 gradient buckets (/dev/shm windows, "
                   "reduced in place)")]
    if not config.shared_buckets():
        return [ok(name, "not used: turned off by BAGUA_MPI_SHARED_BUCKETS=0")]
    if not mpi_carries:
        return [ok(name, "not used: gloo carries host payloads (the buckets are MPI's)")]
    if sizes == {1}:
        return [ok(name, "not used: one rank per node (nothing to share)")]
    if len(sizes) > 1:
        return [warn(name, "not used: nodes hold different numbers of ranks",
                     "launch the same number of ranks on every node")]
    return [warn(name, "not used: /dev/shm is too small for one default bucket per rank, or "
                 "simulated nodes span hosts", "enlarge /dev/shm (docker: --shm-size=8g)")]


def allreduce_checks(rt) -> list[Check]:
    """``bagua_mpi.allreduce_`` against ``comm.Allreduce`` inside the node, across nodes and
    over the world, each where it has more than one rank and differs from the others."""
    from .process_sets import cross_node_process_set, global_process_set, node_local_process_set

    topo = rt.topo
    # Every rank must make the same collective calls: decide from facts all ranks share.
    local_sizes = topo.comm.allgather(topo.local_size)
    nodes = topo.comm.bcast(topo.cross_size, root=0)  # rank 0 is a leader: one per node
    crowded = max(local_sizes) > 1
    checks = []
    if local_sizes[0] > 1:  # rank 0 reports its own node (every node measures its own)
        # A set of all ranks is measured as the global set, the one users pass (and the only
        # one with the fast path); other sets are registered collectively, by every rank.
        ps = global_process_set if nodes == 1 else node_local_process_set()
        checks += _measure("node", ps, topo.intra, topo.local_size > 1)
    if nodes > 1:
        # the leaders' set on local rank 0, the other local ranks' sets idle meanwhile
        ps = cross_node_process_set() if crowded else global_process_set
        checks += _measure("across nodes", ps, topo.inter, topo.leaders is not None)
    if crowded and nodes > 1:
        checks += _measure("world", global_process_set, topo.comm, True)
    topo.comm.Barrier()  # non-leaders wait here while the leaders measure
    return checks


def _measure(where: str, process_set, comm, taking_part: bool) -> list[Check]:
    """Latency (8 bytes) and bandwidth (16 MiB) of both allreduces on ``comm``; the numbers of
    this rank (rank 0 reports its own)."""
    if not taking_part:
        return []
    label = f"{where}, {comm.Get_size()} ranks"
    small = _timed_pair(process_set, comm, LATENCY_BYTES, rounds=20, per_round=25)
    large = _timed_pair(process_set, comm, BANDWIDTH_BYTES, rounds=6, per_round=1)
    return [_latency_check(label, *small), _bandwidth_check(label, *large)]


def _timed_pair(process_set, comm, nbytes: int, rounds: int, per_round: int):
    """Median seconds per op of ``bagua_mpi.allreduce_`` (Sum) and of ``comm.Allreduce`` on the
    same bytes, rounds interleaved (alternating which goes first) so drift hits both alike."""
    import numpy as np
    import torch

    from .collectives import allreduce_
    from .ops import Sum

    # Separate buffers of the same kind of memory (NumPy's; large ones get huge pages), so
    # the ratio is the library's overhead, not the allocator's. Zeros: repeated sums stay finite.
    array = np.zeros(nbytes // 4, dtype=np.float32)
    tensor = torch.from_numpy(np.zeros(nbytes // 4, dtype=np.float32))

    def ours():
        allreduce_(tensor, op=Sum, process_set=process_set)

    def raw():
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)

    ours(), raw()  # warm-up: first calls set up connections and caches
    times = {ours: [], raw: []}
    for i in range(rounds):
        for op in ((ours, raw) if i % 2 == 0 else (raw, ours)):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(per_round):
                op()
            times[op].append((time.perf_counter() - start) / per_round)
    return statistics.median(times[ours]), statistics.median(times[raw])


def _latency_check(label: str, ours: float, raw: float) -> Check:
    from . import config

    name = f"allreduce latency ({label})"
    text = (f"{LATENCY_BYTES} B: bagua_mpi {ours * 1e6:.1f} us, MPI {raw * 1e6:.1f} us "
            f"(x{ours / raw:.2f})")
    if config.consistency_check():  # one more small allreduce per call: about doubles it
        text += "; bagua_mpi's includes the agreement check (BAGUA_MPI_CHECK)"
    if ours > LATENCY_WARN_RATIO * raw:
        return warn(name, text, OVERSUBSCRIBED_FIX)
    return ok(name, text)


def _bandwidth_check(label: str, ours: float, raw: float) -> Check:
    name = f"allreduce bandwidth ({label})"
    gbps = BANDWIDTH_BYTES / 1e9
    text = (f"{_size(BANDWIDTH_BYTES)}: bagua_mpi {ours * 1e3:.1f} ms ({gbps / ours:.2f} GB/s), "
            f"MPI {raw * 1e3:.1f} ms ({gbps / raw:.2f} GB/s) (x{ours / raw:.2f})")
    if ours > BANDWIDTH_WARN_RATIO * raw:
        return warn(name, text, OVERSUBSCRIBED_FIX)
    return ok(name, text)


# -- the run: init, gather, agree on the exit status -----------------------------------------------

def init_if_possible(world, pre: list[Check]):
    """``bagua_mpi.init()`` on every rank when no rank's settings or backend FAILed (agreed
    over ``world`` first: ``init`` is collective); the runtime, or None and why not."""
    from . import runtime

    if world.Get_size() == 1:
        return None, []
    fine = not any(c.status == FAIL for c in pre)
    if not world.allreduce(fine, op=MPI.LAND):
        return None, [warn("bagua_mpi.init", "not attempted: some rank's settings or backend "
                           "FAILed, so topology and allreduce were not checked",
                           "fix the FAIL lines and run the doctor again")]
    runtime.init()
    return runtime.get(), []


def collect(world) -> list[Check]:
    """Every rank runs the checks; rank 0 gets the merged list (others get their own)."""
    settings = guarded("settings", settings_checks)
    backend = guarded("backend", backend_checks)
    rt, skipped = init_if_possible(world, settings + backend)
    topo = rt.topo if rt is not None else None
    if rt is not None:  # asked again: ``auto`` counts the ranks per node from the topology
        backend = guarded("backend", backend_checks)
    mine = settings + process_checks(topo) + backend
    if world.Get_size() == 1:
        return mine
    gathered = world.gather(mine, root=0)
    checks = merge_ranks(gathered) if world.Get_rank() == 0 else mine
    checks += skipped
    if rt is not None:
        # Collective, so not guarded: a rank that skipped ahead after an error would leave the
        # others waiting; an error here aborts the job instead (BAGUA_MPI_ABORT_ON_EXCEPTION).
        checks += topology_checks(topo)
        checks += shared_buckets_checks(rt)
        checks += allreduce_checks(rt)
    return checks


def render_text(checks: list[Check]) -> str:
    width = max(len(c.check) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<5} {c.check:<{width}}  {c.value}")
        if c.fix:
            lines.append(f"{'':<5} {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def render_json(checks: list[Check]) -> str:
    return json.dumps([asdict(c) for c in checks], indent=2)


def run(as_json: bool = False) -> int:
    """Run the doctor on every rank of ``MPI.COMM_WORLD``; rank 0 prints. Returns the exit
    status, the same on every rank: 1 when any rank found a FAIL, else 0."""
    from . import runtime

    world = MPI.COMM_WORLD
    checks = collect(world)
    if world.Get_rank() == 0:
        print(render_json(checks) if as_json else render_text(checks), flush=True)
    failed = any(c.status == FAIL for c in checks)
    if world.Get_size() > 1:
        failed = world.allreduce(failed, op=MPI.LOR)
    # A clean, collective shutdown first: a non-zero exit of a live runtime would abort the job.
    runtime.shutdown()
    return 1 if failed else 0


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"
