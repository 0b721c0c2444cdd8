"""Process topology: the library's private communicators and who sits where.

``init()`` duplicates ``MPI.COMM_WORLD`` (or the communicator the user passes) so library
traffic can never match a user's message, then splits it three ways:

* ``intra``  -- the ranks that share a node (``Split_type(COMM_TYPE_SHARED)``); rank = local_rank;
* ``inter``  -- the ranks with the same local_rank on every node (``Split(color=local_rank)``);
* ``leaders`` -- the ``inter`` communicator of the local_rank-0 ranks (``None`` elsewhere); the
  hierarchical primitives reduce inside each node, combine among leaders, then broadcast.

For tests, ``BAGUA_MPI_RANKS_PER_NODE=k`` (or ``init(ranks_per_node=k)``) makes consecutive
blocks of k ranks look like separate nodes, so the two-level code paths run on one machine.
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

from mpi4py import MPI

from . import config
from .exceptions import MisuseError, NotInitializedError

logger = logging.getLogger(__name__)

_THREAD_LEVEL_NAMES = {
    MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
    MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
    MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
    MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
}


@dataclass(frozen=True)
class Topology:
    """The communicators of one ``init()`` and this rank's place in them."""

    comm: MPI.Intracomm  # private duplicate: all library collectives run here
    intra: MPI.Intracomm  # ranks on this (possibly simulated) node
    inter: MPI.Intracomm  # ranks with my local_rank, one per node
    leaders: MPI.Intracomm | None  # ``inter`` when local_rank == 0, else None
    thread_level: int  # what MPI granted (we ask for MPI_THREAD_MULTIPLE)
    simulated_ranks_per_node: int | None  # the testing override, when active

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def local_rank(self) -> int:
        return self.intra.Get_rank()

    @property
    def local_size(self) -> int:
        return self.intra.Get_size()

    @property
    def cross_rank(self) -> int:
        return self.inter.Get_rank()

    @property
    def cross_size(self) -> int:
        return self.inter.Get_size()

    def node_reduce_(self, buf, op=MPI.SUM) -> None:
        """Reduce ``buf`` (an MPI buffer) onto this node's leader, in place there."""
        if self.intra.Get_size() == 1:
            return
        if self.intra.Get_rank() == 0:
            self.intra.Reduce(MPI.IN_PLACE, buf, op=op, root=0)
        else:
            self.intra.Reduce(buf, None, op=op, root=0)

    def node_broadcast_(self, buf) -> None:
        """Copy the node leader's ``buf`` to every rank of the node."""
        if self.intra.Get_size() > 1:
            self.intra.Bcast(buf, root=0)

    def node_leaders(self) -> list[int]:
        """Each rank's node, as the rank of that node's leader (local rank 0), in rank order:
        the same list on every rank; collective."""
        return self.comm.allgather(self.intra.bcast(self.rank, root=0))

    def free(self) -> None:
        for c in (self.inter, self.intra, self.comm):
            if c != MPI.COMM_NULL:
                c.Free()


def build(comm: MPI.Intracomm | None = None, ranks_per_node: int | None = None) -> Topology:
    """Duplicate ``comm`` (default ``COMM_WORLD``) and split it into node groups."""
    if comm is None:
        refuse_lone_process_of_a_larger_job(MPI.COMM_WORLD.Get_size())
        refuse_lone_task_of_a_slurm_step(MPI.COMM_WORLD.Get_size())
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"init(comm=...) needs an mpi4py intracommunicator, got {comm!r}")
    if ranks_per_node is None:
        ranks_per_node = config.ranks_per_node()
    elif ranks_per_node <= 0:
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")

    private = comm.Dup()
    rank = private.Get_rank()
    if ranks_per_node is not None:
        intra = private.Split(color=rank // ranks_per_node, key=rank)
    else:
        intra = private.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    inter = private.Split(color=intra.Get_rank(), key=rank)
    leaders = inter if intra.Get_rank() == 0 else None
    topo = Topology(private, intra, inter, leaders, MPI.Query_thread(), ranks_per_node)
    if topo.thread_level != MPI.THREAD_MULTIPLE:
        logger.warning(
            "bagua_mpi: MPI granted %s, not MPI_THREAD_MULTIPLE; asynchronous operations will "
            "still work but only one thread may use MPI at a time",
            _THREAD_LEVEL_NAMES.get(topo.thread_level, topo.thread_level),
        )
    if comm == MPI.COMM_WORLD or comm.Get_size() == MPI.COMM_WORLD.Get_size():
        check_slurm_agreement(topo)
    return topo


def refuse_lone_process_of_a_larger_job(world_size: int, environ: dict | None = None) -> None:
    """Raise ``MisuseError`` when MPI sees a job of one rank while ``WORLD_SIZE`` (set by
    ``torchrun`` and other launchers of torch.distributed jobs) says the job has more
    processes: each process would be a world of its own and train alone, with no error. An
    explicit ``init(comm=MPI.COMM_SELF)`` is a choice, and is not checked."""
    env = os.environ if environ is None else environ
    raw = env.get("WORLD_SIZE", "")
    if world_size != 1 or not raw.isdigit() or int(raw) <= 1:
        return
    raise MisuseError(
        f"bagua_mpi.init(): MPI sees a job of 1 rank, but WORLD_SIZE={raw} (torchrun or another "
        f"torch.distributed launcher sets it; RANK={env.get('RANK', '?')}) says the job has "
        f"{raw} processes. bagua_mpi takes its ranks from MPI, so each process would train "
        f"alone. Launch with mpiexec -n {raw} python ... or srun --ntasks={raw} --mpi=pmi2 "
        f"python ...; to run this process alone on purpose, call init(comm=MPI.COMM_SELF)")


# What to launch with under Slurm: pmi2 is what the PyPI MPICH wheel (the ``mpich`` extra) and
# most MPIs speak; that wheel aborts in MPI_Init under pmix ("unsupported PMI version PMIx").
SRUN_MPI_FIX = ("srun --mpi=pmi2 (--mpi=pmix only where the MPI was built with PMIx, "
                "e.g. Open MPI)")


def refuse_lone_task_of_a_slurm_step(world_size: int, environ: dict | None = None) -> None:
    """Raise ``MisuseError`` when MPI sees a job of one rank inside a ``srun`` step of several
    tasks (``SLURM_STEP_NUM_TASKS`` > 1): ``srun`` without a working ``--mpi`` plugin (Slurm's
    default ``MpiDefault=none``) starts every task as an MPI job of its own, and each would
    train alone, with no error. ``SLURM_STEP_NUM_TASKS`` is set only inside ``srun`` steps, so
    Python started straight from a batch script (``SLURM_NTASKS`` > 1 there) is not refused;
    nor is an explicit ``init(comm=MPI.COMM_SELF)``, which is a choice."""
    env = os.environ if environ is None else environ
    raw = env.get("SLURM_STEP_NUM_TASKS", "")
    if world_size != 1 or not raw.isdigit() or int(raw) <= 1:
        return
    task = env.get("SLURM_PROCID", "?")
    raise MisuseError(
        f"bagua_mpi.init() on Slurm task SLURM_PROCID={task}: MPI sees a job of 1 rank, but "
        f"SLURM_STEP_NUM_TASKS={raw} says srun started {raw} tasks. srun without a working "
        f"--mpi plugin (Slurm's default is none) makes each task an MPI job of its own, so "
        f"each would train alone. Launch with {SRUN_MPI_FIX}, e.g. srun --mpi=pmi2 "
        f"--ntasks={raw} python ...; to run this process alone on purpose, call "
        f"init(comm=MPI.COMM_SELF)")


def check_slurm_agreement(topo: Topology, environ: dict | None = None) -> list[str]:
    """Cross-check Slurm's view of this task with MPI's; warn and return the disagreements.

    Ranks always come from MPI (``srun --mpi=pmi2`` hands them over); the ``SLURM_*`` variables
    are only compared, because a disagreement usually means a wrong ``--mpi`` plugin (every task
    became its own singleton job) or a ``srun`` nested inside ``mpiexec``.
    """
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env:
        return []
    problems = []
    checks = [("SLURM_PROCID", MPI.COMM_WORLD.Get_rank(), "world rank"),
              ("SLURM_NTASKS", MPI.COMM_WORLD.Get_size(), "world size")]
    if topo.simulated_ranks_per_node is None:
        checks.append(("SLURM_LOCALID", topo.local_rank, "local rank"))
    for var, mpi_value, what in checks:
        raw = env.get(var)
        if raw is None:
            continue
        try:
            slurm_value = int(raw)
        except ValueError:
            problems.append(f"{var}={raw!r} is not an integer")
            continue
        if slurm_value != mpi_value:
            problems.append(f"{var}={slurm_value} but MPI {what} is {mpi_value}")
    if problems:
        msg = ("bagua_mpi: Slurm and MPI disagree on rank %d (%s); is the srun --mpi plugin "
               "right (try --mpi=pmi2)?" % (MPI.COMM_WORLD.Get_rank(), "; ".join(problems)))
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return problems


_topology: Topology | None = None


def current() -> Topology:
    """The active topology; raises ``NotInitializedError`` before ``init()``."""
    if _topology is None:
        raise NotInitializedError("bagua_mpi is not initialized: call bagua_mpi.init() first")
    return _topology


def set_current(topo: Topology | None) -> None:
    global _topology
    _topology = topo


def thread_level_name(level: int) -> str:
    return _THREAD_LEVEL_NAMES.get(level, str(level))
