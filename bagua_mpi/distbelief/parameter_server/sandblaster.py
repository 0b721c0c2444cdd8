"""Sandblaster L-BFGS (paper §4.2): a coordinator that optimizes without holding the parameters.

Roles (``setup(n_servers=S, coordinator=True)``): rank 0 coordinates, S ranks hold the shards,
the rest are workers. One L-BFGS iteration:

1. *Direction.* The coordinator knows only the Gram matrix of the history vectors and the
   gradient (``lbfgs.History``); it runs the two-loop recursion on coefficients and sends the
   shards one program ``D = sum_j c_j b_j`` plus ``DOT(G, D)``.
2. *Line search.* For each trial step t: program ``XT = X + t D``, ``BEGIN_EVAL``; then the batch
   is cut into portions handed to free workers (``scheduler.PortionScheduler``, with backup
   copies at the end). A worker fetches ``XT`` once per evaluation, computes the loss and
   gradient sums of a portion, pushes the gradient to the shards (each its slice; a shard counts
   every portion once) and reports the loss to the coordinator. When every portion is in:
   program ``END_EVAL`` (``GT = accumulated / n_samples``), ``GT += l2 XT``, ``DOT(GT, D)``,
   ``DOT(XT, XT)``. Weak-Wolfe bisection decides the next t.
3. *Accept.* Program: new pair ``s = t D``, ``y = GT - G`` into the next history slot,
   ``X = XT``, ``G = GT``, and the dot products that refresh the Gram matrix.

The objective is ``f(x) = (1/n_samples) sum_i loss_i(x) + (l2/2) |x|^2``; the worker's
``portion_fn(x, portion) -> (loss_sum, grad_sum)`` returns *sums* over the portion's samples.

Partitioned replicas (``setup(coordinator=True, n_partitions=M)``): a portion is computed by a
whole replica group. The coordinator talks only to each replica's leader (partition 0), which
relays every task (and the final stop) to its partitions over the group communicator. Each
partition fetches only its ``param_range`` of the point, from the shards holding it; the group
agrees that every partition got the point (else the task is reported stale); each partition
runs its part of the forward/backward and pushes its slice of the gradient sum to its shards
(a shard accepts each (portion, window) piece once, so backup copies still work); once every
partition's push has been received, the leader reports the loss to the coordinator. An
exception in one partition ends the job (its neighbours would wait for it forever).

Example (every rank; see ``examples/sandblaster_lbfgs.py``)::

    roles = distbelief.setup(n_servers=2, coordinator=True)
    layout = distbelief.ShardLayout(dim, roles.n_servers, dtype=np.float64)
    out = distbelief.run_sandblaster(roles, layout, portion_fn, n_portions=40,
                                     n_samples=4000, init=np.zeros(dim), l2=1e-2)
"""
from __future__ import annotations

import logging
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..errors import DistBeliefError
from ..polling import POLL_MAX_S
from .lbfgs import History, WolfeSearch
from .protocol import (SANDBLASTER, TAG_REPLY, TAG_REQUEST, Endpoint, Message, Op, open_session,
                       pack)
from .roles import Roles, ShardLayout
from .scheduler import PortionScheduler, SchedulerStats
from .shard_server import SandblasterShardServer, ServerReport
from .vector_ops import GT, XT, D, G, Program, X, s_slot, y_slot

logger = logging.getLogger(__name__)

PortionFn = Callable[[np.ndarray, int], "tuple[float, np.ndarray]"]
STATE_FORMAT = 1


@dataclass
class LBFGSResult:
    """The coordinator's account of a Sandblaster run."""

    f: float
    grad_norm: float
    iterations: int
    evaluations: int
    converged: bool
    message: str
    f_history: list[float] = field(default_factory=list)  # f after each iteration
    scheduling: SchedulerStats = field(default_factory=SchedulerStats)
    elapsed_s: float = 0.0
    state: dict | None = None  # ``SandblasterCoordinator.state_dict()`` at the end


@dataclass
class SandblasterWorkerReport:
    rank: int
    portions: int  # portions computed (winning or not)
    stale: int  # tasks dropped because their evaluation had ended before the fetch
    fetches: int
    error: str | None = None


class _NoWorkers(Exception):
    pass


class SandblasterCoordinator:
    """Collective constructor; ``run()`` optimizes and ends the session for everybody.

    Args:
        n_portions: portions per evaluation (each worker's portion should be much smaller than
            1/W of the batch: a few times more portions than workers at least).
        n_samples: samples in the batch (the loss and gradient sums are divided by it).
        history: L-BFGS memory m. l2: ridge term of the objective.
        max_iter, gtol, ftol: stop after max_iter iterations, or when |g| <= gtol, or when an
            iteration lowers f by at most ftol * max(|f|, 1).
        backup_copies: extra copies of an outstanding portion at the end of a batch (0: none).
        callback: ``callback(iteration, f, grad_norm)`` after each iteration.
    """

    def __init__(self, roles: Roles, layout: ShardLayout, n_portions: int, n_samples: int, *,
                 history: int = 10, l2: float = 0.0, max_iter: int = 100, gtol: float = 1e-6,
                 ftol: float = 1e-12, backup_copies: int = 1,
                 callback: Callable[[int, float, float], None] | None = None,
                 poll_max_s: float = POLL_MAX_S):
        if not roles.is_coordinator:
            raise ValueError(f"rank {roles.rank} is a {roles.role}, not the coordinator")
        for name, value in (("n_portions", n_portions), ("n_samples", n_samples),
                            ("max_iter", max_iter)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(backup_copies, bool) or not isinstance(backup_copies, int) \
                or backup_copies < 0:
            raise ValueError(f"backup_copies must be an integer >= 0, got {backup_copies!r}")
        for name, value in (("l2", l2), ("gtol", gtol), ("ftol", ftol)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.roles, self.layout = roles, layout
        self.n_portions, self.n_samples = n_portions, n_samples
        self.l2, self.max_iter, self.gtol, self.ftol = float(l2), max_iter, gtol, ftol
        self.max_copies = backup_copies + 1
        self.callback = callback
        self.history = History(history)
        self.session = open_session(roles, layout, SANDBLASTER)
        self.endpoint = Endpoint(roles.comm, poll_max_s)
        self.workers = roles.leaders  # one per replica: a partitioned replica acts as one
        self.idle: list[int] = []  # workers waiting for a task, in the order they asked
        self.gone: set[int] = set()
        self.iteration = 0
        self.evals = 0  # evaluation ids, also the shards' (restored with the state)
        self.f = math.nan
        self.f_history: list[float] = []
        self.stats = SchedulerStats()
        self._resumed = False

    # -- talking to the shards ------------------------------------------------------------------
    def _run(self, program: Program) -> np.ndarray:
        """Run ``program`` on every shard; return its dot products summed over shards."""
        buf = pack(Op.PROGRAM, payload=program.array())
        for server in self.roles.servers:
            self.endpoint.send(server, buf)
        total = np.zeros(program.n_results)
        for server in self.roles.servers:  # fixed order: the same sum every run
            m = self.endpoint.recv(source=server, tag=TAG_REPLY)
            if m.op != Op.RESULTS:
                raise DistBeliefError(f"coordinator: {m.op.name} from shard rank {server} in "
                                      f"reply to a program")
            total += m.data(np.float64)
        self.endpoint.progress()
        return total

    # -- one evaluation of f and g: the portions ------------------------------------------------
    def _evaluate(self, point: int, grad: int, dots: list[tuple[int, int]]) -> tuple[float, list]:
        """f at slot ``point``, gradient into slot ``grad``; plus the requested dot products."""
        eval_id = self.evals
        self.evals += 1
        self._run(Program().begin_eval(point, eval_id))
        alive = [w for w in self.workers if w not in self.gone]
        sched = PortionScheduler(self.n_portions, alive, self.max_copies)
        loss_sum = 0.0
        self._assign(sched, eval_id)
        while not sched.done:
            if len(self.gone) == len(self.workers):
                raise _NoWorkers
            m = self.endpoint.recv(tag=TAG_REQUEST)
            w = m.source
            if m.op == Op.DONE:
                if m.a != eval_id:
                    sched.stats.late += 1
                elif m.c:  # could not fetch the point (cannot happen for the current one)
                    sched.abandon(w, m.b)
                elif sched.complete(w, m.b):
                    loss_sum += float(m.data(np.float64)[0])
                self.idle.append(w)
            elif m.op == Op.READY:
                self.idle.append(w)
            elif m.op == Op.BYE:
                self.gone.add(w)
                back = sched.worker_lost(w)
                logger.warning("Sandblaster: worker rank %d left (%s); portions %s reissued", w,
                               m.payload.tobytes().decode(errors="replace") or "no reason", back)
            else:
                raise DistBeliefError(f"coordinator: unexpected {m.op.name} from rank {w}")
            self._assign(sched, eval_id)
        self.stats.add(sched.stats)
        prog = Program().end_eval(grad, 1.0 / self.n_samples, self.n_portions)
        if self.l2:
            prog.axpy(grad, self.l2, point)
        i_xx = prog.dot(point, point)
        idx = [prog.dot(a, b) for a, b in dots]
        res = self._run(prog)
        f = loss_sum / self.n_samples + 0.5 * self.l2 * res[i_xx]
        return f, [res[i] for i in idx]

    def _assign(self, sched: PortionScheduler, eval_id: int) -> None:
        still_idle = []
        for w in self.idle:
            task = sched.next_task(w)
            if task is None:
                still_idle.append(w)
            else:
                self.endpoint.send(w, pack(Op.TASK, eval_id, task[0], int(task[1])))
        self.idle = still_idle

    # -- the optimizer ---------------------------------------------------------------------------
    def run(self) -> LBFGSResult:
        """Optimize, then stop the workers and shards and close the session (collective end)."""
        t0 = time.perf_counter()
        try:
            converged, message = self._optimize()
        except _NoWorkers:
            converged, message = False, "every worker has left"
            logger.error("Sandblaster: %s; stopping", message)
        for w in self.idle:
            self.endpoint.send(w, pack(Op.STOP))
        self.idle = []
        for server in self.roles.servers:
            self.endpoint.send(server, pack(Op.STOP))
        self.endpoint.drain(self._on_late)
        gnorm = math.sqrt(max(self.history.gram[self.history.g, self.history.g], 0.0))
        return LBFGSResult(self.f, gnorm, self.iteration, self.evals, converged, message,
                           list(self.f_history), self.stats, time.perf_counter() - t0,
                           self.state_dict())

    def _on_late(self, m: Message) -> None:
        if m.op in (Op.DONE, Op.READY):
            self.endpoint.send(m.source, pack(Op.STOP))
        elif m.op != Op.BYE:
            raise DistBeliefError(f"coordinator: unexpected {m.op.name} from rank {m.source} "
                                  f"while closing")

    def _optimize(self) -> tuple[bool, str]:
        hist = self.history
        if not self._resumed:
            self.f, (gg,) = self._evaluate(X, G, [(G, G)])
            hist.clear()
            hist.set_dot(G, G, gg)
        while True:
            gnorm = math.sqrt(hist.gram[hist.g, hist.g])
            if gnorm <= self.gtol:
                return True, f"|g| = {gnorm:.3g} <= gtol"
            if self.iteration >= self.max_iter:
                return False, f"max_iter = {self.max_iter} reached"
            gd = self._direction()
            if not gd < 0:  # not a descent direction (rounding): restart from steepest descent
                hist.clear()
                gd = self._direction()
            t0 = 1.0 if hist.order else min(1.0, 1.0 / gnorm)
            search = WolfeSearch(self.f, gd, t0)
            while True:
                self._run(Program().lincomb(XT, 1.0, X, search.t, D))
                ft, (gdt,) = self._evaluate(XT, GT, [(GT, D)])
                verdict = search.update(ft, gdt)
                if verdict == "accept":
                    break
                if verdict == "fail":
                    return False, f"line search failed after {search.trials} trials"
            f_prev = self.f
            self._accept(search.t, ft)
            self.iteration += 1
            self.f_history.append(self.f)
            gnorm = math.sqrt(hist.gram[hist.g, hist.g])
            if self.callback is not None:
                self.callback(self.iteration, self.f, gnorm)
            if gnorm > self.gtol and f_prev - self.f <= self.ftol * max(abs(self.f), 1.0):
                return True, "f decrease <= ftol"

    def _direction(self) -> float:
        """Form D = -H G on the shards; return G.D."""
        prog = Program()
        terms = self.history.direction_terms()
        (first, c0), rest = terms[-1], terms[:-1]  # the gradient term: scale a copy of G
        prog.copy(D, first).scale(D, c0)
        for slot, c in rest:
            prog.axpy(D, c, slot)
        i = prog.dot(G, D)
        return float(self._run(prog)[i])

    def _accept(self, t: float, ft: float) -> None:
        """Store the pair (s, y), move to XT, refresh the Gram matrix."""
        hist = self.history
        slot = hist.next_slot()
        s, y = s_slot(slot), y_slot(slot)
        prog = (Program().lincomb(s, t, D, 0.0, D).lincomb(y, 1.0, GT, -1.0, G)
                .copy(X, XT).copy(G, GT))
        basis = hist.vectors(pending=slot)
        pairs = []
        for u in (s, y, G):
            for v in basis:
                if (v, u) not in pairs:
                    pairs.append((u, v))
        idx = [prog.dot(u, v) for u, v in pairs]
        res = self._run(prog)
        for (u, v), i in zip(pairs, idx):
            hist.set_dot(u, v, res[i])
        sy, yy = hist.gram[hist.index_of(s), hist.index_of(y)], hist.gram[hist.index_of(y)] \
            [hist.index_of(y)]
        if sy > 1e-10 * yy:
            hist.push(slot)
        else:  # no curvature information in this pair: keep the memory without it
            hist.drop(slot)
        self.f = ft

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain dict of NumPy arrays and numbers: iteration counters, f, the Gram matrix."""
        order = np.full(self.history.m, -1, dtype=np.int64)
        order[:len(self.history.order)] = self.history.order
        return {"format": STATE_FORMAT, "iteration": self.iteration, "evals": self.evals,
                "f": self.f, "history_m": self.history.m, "history_order": order,
                "gram": self.history.gram.copy(),
                "f_history": np.array(self.f_history, dtype=np.float64)}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict`` (the shards must load their matching states)."""
        if int(state.get("format", -1)) != STATE_FORMAT or \
                int(state["history_m"]) != self.history.m:
            raise DistBeliefError(f"coordinator state (format {state.get('format')!r}, history "
                                  f"{state.get('history_m')!r}) does not fit history "
                                  f"{self.history.m}")
        self.iteration, self.evals = int(state["iteration"]), int(state["evals"])
        self.f = float(state["f"])
        self.history.order = [int(i) for i in np.asarray(state["history_order"]) if i >= 0]
        self.history.gram = np.array(state["gram"], dtype=np.float64)
        self.f_history = [float(v) for v in np.asarray(state["f_history"])]
        self._resumed = True


_RELAY_TAG = 0x5342  # leader -> partitions on the replica group: [kind, eval id, portion]
_RELAY_TASK, _RELAY_STOP = 1, 2


class SandblasterWorker:
    """A model replica (or one partition of one) computing portions; collective constructor,
    then ``run()``.

    ``portion_fn(x, portion) -> (loss_sum, grad_sum)`` gets a read-only view of the point being
    evaluated (a partition: only its ``param_range`` is filled; it may return the gradient of
    that slice only). If it raises in an unpartitioned replica, the worker logs the exception,
    tells the coordinator (which hands its portion to someone else) and leaves; ``run`` returns
    with ``report.error`` set. In a partitioned replica the exception ends the job.
    """

    def __init__(self, roles: Roles, layout: ShardLayout, portion_fn: PortionFn, *,
                 init: np.ndarray | None = None, param_range=None,
                 poll_max_s: float = POLL_MAX_S):
        if not roles.is_worker or roles.coordinator is None:
            raise ValueError(f"rank {roles.rank} is a {roles.role}, not a Sandblaster worker "
                             f"(setup(coordinator=True))")
        self.roles, self.layout, self.portion_fn = roles, layout, portion_fn
        self.lo, self.hi = layout.check_range(param_range)
        self.partitioned = roles.n_partitions > 1
        self.leader = roles.partition_index == 0
        if roles.replica_index == 0 and init is None:
            raise ValueError(f"worker rank {roles.rank} (replica 0) must pass init=: it sends the "
                             f"starting point to the shards")
        self.session = open_session(roles, layout, SANDBLASTER, param_range=(self.lo, self.hi))
        self.endpoint = Endpoint(roles.comm, poll_max_s)
        self.x = np.zeros(layout.numel, dtype=layout.dtype)
        if init is not None:
            init = np.asarray(init, dtype=layout.dtype)
            if init.shape == (layout.numel,):
                self.x[:] = init
            elif self.partitioned and init.shape == (self.hi - self.lo,):
                self.x[self.lo:self.hi] = init
            else:
                raise ValueError(f"init must have shape ({layout.numel},), got {init.shape}")
        if roles.rank in self.session.init_ranges:
            sends = []
            for k, server in enumerate(roles.servers):
                for sender, (a, b) in self.session.init_senders(layout, k):
                    if sender == roles.rank:
                        sends.append(self.endpoint.send(server,
                                                        pack(Op.PARAMS, payload=self.x[a:b])))
            self.endpoint.wait(sends)
        # shard -> (server rank, global [a, b) of our part of it)
        self.parts = {k: (roles.servers[k], layout.overlap(k, self.lo, self.hi))
                      for k in layout.shards_overlapping(self.lo, self.hi)}
        self._eval = -1  # the evaluation whose point ``x`` holds

    def _fetch(self, eval_id: int) -> bool:
        for server, _ in self.parts.values():
            self.endpoint.send(server, pack(Op.FETCH_EVAL, eval_id))
        ok = True
        for server, (a, b) in self.parts.values():
            m = self.endpoint.recv(source=server, tag=TAG_REPLY)
            if m.op == Op.PARAMS:
                self.x[a:b] = m.data(self.layout.dtype)
            elif m.op == Op.STALE:
                ok = False
            else:
                raise DistBeliefError(f"worker rank {self.roles.rank}: {m.op.name} in reply to a "
                                      f"fetch from rank {server}")
        self.endpoint.progress()
        if ok:
            self._eval = eval_id
        return ok

    # -- the replica group: relay and agreement (no-ops without partitions) --------------------
    def _group_wait(self, request) -> None:
        self.endpoint.wait([request])

    def _relay(self, kind: int, eval_id: int = 0, portion: int = 0) -> None:
        if self.partitioned:
            msg = np.array([kind, eval_id, portion], dtype=np.int64)
            group = self.roles.group
            self.endpoint.wait([group.Issend(msg, dest=m, tag=_RELAY_TAG)
                                for m in range(1, group.Get_size())])

    def _next_relayed(self) -> tuple[int, int, int]:
        msg = np.empty(3, dtype=np.int64)
        self._group_wait(self.roles.group.Irecv(msg, source=0, tag=_RELAY_TAG))
        return int(msg[0]), int(msg[1]), int(msg[2])

    def _all_ok(self, ok: bool) -> bool:
        if not self.partitioned:
            return ok
        flag = np.array([1 if ok else 0], dtype=np.int64)
        self._group_wait(self.roles.group.Iallreduce(MPI.IN_PLACE, flag, op=MPI.MIN))
        return bool(flag[0])

    def _next_task(self, report) -> tuple[int, int] | None:
        """The next (evaluation, portion), or None at the end: from the coordinator (leader) or
        relayed by the leader (other partitions)."""
        if not self.leader:
            kind, eval_id, portion = self._next_relayed()
            return (eval_id, portion) if kind == _RELAY_TASK else None
        m = self.endpoint.recv(source=self.roles.coordinator, tag=TAG_REQUEST)
        if m.op == Op.STOP:
            self._relay(_RELAY_STOP)
            return None
        if m.op != Op.TASK:
            raise DistBeliefError(f"worker rank {self.roles.rank}: unexpected {m.op.name} "
                                  f"from the coordinator")
        self._relay(_RELAY_TASK, m.a, m.b)
        return m.a, m.b

    def run(self) -> SandblasterWorkerReport:
        report = SandblasterWorkerReport(self.roles.rank, 0, 0, 0)
        coord = self.roles.coordinator
        view = self.x.view()
        view.flags.writeable = False
        if self.leader:
            self.endpoint.send(coord, pack(Op.READY))
        while True:
            task = self._next_task(report)
            if task is None:
                break
            eval_id, portion = task
            ok = True
            if eval_id != self._eval:
                report.fetches += 1
                ok = self._fetch(eval_id)
            if not self._all_ok(ok):
                report.stale += 1
                if self.leader:
                    self.endpoint.send(coord, pack(Op.DONE, eval_id, portion, 1,
                                                   payload=np.zeros(1)))
                continue
            try:
                loss, grad = self.portion_fn(view, portion)
                grad = np.asarray(grad, dtype=self.layout.dtype).reshape(-1)
                if grad.shape == (self.layout.numel,):
                    grad = grad[self.lo:self.hi]
                elif grad.shape != (self.hi - self.lo,):
                    raise ValueError(f"portion_fn returned a gradient of shape {grad.shape}, "
                                     f"expected ({self.layout.numel},)")
            except Exception as exc:  # noqa: BLE001 - a replica's failure is not the job's
                if self.partitioned:
                    raise  # the other partitions wait for this one: only the job can end it
                logger.exception("Sandblaster worker rank %d: portion_fn raised on portion %d; "
                                 "leaving, its portion goes to another worker",
                                 self.roles.rank, portion)
                report.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                reason = np.frombuffer(report.error.encode()[:200], dtype=np.uint8)
                self.endpoint.send(coord, pack(Op.BYE, payload=reason))
                break
            self.endpoint.wait([self.endpoint.send(server, pack(Op.PUSH_PORTION, eval_id, portion,
                                                                payload=grad[a - self.lo:
                                                                             b - self.lo]))
                                for server, (a, b) in self.parts.values()])
            report.portions += 1
            # every partition's pieces are in the shards before the coordinator hears "done"
            # (synchronous sends: completed = received), so END_EVAL cannot overtake them
            self._all_ok(True)
            if self.leader:
                self.endpoint.send(coord, pack(Op.DONE, eval_id, portion, 0,
                                               payload=np.array([float(loss)])))
        self.endpoint.drain(self._on_late)
        return report

    def _on_late(self, m: Message) -> None:
        if m.op not in (Op.STOP, Op.TASK):
            raise DistBeliefError(f"worker rank {self.roles.rank}: unexpected {m.op.name} from "
                                  f"rank {m.source} while closing")


def run_sandblaster(roles: Roles, layout: ShardLayout, portion_fn: PortionFn, n_portions: int,
                    n_samples: int, *, init: np.ndarray | None = None, param_range=None,
                    server_state: dict | None = None, coordinator_state: dict | None = None,
                    **options) -> LBFGSResult | ServerReport | SandblasterWorkerReport:
    """Every rank calls this with the same arguments; returns this rank's result or report.

    ``options`` go to ``SandblasterCoordinator`` (history, l2, max_iter, gtol, ftol,
    backup_copies, callback). ``server_state``/``coordinator_state`` resume from checkpoints.
    ``param_range``: a partition's own parameters (partitioned replicas; workers only).
    """
    if roles.is_server:
        server = SandblasterShardServer(roles, layout)
        if server_state is not None:
            server.load_state_dict(server_state)
        return server.serve()
    if roles.is_coordinator:
        coord = SandblasterCoordinator(roles, layout, n_portions, n_samples, **options)
        if coordinator_state is not None:
            coord.load_state_dict(coordinator_state)
        return coord.run()
    return SandblasterWorker(roles, layout, portion_fn, init=init, param_range=param_range).run()
