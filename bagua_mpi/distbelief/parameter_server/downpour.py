"""Downpour SGD, the worker side (paper §4.1).

A worker (model replica) keeps a local copy of the parameters and, on its own data:

1. fetches fresh parameters from the shards every ``n_fetch`` steps (and before its first step);
2. computes a gradient at its local copy and adds it to an accumulator;
3. every ``n_push`` steps sends the accumulated gradient to the shards (each shard gets only its
   slice) and clears it; the shards apply it at once, with no barrier among workers or shards.

Warm start: with ``warm_start_steps = K > 0`` worker 0 trains alone for K steps; the shards
release the other workers when it reports the K steps done (or leaves, or is lost).

Partitioned replicas (``setup(n_partitions=M)``, ``model_parallel``): every partition is a
``DownpourWorker`` with ``param_range`` = its own parameters, so it fetches and pushes only
those, only to the shards that hold them, on its own ``n_fetch``/``n_push`` schedule; its step
function runs the replica's forward/backward together with the other partitions. Replica 0 is
the warm-start replica; each of its partitions sends its own initial values to the shards.
Because a partition's step function waits for its neighbours, a failure in one partition cannot
be survived by the others: in a partitioned replica the exception is re-raised (and ends the
MPI job) instead of becoming a goodbye.

Leaving: ``finish()`` (called by ``run`` whatever happens) pushes what is left, says goodbye to
the shards and joins the closing barrier. An exception from the step function inside ``run`` is
logged and turned into that goodbye (reason ``ERROR``), so the others keep training; the process
itself stays in the job until the closing barrier, as every MPI process must.

Example (every rank runs this; see ``examples/downpour_sgd.py``)::

    roles = distbelief.setup(n_servers=1)
    layout = distbelief.ShardLayout(w0.size, roles.n_servers, dtype=np.float64)
    report = distbelief.run_downpour(roles, layout, step_fn, num_steps=200, init=w0,
                                     optimizer=distbelief.Adagrad(lr=0.1), n_fetch=2, n_push=2)
"""
from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import DistBeliefError
from ..polling import POLL_MAX_S
from .optimizers import SGD, Adagrad
from .protocol import (DOWNPOUR, TAG_REPLY, TAG_REQUEST, Departure, Endpoint, Message, Op, pack,
                       open_session)
from .roles import Roles, ShardLayout
from .shard_server import DownpourShardServer, ServerReport

logger = logging.getLogger(__name__)

StepFn = Callable[[np.ndarray, int], "tuple[float, np.ndarray]"]


@dataclass
class WorkerReport:
    """What one Downpour worker did (returned by ``finish``/``run``)."""

    rank: int
    steps: int  # gradients computed
    pushes: int
    fetches: int
    stopped_by_server: bool  # a shard told it to stop (it had been declared lost)
    error: str | None  # the step function's exception, formatted, if it raised
    losses: list[float] = field(default_factory=list)  # as returned by the step function
    warm_wait_s: float = 0.0  # time spent waiting for the warm-start release


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class DownpourWorker:
    """One model replica. Collective constructor (with the shards and the other workers).

    Args:
        roles, layout: from ``setup`` and ``ShardLayout`` (same layout on every rank).
        init: the initial parameter vector; required on worker 0, which sends it to the shards
            (partitioned replicas: on every partition of replica 0, the whole vector or just
            its ``param_range`` slice).
        n_fetch, n_push: fetch every ``n_fetch`` steps, push every ``n_push`` steps.
        warm_start_steps: worker 0's solo steps (all workers must pass the same value).
        param_range: ``(lo, hi)`` if this replica uses only ``params[lo:hi]``; it then talks
            only to the shards holding that range and only its part of a gradient is pushed.
    """

    def __init__(self, roles: Roles, layout: ShardLayout, *, init: np.ndarray | None = None,
                 n_fetch: int = 1, n_push: int = 1, warm_start_steps: int = 0,
                 param_range=None, poll_max_s: float = POLL_MAX_S):
        if not roles.is_worker:
            raise ValueError(f"rank {roles.rank} is a {roles.role}, not a worker")
        if roles.coordinator is not None:
            raise ValueError("Downpour runs without a coordinator: use setup(coordinator=False)")
        self.n_fetch = _check_count("n_fetch", n_fetch)
        self.n_push = _check_count("n_push", n_push)
        if isinstance(warm_start_steps, bool) or not isinstance(warm_start_steps, int) \
                or warm_start_steps < 0:
            raise ValueError(f"warm_start_steps must be an integer >= 0, got {warm_start_steps!r}")
        self.roles, self.layout = roles, layout
        self.lo, self.hi = layout.check_range(param_range)
        self.index = roles.worker_index
        self.replica = roles.replica_index
        self.partitioned = roles.n_partitions > 1
        if self.replica == 0 and init is None:
            raise ValueError(f"worker rank {roles.rank} (replica 0) must pass init=: it sends the "
                             f"initial parameters to the shards")
        self.params = np.zeros(layout.numel, dtype=layout.dtype)
        if init is not None:
            init = np.asarray(init)
            if init.shape == (layout.numel,):
                self.params[:] = init
            elif self.partitioned and init.shape == (self.hi - self.lo,):
                self.params[self.lo:self.hi] = init
            else:
                raise ValueError(f"init must have shape ({layout.numel},)"
                                 f"{f' or ({self.hi - self.lo},)' if self.partitioned else ''}, "
                                 f"got {init.shape}")
        self.session = open_session(roles, layout, DOWNPOUR, param_range=(self.lo, self.hi),
                                    warm_start_steps=warm_start_steps)
        self.warm_start_steps = warm_start_steps
        self.endpoint = Endpoint(roles.comm, poll_max_s)
        # shard -> (server rank, global [a, b) of our part of it)
        self.parts = {k: (roles.servers[k], layout.overlap(k, self.lo, self.hi))
                      for k in layout.shards_overlapping(self.lo, self.hi)}
        if roles.rank in self.session.init_ranges:
            sends = []
            for k, server in enumerate(roles.servers):
                for sender, (a, b) in self.session.init_senders(layout, k):
                    if sender == roles.rank:
                        sends.append(self.endpoint.send(
                            server, pack(Op.PARAMS, payload=self.params[a:b])))
            self.endpoint.wait(sends)
        self._acc = np.zeros(layout.numel, dtype=layout.dtype)
        self._acc_steps = 0  # steps accumulated since the last push
        self.steps = self.pushes = self.fetches = 0
        self.stopped = False
        self._started = self._finished = False
        self._warm_reported = warm_start_steps == 0 or self.replica != 0
        self.warm_wait_s = 0.0

    # -- the protocol --------------------------------------------------------------------------
    def start(self) -> "DownpourWorker":
        """Wait for the warm-start release if there is one, then fetch the parameters."""
        if self._started:
            return self
        self._started = True
        if self.warm_start_steps > 0 and self.replica != 0:
            t0 = time.perf_counter()
            waiting = {r for r, _ in self.parts.values()}
            while waiting:
                m = self.endpoint.recv(tag=TAG_REQUEST)
                if m.op in (Op.RELEASE, Op.STOP) and m.source in waiting:
                    waiting.discard(m.source)
                    self.stopped |= m.op == Op.STOP
                else:
                    raise DistBeliefError(f"worker rank {self.roles.rank}: {m.op.name} from rank "
                                          f"{m.source} while waiting for the warm-start release")
            self.warm_wait_s = time.perf_counter() - t0
        self.fetch()
        return self

    def fetch(self) -> None:
        """Replace the local copy of our parameters with the shards' current values."""
        if self.stopped:
            return
        for server, _ in self.parts.values():
            self.endpoint.send(server, pack(Op.FETCH))
        for server, (a, b) in self.parts.values():
            m = self.endpoint.recv(source=server, tag=TAG_REPLY)
            if m.op == Op.PARAMS:
                self.params[a:b] = m.data(self.layout.dtype)
            elif m.op == Op.STOP:
                self.stopped = True
            else:
                raise DistBeliefError(f"worker rank {self.roles.rank}: {m.op.name} in reply to "
                                      f"a fetch from rank {server}")
        self.endpoint.progress()
        self.fetches += 1

    def push(self) -> None:
        """Send the accumulated gradient (each shard its part) and clear the accumulator.

        Returns once every shard has received it (synchronous-mode sends), so a slow worker
        never leaves a half-sent message that a shard would have to wait for.
        """
        if self.stopped:
            return
        sends = [self.endpoint.send(server, pack(Op.PUSH, payload=self._acc[a:b]))
                 for server, (a, b) in self.parts.values()]
        self.endpoint.wait(sends)
        self._acc[:] = 0
        self._acc_steps = 0
        self.pushes += 1

    def step(self, grad: np.ndarray) -> bool:
        """Add one step's gradient; push and fetch when due. False once told to stop."""
        if not self._started:
            self.start()
        grad = np.asarray(grad)
        if grad.shape == (self.layout.numel,):
            grad = grad[self.lo:self.hi]
        elif grad.shape != (self.hi - self.lo,):
            raise ValueError(f"gradient must have shape ({self.layout.numel},) or, for this "
                             f"worker's param_range, ({self.hi - self.lo},); got {grad.shape}")
        self._acc[self.lo:self.hi] += grad
        self._acc_steps += 1
        self.steps += 1
        self._check_stop()
        if self.steps % self.n_push == 0:
            self.push()
        if not self._warm_reported and self.steps >= self.warm_start_steps:
            if self._acc_steps:
                self.push()  # the warm start ends with everything applied
            self._report_warm_done()
        if self.steps % self.n_fetch == 0:
            self.fetch()
        return not self.stopped

    def _report_warm_done(self) -> None:
        self._warm_reported = True
        self.endpoint.wait([self.endpoint.send(server, pack(Op.WARM_DONE))
                            for server, _ in self.parts.values()])

    def _check_stop(self) -> None:
        """A shard that declared us lost has left a STOP for us."""
        while True:
            m = self.endpoint.try_recv(tag=TAG_REQUEST)
            if m is None:
                return
            if m.op != Op.STOP:
                raise DistBeliefError(f"worker rank {self.roles.rank}: unexpected {m.op.name} "
                                      f"from rank {m.source}")
            self.stopped = True

    def finish(self, error: BaseException | None = None, flush: bool = True) -> WorkerReport:
        """Push what is left (unless ``error``), say goodbye, join the closing barrier."""
        if self._finished:
            raise DistBeliefError(f"worker rank {self.roles.rank}: finish() called twice")
        self._finished = True
        if not self._started and error is None:
            self.start()
        if flush and error is None and self._acc_steps and not self.stopped:
            self.push()
        reason = (Departure.ERROR if error is not None
                  else Departure.STOPPED if self.stopped else Departure.DONE)
        self.endpoint.wait([self.endpoint.send(server, pack(Op.BYE, int(reason)))
                            for server, _ in self.parts.values()])
        self.endpoint.drain(self._on_late)
        text = None
        if error is not None:
            text = "".join(traceback.format_exception_only(type(error), error)).strip()
        return WorkerReport(self.roles.rank, self.steps, self.pushes, self.fetches,
                            self.stopped, text, warm_wait_s=self.warm_wait_s)

    def _on_late(self, m: Message) -> None:
        if m.op not in (Op.STOP, Op.RELEASE):
            raise DistBeliefError(f"worker rank {self.roles.rank}: unexpected {m.op.name} from "
                                  f"rank {m.source} while closing")

    def run(self, step_fn: StepFn, num_steps: int, first_step: int = 0) -> WorkerReport:
        """Train for ``num_steps`` steps (fewer if told to stop), then ``finish``.

        ``step_fn(params, step) -> (loss, grad)`` gets a read-only view of the local copy and
        the global step number (``first_step + i``); it returns the loss (a number, reported)
        and the gradient (a vector like ``params``). If it raises, the exception is logged and
        becomes this worker's goodbye; ``run`` returns normally with ``report.error`` set.
        """
        self.start()
        view = self.params.view()
        view.flags.writeable = False
        losses = []
        error = None
        for i in range(num_steps):
            if self.stopped:
                break
            try:
                loss, grad = step_fn(view, first_step + i)
            except Exception as exc:  # noqa: BLE001 - a replica's failure is not the job's
                if self.partitioned:
                    raise  # the other partitions wait for this one: only the job can end it
                logger.exception("Downpour worker rank %d: step function raised at step %d; "
                                 "leaving the training, the others continue",
                                 self.roles.rank, first_step + i)
                error = exc
                break
            losses.append(float(loss))
            self.step(grad)
        report = self.finish(error)
        report.losses = losses
        return report


def run_downpour(roles: Roles, layout: ShardLayout, step_fn: StepFn, num_steps: int, *,
                 init: np.ndarray | None = None, optimizer: SGD | Adagrad | None = None,
                 n_fetch: int = 1, n_push: int = 1, warm_start_steps: int = 0,
                 worker_timeout_s: float | None = None, param_range=None,
                 server_state: dict | None = None) -> ServerReport | WorkerReport:
    """Every rank calls this with the same arguments; servers serve, workers train.

    Returns the server's ``ServerReport`` on servers and the ``WorkerReport`` on workers.
    Partitioned replicas: each partition passes its own ``param_range`` and ``step_fn``
    (``PipelineModel.step_fn``/``BlockModel.step_fn``); ``n_fetch``/``n_push`` may differ
    between partitions.
    ``optimizer`` defaults to ``Adagrad(lr=0.01)``. ``server_state``: a dict from
    ``ShardServer.state_dict`` to resume from (on servers; ignored elsewhere).
    """
    if roles.is_server:
        server = DownpourShardServer(roles, layout, optimizer or Adagrad(),
                                     worker_timeout_s=worker_timeout_s)
        if server_state is not None:
            server.load_state_dict(server_state)
        return server.serve()
    worker = DownpourWorker(roles, layout, init=init, n_fetch=n_fetch, n_push=n_push,
                            warm_start_steps=warm_start_steps, param_range=param_range)
    return worker.run(step_fn, num_steps)
