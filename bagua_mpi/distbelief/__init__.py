"""DistBelief on MPI ranks: model parallelism (§3), Downpour SGD, Sandblaster L-BFGS (§4.1-4.2).

Inside one ordinary ``mpiexec``/``srun`` job, some ranks hold parameter-server shards (each a
slice of the flattened parameter vector), the others train model replicas; Sandblaster adds a
coordinator rank. ``setup`` picks the roles and duplicates the library's communicator, so
parameter-server messages can never match bagua_mpi's collectives (or the user's messages).

Quick start (every rank runs the same script)::

    import bagua_mpi as bm
    from bagua_mpi import distbelief as db

    bm.init()
    roles = db.setup(n_servers=2)                       # the last 2 ranks are shards
    layout = db.ShardLayout(w0.size, roles.n_servers, dtype=np.float32)
    report = db.run_downpour(roles, layout, step_fn, num_steps=500, init=w0,
                             optimizer=db.Adagrad(lr=0.05), n_fetch=4, n_push=4,
                             warm_start_steps=50)
    roles.close()

Model parallelism: ``setup(n_servers=S, n_partitions=M)`` groups the workers into replicas of M
partitions; ``PipelineModel`` (cut by layers) or ``BlockModel`` (cut within locally connected or
fully connected layers) runs one replica over its group, and every partition is a Downpour or
Sandblaster worker for its own parameter range (see ``model_parallel`` and
``examples/model_parallel_downpour.py``).

Layout: two subpackages over two shared modules, every public name re-exported here.

* ``parameter_server/``: roles and shards, the wire protocol and session handshake, the shard
  server, Downpour, Sandblaster (coordinator, portion scheduler, L-BFGS);
* ``model_parallel/``: partitions, the link between them, cuttable layers, partitioned models;
* ``errors`` (``DistBeliefError``, ``PartitionError``) and ``polling`` (waiting without
  spinning), which both use. ``model_parallel`` never imports ``parameter_server`` and the
  reverse holds too: they meet only in user code (a partition is a worker).

Communication design: two-sided, nonblocking point-to-point (``MPI_Issend`` + ``MPI_Improbe`` /
matched receive from ``MPI_ANY_SOURCE``), not one-sided RMA. Reasons:

* An Adagrad update is a read-modify-write of two arrays with a square root and a division;
  ``MPI_Accumulate`` offers only elementwise reductions (sum, max, ...), so with RMA a worker
  would have to lock a shard's window, read, compute and write back -- serializing workers on
  exclusive locks, the very coupling Downpour exists to avoid.
* Each push is an *event* the shard must see: it counts updates, measures staleness (updates
  since that worker's fetch), notices goodbyes and silent workers, and releases waiting workers
  after the warm start. With RMA the target is passive and sees none of this.
* Sandblaster needs the shards to *execute* operations (dot, axpy, ...) on request; that is a
  message protocol anyway.
* Passive-target RMA progress in MPICH depends on the target entering MPI; a polling server
  loop gives the same progress guarantee with simpler code, and works with any MPI.

How the servers know workers are done: every worker ends with a ``BYE`` (finished, told to stop,
or its step function raised -- the exception is caught and becomes the goodbye); a shard may also
declare a worker *lost* after ``worker_timeout_s`` of silence. A shard's loop ends when every
worker that uses it has left; then all ranks meet in a closing nonblocking barrier, answering
late messages (a lost worker that wakes up gets ``STOP``) until everyone is there.

What survives, and what does not (an MPI job starts and ends as a whole):

* survives: a slow worker (the others never wait for it); a worker that stops early (returns
  from its loop) or whose step/portion function raises (caught, turned into a goodbye); a worker
  that goes silent, if the shards were given ``worker_timeout_s`` (Downpour) or, for Sandblaster,
  always (its portions are re-run as backup tasks). Its process must still reach the closing
  barrier eventually -- it stays in the job until the end.
* does not survive: a process that dies (signal, ``os._exit``, segfault) -- ``mpiexec``/``srun``
  then kill the whole job; a process that exits normally before the closing barrier, or that
  hangs forever -- the others wait for it in the barrier until the launcher's time limit; a
  failing shard or coordinator (there is no replication of the parameter state: restart from
  the last checkpoint, ``ShardServer.state_dict``/``SandblasterCoordinator.state_dict``).
"""
from .errors import DistBeliefError, PartitionError
from .model_parallel import (BlockModel, LinearBlocks, Link, LocallyConnected2d, PipelineModel,
                             exchange_plan, split_units)
from .parameter_server import (SGD, Adagrad, Departure, DownpourShardServer, DownpourWorker,
                               History, LBFGSResult, PortionScheduler, Program, Roles,
                               SandblasterCoordinator, SandblasterShardServer, SandblasterWorker,
                               SandblasterWorkerReport, SchedulerStats, ServerReport,
                               ShardLayout, ShardServer, SlotStore, WolfeSearch, WorkerReport,
                               check_replicas, flat_parameters, load_flat, model_step_fn,
                               run_downpour, run_sandblaster, setup, two_loop_coefficients)

__all__ = [
    "Adagrad", "BlockModel", "Departure", "DistBeliefError", "DownpourShardServer",
    "DownpourWorker", "History", "LBFGSResult", "LinearBlocks", "Link", "LocallyConnected2d",
    "PartitionError", "PipelineModel", "PortionScheduler", "Program", "Roles", "SGD",
    "SandblasterCoordinator", "SandblasterShardServer", "SandblasterWorker",
    "SandblasterWorkerReport", "SchedulerStats", "ServerReport", "ShardLayout", "ShardServer",
    "SlotStore", "WolfeSearch", "WorkerReport", "flat_parameters", "check_replicas",
    "exchange_plan", "load_flat", "model_step_fn", "run_downpour", "run_sandblaster", "setup",
    "split_units", "two_loop_coefficients",
]
