"""Parameter servers on MPI ranks: Downpour SGD and Sandblaster L-BFGS (paper §4.1-4.2).

Modules, from the wire up:

* ``roles``: who does what in the job (``setup``, ``Roles``) and how the flat parameter vector
  is cut into shards (``ShardLayout``);
* ``protocol``: the wire format (message kinds, tags, ``Endpoint``) and the session handshake
  every rank goes through before the first message (``open_session``);
* ``optimizers``: the update rules a Downpour shard applies (``SGD``, ``Adagrad``);
* ``vector_ops``: the instruction set Sandblaster's coordinator runs on the shards;
* ``shard_server``: a shard (``ShardServer`` and its Downpour and Sandblaster kinds);
* ``downpour``: the Downpour worker and ``run_downpour``;
* ``scheduler``, ``lbfgs``: Sandblaster's portion scheduling and vector-free L-BFGS arithmetic;
* ``sandblaster``: the Sandblaster coordinator and worker and ``run_sandblaster``;
* ``torch_model``: a torch model as the flat vector the shards hold (``model_step_fn``).
"""
from .downpour import DownpourWorker, WorkerReport, run_downpour
from .lbfgs import History, WolfeSearch, two_loop_coefficients
from .optimizers import SGD, Adagrad
from .protocol import Departure
from .roles import Roles, ShardLayout, check_replicas, setup
from .sandblaster import (LBFGSResult, SandblasterCoordinator, SandblasterWorker,
                          SandblasterWorkerReport, run_sandblaster)
from .scheduler import PortionScheduler, SchedulerStats
from .shard_server import DownpourShardServer, SandblasterShardServer, ServerReport, ShardServer
from .torch_model import flat_parameters, load_flat, model_step_fn
from .vector_ops import Program, SlotStore

__all__ = [
    "Adagrad", "Departure", "DownpourShardServer", "DownpourWorker", "History", "LBFGSResult",
    "PortionScheduler", "Program", "Roles", "SGD", "SandblasterCoordinator",
    "SandblasterShardServer", "SandblasterWorker", "SandblasterWorkerReport", "SchedulerStats",
    "ServerReport", "ShardLayout", "ShardServer", "SlotStore", "WolfeSearch", "WorkerReport",
    "check_replicas", "flat_parameters", "load_flat", "model_step_fn", "run_downpour",
    "run_sandblaster", "setup", "two_loop_coefficients",
]
