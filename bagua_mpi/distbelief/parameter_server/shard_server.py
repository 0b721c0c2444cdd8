"""A parameter-server shard: one rank owning one slice of the flattened parameter vector.

The server loop runs on the calling (main) thread -- not on bagua_mpi's communication thread,
whose queue must stay free for the library's collectives -- and polls the private
parameter-server communicator with ``MPI_Improbe`` from any source: each message is handled to
completion as it arrives, in arrival order, independently of every other shard.

Downpour (``optimizer`` given) -- per message from worker w:

* ``FETCH``: reply with w's part of the slice; remember the shard's update count at that moment;
* ``PUSH``: staleness = updates applied since w's last fetch; apply the update rule; count it;
* ``BYE``: w is done (or its step function raised); ``WARM_DONE``: release the other workers.

A worker silent for longer than ``worker_timeout_s`` is declared lost and told to stop; the loop
ends when every worker that uses this shard has left or been lost.

Partitioned replicas (``setup(n_partitions=M)``): each partition is a worker with its own
parameter range, so a shard serves and counts only the partitions whose parameters it holds.
The initial values arrive from replica 0's partitions (each its own range), and the warm start
ends on this shard when every partition of replica 0 that uses it has reported (or left).

Sandblaster (``optimizer=None``): run the coordinator's programs (``vector_ops``); serve the
point being evaluated to workers (a partition gets its window of it); add each portion's gradient
once (the first copy to arrive wins, later copies of the same portion -- backup tasks -- and
copies from a finished evaluation are dropped); with partitioned replicas a portion's gradient
arrives in pieces, one per partition window, each accepted once; stop when the coordinator says
so.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from ..errors import DistBeliefError
from ..polling import POLL_MAX_S, Backoff
from .optimizers import SGD, Adagrad
from .protocol import (DOWNPOUR, SANDBLASTER, TAG_REPLY, Departure, Endpoint, Message, Op, pack,
                       open_session)
from .roles import Roles, ShardLayout
from .vector_ops import GACC, X, SlotStore

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
_WAITING, _ACTIVE = "waiting", "active"


@dataclass
class ServerReport:
    """What one shard saw during a session (returned by ``ShardServer.serve``)."""

    shard: int
    rank: int
    updates: int  # pushes applied (Downpour)
    pushes: dict[int, int]  # worker rank -> pushes applied from it
    fetches: dict[int, int]  # worker rank -> fetches served
    dropped: int  # pushes from departed/lost workers, portions already counted or stale
    staleness_counts: np.ndarray  # [s] = pushes that arrived s updates after their fetch
    departures: dict[int, str]  # worker rank -> 'DONE' | 'STOPPED' | 'ERROR' | 'LOST'
    first_fetch_updates: dict[int, int]  # worker rank -> update count at its first fetch
    pushes_at_departure: dict[int, dict[int, int]]  # worker -> everyone's pushes when it left
    portions_accepted: int = 0  # Sandblaster
    programs: int = 0  # Sandblaster
    elapsed_s: float = 0.0
    state: dict | None = None  # ``ShardServer.state_dict()`` at the end: for a checkpoint

    def staleness_summary(self) -> dict[str, float]:
        """Mean, median, 90th percentile and maximum staleness of the applied pushes."""
        counts = self.staleness_counts
        total = int(counts.sum())
        if total == 0:
            return {"pushes": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
        values = np.arange(len(counts))
        cdf = np.cumsum(counts) / total
        return {"pushes": total, "mean": float((values * counts).sum() / total),
                "p50": float(values[np.searchsorted(cdf, 0.5)]),
                "p90": float(values[np.searchsorted(cdf, 0.9)]),
                "max": float(values[counts > 0].max())}


class ShardServer:
    """Collective constructor (with the workers' and coordinator's); then ``serve()``.

    Args:
        roles: from ``setup``; this rank must be a server.
        layout: the split of the parameter vector (same on every rank).
        optimizer: ``Adagrad(...)`` or ``SGD(...)`` for Downpour; ``None`` for Sandblaster.
        worker_timeout_s: Downpour only: a worker silent this long (after its release) is
            declared lost, told to stop, and no longer waited for. ``None``: wait for its BYE.
            It must exceed the longest normal gap between a worker's messages to this shard
            (about ``min(n_fetch, n_push)`` step times), or slow workers are dropped too.

    ``ShardServer(...)`` makes the server of the algorithm the optimizer names: a
    ``DownpourShardServer`` (an optimizer) or a ``SandblasterShardServer`` (``None``); both are
    ``ShardServer``s. This base holds what a shard is whatever the algorithm -- its slice, the
    session, the counters, the server loop, the closing, the checkpoint -- and each subclass
    adds how it answers the messages of its algorithm (``_handle``).

    The initial parameters arrive from worker 0 during construction; ``load_state_dict`` after
    construction replaces them (and the optimizer state and counters) from a checkpoint.
    """

    mode: int  # DOWNPOUR or SANDBLASTER: the session this server opens (set by the subclasses)
    coordinated: bool  # whether the algorithm needs setup(coordinator=True)

    def __new__(cls, roles: Roles, layout: ShardLayout, optimizer: SGD | Adagrad | None = None,
                **options):
        if cls is ShardServer:  # the public constructor: the optimizer names the algorithm
            cls = SandblasterShardServer if optimizer is None else DownpourShardServer
        return super().__new__(cls)

    def __init__(self, roles: Roles, layout: ShardLayout, optimizer: SGD | Adagrad | None = None,
                 *, worker_timeout_s: float | None = None, poll_max_s: float = POLL_MAX_S):
        if not roles.is_server:
            raise ValueError(f"rank {roles.rank} is a {roles.role}, not a server")
        self._check_optimizer(optimizer)
        if worker_timeout_s is not None and not worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be positive or None, got {worker_timeout_s!r}")
        if worker_timeout_s is not None and roles.n_partitions > 1:
            raise ValueError("worker_timeout_s cannot be used with partitioned replicas: a "
                             "partition told to stop would leave the rest of its replica "
                             "waiting for its activations")
        if self.coordinated != (roles.coordinator is not None):
            raise ValueError("Sandblaster (optimizer=None) needs setup(coordinator=True); "
                             "Downpour (an optimizer) needs a job without a coordinator")
        self.roles, self.layout, self.optimizer = roles, layout, optimizer
        self.worker_timeout_s = worker_timeout_s
        self.session = open_session(
            roles, layout, self.mode, optimizer_code=getattr(optimizer, "code", 0),
            optimizer_lr=getattr(optimizer, "lr", 0.0))
        self.shard = roles.server_index
        self.start, self.stop = layout.shard_range(self.shard)
        size = self.stop - self.start
        self.store = SlotStore(size, layout.dtype)
        self.opt_state = optimizer.init_state(size, layout.dtype) if optimizer else {}
        self.endpoint = Endpoint(roles.comm, poll_max_s)
        self.my_workers = self.session.workers_of_shard(roles, layout, self.shard)
        self._reset_counters()
        self._served = False
        self.store.slots[X] = self._receive_init(size)

    def _check_optimizer(self, optimizer) -> None:
        """Raise if ``optimizer`` is not what this algorithm's shards apply (before any message)."""
        raise NotImplementedError

    def _receive_init(self, size: int) -> np.ndarray:
        """The initial slice, in pieces from replica 0's partitions (one piece without them)."""
        x = np.empty(size, dtype=self.layout.dtype)
        got = 0
        for sender, (a, b) in self.session.init_senders(self.layout, self.shard):
            m = self.endpoint.recv(source=sender)
            nbytes = (b - a) * self.layout.dtype.itemsize
            if m.op != Op.PARAMS or m.payload.nbytes != nbytes:
                raise DistBeliefError(f"shard {self.shard}: expected {b - a} initial parameters "
                                      f"from worker rank {sender}, got {m.op.name} with "
                                      f"{m.payload.nbytes} bytes")
            x[a - self.start:b - self.start] = m.data(self.layout.dtype)
            got += b - a
        if got != size:
            raise DistBeliefError(f"shard {self.shard}: initial values cover {got} of {size} "
                                  f"parameters")
        return x

    def _reset_counters(self) -> None:
        # Every counter exists in both algorithms, since the report and the checkpoint have one
        # format for both (a Sandblaster shard reports 0 updates, a Downpour one 0 programs).
        self.updates = 0
        self.dropped = 0
        self.pushes = {w: 0 for w in self.my_workers}
        self.fetches = {w: 0 for w in self.my_workers}
        self.fetched_at: dict[int, int] = {}  # worker -> update count at its last fetch
        self.first_fetch: dict[int, int] = {}
        self.staleness = np.zeros(16, dtype=np.int64)
        self.departures: dict[int, Departure] = {}
        self.pushes_at_departure: dict[int, dict[int, int]] = {}
        self.eval_id = -1  # Sandblaster: the evaluation in progress
        self.portions_accepted = 0
        self.programs = 0

    @property
    def params(self) -> np.ndarray:
        """This shard's slice of the parameters (live view)."""
        return self.store.slots[X]

    # -- the loop -----------------------------------------------------------------------------
    def serve(self) -> ServerReport:
        """Serve until the session ends, then join the closing barrier; return the report.

        Once per server object: a new session needs new (collectively constructed) objects.
        """
        if self._served:
            raise DistBeliefError(f"shard {self.shard}: serve() called twice; construct a new "
                                  f"ShardServer (on every rank) for a new session")
        self._served = True
        t0 = time.perf_counter()
        self._begin()
        backoff = Backoff(self.endpoint.poll_max_s)
        while self._serving():
            m = self.endpoint.try_recv()
            if m is not None:
                self._handle(m)
                backoff.reset()
                continue
            self.endpoint.progress()
            self._idle()
            backoff.idle()
        self.endpoint.drain(self._on_late)
        report = self.report(time.perf_counter() - t0)
        report.state = self.state_dict()
        return report

    # What each algorithm fills in: its state at the start of the loop, the loop's end, one
    # message handled to completion, and what to do (besides sleeping) when nothing came.
    def _begin(self) -> None:
        pass

    def _serving(self) -> bool:
        raise NotImplementedError

    def _handle(self, m: Message) -> None:
        raise NotImplementedError

    def _idle(self) -> None:
        pass

    def _on_late(self, m: Message) -> None:
        """Messages that arrive after the loop, while the session closes.

        One answer per message kind serves both algorithms: every kind belongs to one of them.
        """
        if m.op == Op.FETCH:
            self._reply(m.source, Op.STOP)
        elif m.op == Op.FETCH_EVAL:
            self._reply(m.source, Op.STALE)
        elif m.op in (Op.PUSH, Op.PUSH_PORTION):
            self.dropped += 1
        elif m.op in (Op.BYE, Op.WARM_DONE):
            pass
        else:
            raise DistBeliefError(f"shard {self.shard}: unexpected {m.op.name} from rank "
                                  f"{m.source} while closing")

    def _reply(self, dest: int, op: Op, payload: np.ndarray | None = None) -> None:
        self.endpoint.send(dest, pack(op, payload=payload), tag=TAG_REPLY)

    # -- reporting and checkpoints -------------------------------------------------------------
    def report(self, elapsed_s: float = 0.0) -> ServerReport:
        last = np.flatnonzero(self.staleness)
        counts = self.staleness[:last[-1] + 1].copy() if len(last) else np.zeros(0, np.int64)
        return ServerReport(
            shard=self.shard, rank=self.roles.rank, updates=self.updates,
            pushes=dict(self.pushes), fetches=dict(self.fetches), dropped=self.dropped,
            staleness_counts=counts,
            departures={w: r.name for w, r in self.departures.items()},
            first_fetch_updates=dict(self.first_fetch),
            pushes_at_departure={w: dict(p) for w, p in self.pushes_at_departure.items()},
            portions_accepted=self.portions_accepted, programs=self.programs,
            elapsed_s=elapsed_s)

    def state_dict(self) -> dict:
        """Plain dict of NumPy arrays and numbers (copies): parameters, optimizer state, counts.

        Keys: ``format``, ``shard``, ``numel``, ``start``, ``stop``, ``updates``, ``dropped``,
        ``worker_ranks``, ``pushes``, ``fetches`` (aligned with ``worker_ranks``),
        ``staleness_counts``, ``eval_id``, ``opt_<name>`` for each optimizer array and
        ``slot_<k>`` for each vector slot (``slot_0`` is the parameters).
        """
        ranks = np.array(self.my_workers, dtype=np.int64)
        state = {
            "format": STATE_FORMAT, "shard": self.shard, "numel": self.layout.numel,
            "start": self.start, "stop": self.stop, "updates": self.updates,
            "dropped": self.dropped, "worker_ranks": ranks,
            "pushes": np.array([self.pushes[w] for w in self.my_workers], dtype=np.int64),
            "fetches": np.array([self.fetches[w] for w in self.my_workers], dtype=np.int64),
            "staleness_counts": self.report().staleness_counts, "eval_id": self.eval_id,
        }
        for name, arr in self.opt_state.items():
            state[f"opt_{name}"] = arr.copy()
        for k, vec in self.store.slots.items():
            state[f"slot_{k}"] = vec.copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (before ``serve``); checks it fits this shard."""
        if int(state.get("format", -1)) != STATE_FORMAT:
            raise DistBeliefError(f"shard state format {state.get('format')!r}, this version "
                                  f"reads {STATE_FORMAT}")
        mine = (self.shard, self.layout.numel, self.start, self.stop)
        theirs = tuple(int(state[k]) for k in ("shard", "numel", "start", "stop"))
        if mine != theirs:
            raise DistBeliefError(f"shard state for (shard, numel, start, stop) = {theirs} "
                                  f"loaded into {mine}")
        size = self.stop - self.start
        slots = {}
        for key, value in state.items():
            if key.startswith("slot_"):
                arr = np.asarray(value)
                if arr.shape != (size,):
                    raise DistBeliefError(f"shard state {key} has shape {arr.shape}, "
                                          f"expected ({size},)")
                slots[int(key[5:])] = arr.astype(self.layout.dtype, copy=True)
        if X not in slots:
            raise DistBeliefError("shard state has no parameters (slot_0)")
        opt_state = {}
        for name in self.opt_state:
            arr = np.asarray(state.get(f"opt_{name}", np.empty(0)))
            if arr.shape != (size,):
                raise DistBeliefError(f"shard state opt_{name} has shape {arr.shape}, "
                                      f"expected ({size},)")
            opt_state[name] = arr.astype(self.layout.dtype, copy=True)
        self.store.slots = slots
        self.opt_state = opt_state
        self.updates = int(state["updates"])
        self.dropped = int(state["dropped"])
        self.eval_id = int(state["eval_id"])
        counts = np.asarray(state["staleness_counts"], dtype=np.int64)
        self.staleness = np.zeros(max(16, len(counts)), dtype=np.int64)
        self.staleness[:len(counts)] = counts
        ranks = [int(r) for r in np.asarray(state["worker_ranks"])]
        if ranks == self.my_workers:  # per-worker counts only mean something for the same ranks
            self.pushes = dict(zip(ranks, (int(v) for v in state["pushes"])))
            self.fetches = dict(zip(ranks, (int(v) for v in state["fetches"])))


class DownpourShardServer(ShardServer):
    """A shard of Downpour SGD: applies each worker's push as it arrives (see the module doc).

    Made by ``ShardServer(roles, layout, optimizer)`` (or directly, same arguments).
    """

    mode = DOWNPOUR
    coordinated = False

    def __init__(self, roles: Roles, layout: ShardLayout, optimizer: SGD | Adagrad,
                 *, worker_timeout_s: float | None = None, poll_max_s: float = POLL_MAX_S):
        super().__init__(roles, layout, optimizer, worker_timeout_s=worker_timeout_s,
                         poll_max_s=poll_max_s)
        # worker rank -> its part of this slice, relative to the slice's start
        self.windows = {}
        for w in self.my_workers:
            a, b = layout.overlap(self.shard, *self.session.worker_ranges[w])
            self.windows[w] = (a - self.start, b - self.start)

    def _check_optimizer(self, optimizer) -> None:
        if not isinstance(optimizer, (SGD, Adagrad)):
            raise TypeError(f"optimizer must be distbelief.Adagrad, distbelief.SGD or None, "
                            f"got {type(optimizer).__name__}")

    def _begin(self) -> None:
        warm_ranks = set(self.roles.replica_ranks(0))  # the warm-start replica's partitions
        warm = self.session.warm_start_steps > 0
        self._state = {w: (_WAITING if warm and w not in warm_ranks else _ACTIVE)
                       for w in self.my_workers}
        now = time.monotonic()
        self._last_heard = {w: now for w in self.my_workers}
        self._released = not warm
        self._warm_pending = warm_ranks & set(self.my_workers)
        if warm and not self._warm_pending:
            self._release()  # the warm-start replica does not use this shard
        self._remaining = len(self._state)  # workers not yet departed or lost
        self._next_check = now

    def _serving(self) -> bool:
        return self._remaining > 0

    def _idle(self) -> None:
        if self.worker_timeout_s is not None and time.monotonic() >= self._next_check:
            self._check_silence()
            self._next_check = time.monotonic() + min(0.05, self.worker_timeout_s / 10)

    def _handle(self, m: Message) -> None:
        w = m.source
        state = self._state.get(w)
        if state is None:
            raise DistBeliefError(f"shard {self.shard} (rank {self.roles.rank}): {m.op.name} from "
                                  f"rank {w}, which is not one of its workers {self.my_workers}")
        if state == _ACTIVE:
            self._last_heard[w] = time.monotonic()
        if m.op == Op.FETCH:
            if state != _ACTIVE:
                self._reply(w, Op.STOP)
                return
            a, b = self.windows[w]
            self._reply(w, Op.PARAMS, payload=self.params[a:b])
            self.fetches[w] += 1
            self.fetched_at[w] = self.updates
            self.first_fetch.setdefault(w, self.updates)
        elif m.op == Op.PUSH:
            if state != _ACTIVE:
                self.dropped += 1
                return
            self._apply_push(w, m)
        elif m.op == Op.BYE:
            if state in (_WAITING, _ACTIVE):
                self._depart(w, Departure(m.a))
        elif m.op == Op.WARM_DONE:
            self._warm_done(w)
        else:
            raise DistBeliefError(f"shard {self.shard}: unexpected {m.op.name} from rank {w} "
                                  f"in a Downpour session")

    def _apply_push(self, w: int, m: Message) -> None:
        a, b = self.windows[w]
        grad = m.data(self.layout.dtype)
        if grad.shape != (b - a,):
            raise DistBeliefError(f"shard {self.shard}: push of {grad.size} values from rank {w},"
                                  f" whose part of this shard has {b - a}")
        stale = self.updates - self.fetched_at.get(w, 0)
        if stale >= len(self.staleness):
            self.staleness = np.concatenate(
                [self.staleness, np.zeros(max(stale + 1, 2 * len(self.staleness))
                                          - len(self.staleness), dtype=np.int64)])
        self.staleness[stale] += 1
        self.optimizer.apply(self.params, grad, self.opt_state, a, b)
        self.updates += 1
        self.pushes[w] += 1

    def _warm_done(self, w: int) -> None:
        """A partition of the warm-start replica finished (or left): release when all have."""
        if w in self._warm_pending:
            self._warm_pending.discard(w)
            if not self._warm_pending:
                self._release()

    def _release(self) -> None:
        """End of the warm start on this shard: let every waiting worker go."""
        if self._released:
            return
        self._released = True
        now = time.monotonic()
        for w, s in self._state.items():
            if s == _WAITING:
                self._state[w] = _ACTIVE
                self._last_heard[w] = now
                self.endpoint.send(w, pack(Op.RELEASE))

    def _depart(self, w: int, reason: Departure) -> None:
        self._state[w] = reason.name
        self._remaining -= 1
        self.departures[w] = reason
        self.pushes_at_departure[w] = dict(self.pushes)
        if reason == Departure.ERROR:
            logger.warning("shard %d: worker rank %d left after an error in its step function",
                           self.shard, w)
        self._warm_done(w)  # a warm-start replica that leaves early must not block the others

    def _check_silence(self) -> None:
        now = time.monotonic()
        for w, s in self._state.items():
            if s == _ACTIVE and now - self._last_heard[w] > self.worker_timeout_s:
                logger.warning("shard %d: worker rank %d silent for %.1f s (worker_timeout_s=%g): "
                               "declared lost", self.shard, w, now - self._last_heard[w],
                               self.worker_timeout_s)
                self._depart(w, Departure.LOST)
                self.endpoint.send(w, pack(Op.STOP))  # read whenever it wakes up


class SandblasterShardServer(ShardServer):
    """A shard of Sandblaster L-BFGS: runs the coordinator's programs, serves the point being
    evaluated and adds up each portion's gradient once (see the module doc).

    Made by ``ShardServer(roles, layout, None)`` (or directly, without the optimizer).
    """

    mode = SANDBLASTER
    coordinated = True

    def __init__(self, roles: Roles, layout: ShardLayout, optimizer: None = None,
                 *, worker_timeout_s: float | None = None, poll_max_s: float = POLL_MAX_S):
        super().__init__(roles, layout, optimizer, worker_timeout_s=worker_timeout_s,
                         poll_max_s=poll_max_s)
        self.store.on_begin_eval = self._begin_eval
        self.store.on_end_eval = self._end_eval

    def _check_optimizer(self, optimizer) -> None:
        if optimizer is not None:
            raise TypeError(f"a Sandblaster shard applies no update rule (the coordinator "
                            f"moves the point), got optimizer {type(optimizer).__name__}")

    def _reset_counters(self) -> None:
        super()._reset_counters()
        self.eval_src = X  # the slot of the point being evaluated
        self.ledger: dict[int, dict[int, int]] = {}  # portion -> {window start: length}

    def _begin(self) -> None:
        self._stopped = False

    def _serving(self) -> bool:
        return not self._stopped

    def _handle(self, m: Message) -> None:
        coord = self.roles.coordinator
        if m.op == Op.PROGRAM and m.source == coord:
            results = self.store.run(m.data(np.float64).reshape(-1, 6))
            self.programs += 1
            self._reply(coord, Op.RESULTS, payload=results)
        elif m.op == Op.STOP and m.source == coord:
            self._stopped = True
        elif m.op == Op.FETCH_EVAL:
            if m.a == self.eval_id:
                a, b = self._window(m.source)
                self._reply(m.source, Op.PARAMS, payload=self.store.get(self.eval_src)[a:b])
            else:
                self._reply(m.source, Op.STALE)
        elif m.op == Op.PUSH_PORTION:
            self._add_portion(m)
        else:
            raise DistBeliefError(f"shard {self.shard}: unexpected {m.op.name} from rank "
                                  f"{m.source} in a Sandblaster session")

    def _window(self, w: int) -> tuple[int, int]:
        """Worker w's part of this slice, relative to its start (only a worker may ask)."""
        if w not in self.session.worker_ranges:
            raise DistBeliefError(f"shard {self.shard}: Sandblaster message from rank {w}, "
                                  f"which is not a worker")
        ov = self.layout.overlap(self.shard, *self.session.worker_ranges[w])
        if ov is None:
            raise DistBeliefError(f"shard {self.shard}: rank {w} uses none of this shard")
        return ov[0] - self.start, ov[1] - self.start

    def _add_portion(self, m: Message) -> None:
        a, b = self._window(m.source)
        pieces = self.ledger.setdefault(m.b, {}) if m.a == self.eval_id else None
        if pieces is None or a in pieces:
            self.dropped += 1  # a backup copy that lost, or work for a finished evaluation
            return
        grad = m.data(self.layout.dtype)
        if grad.shape != (b - a,):
            raise DistBeliefError(f"shard {self.shard}: portion gradient of {grad.size} values "
                                  f"from rank {m.source}, expected {b - a}")
        self.store.out(GACC)[a:b] += grad
        pieces[a] = b - a
        if sum(pieces.values()) == self.stop - self.start:
            self.portions_accepted += 1

    def _begin_eval(self, eval_id: int, src: int) -> None:
        self.eval_id, self.eval_src = eval_id, src
        self.store.out(GACC)[:] = 0
        self.ledger.clear()

    def _end_eval(self, dst: int, scale: float, n_portions: int) -> None:
        size = self.stop - self.start
        done = {p for p, pieces in self.ledger.items() if sum(pieces.values()) == size}
        if len(done) != n_portions:
            missing = sorted(set(range(n_portions)) - done)[:10]
            raise DistBeliefError(f"shard {self.shard}: evaluation {self.eval_id} ended with "
                                  f"{len(done)} of {n_portions} portions complete (missing e.g. "
                                  f"{missing})")
        np.multiply(self.store.get(GACC), scale, out=self.store.out(dst))
