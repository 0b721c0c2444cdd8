"""The parameter-server protocol: wire format, message plumbing and the session handshake.

Every message is one MPI message of bytes: a 32-byte header of four int64 (``op, a, b, c``)
followed by an optional payload (a vector slice, a list of vector operations, a loss). One
message per operation, never a header and a payload sent separately, so a receiver never waits
inside MPI for the second half of something a busy or slow sender has not finished sending.

Two tags on the private parameter-server communicator:

* ``TAG_REQUEST`` -- messages a rank did not ask for (a push, a fetch request, a task, a goodbye);
  servers and the coordinator receive them from ``MPI.ANY_SOURCE``;
* ``TAG_REPLY`` -- the answer to a request (fetched parameters, results of vector operations),
  received from the one rank that was asked.

All sends are synchronous-mode (``Issend``): a send is complete only once the receiver has
matched it. That is what makes the final shutdown exact (see ``Endpoint.drain``): a rank enters
the closing barrier only after everything it sent has been received, so no message can be left
in flight when the communicator is freed.

Waiting is done by polling with a short sleep (``polling.Backoff``) instead of blocking MPI
calls: MPICH busy-polls inside a blocking call, and a parameter server that spins on a core
shared with the workers (the normal case on a small machine) steals the time they need to
compute.

A session (one Downpour or Sandblaster run) starts with ``open_session``, collective on every
rank: one allgather of each rank's settings (``handshake``), checked for agreement
(``check_agree``), from which every rank derives the same ``Session`` -- which part of the
vector each worker uses, who sends each shard its initial values, the warm-start length -- so
the message exchange that follows never has to negotiate anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..errors import DistBeliefError, PartitionError
from ..polling import POLL_MAX_S, Backoff
from .roles import COORDINATOR, SERVER, WORKER, Roles, ShardLayout

TAG_REQUEST = 0x4442  # "DB"
TAG_REPLY = 0x4443
HEADER_ITEMS = 4
HEADER_BYTES = 8 * HEADER_ITEMS


class Op(IntEnum):
    """Message kinds (the header's first field)."""

    # Downpour: worker -> shard
    FETCH = 1         # send me my part of your parameters
    PUSH = 2          # payload: accumulated gradient for my part of your slice
    BYE = 3           # a = Departure reason; I will send nothing more
    WARM_DONE = 4     # the warm-start replica finished its solo steps
    # Downpour: shard -> worker
    RELEASE = 5       # warm start over: you may start
    PARAMS = 6        # payload: the parameters asked for
    STOP = 7          # do not continue (you were declared lost, or the session is over)
    # Sandblaster: coordinator <-> shard
    PROGRAM = 8       # payload: float64 (n, 6) vector operations to run on the shard's slice
    RESULTS = 9       # payload: float64 results of the program's reductions
    # Sandblaster: worker <-> shard
    FETCH_EVAL = 10   # a = evaluation id: send the point being evaluated
    PUSH_PORTION = 11  # a = evaluation id, b = portion; payload: gradient sum of that portion
    STALE = 12        # that evaluation is over
    # Sandblaster: coordinator <-> worker
    TASK = 13         # a = evaluation id, b = portion to compute
    READY = 14        # a new worker asks for work
    DONE = 15         # a = evaluation id, b = portion, c = 1 if stale; payload: float64 [loss]


class Departure(IntEnum):
    """Why a worker left (the ``a`` field of ``BYE``), as the servers record it."""

    DONE = 0     # finished its steps
    STOPPED = 1  # told to stop by a server
    ERROR = 2    # its step function raised; the exception was caught and logged
    LOST = 3     # silent for longer than the server's worker_timeout_s (never sent on the wire)


@dataclass
class Message:
    source: int
    op: Op
    a: int
    b: int
    c: int
    payload: np.ndarray  # uint8 view of the bytes after the header (may be empty)

    def data(self, dtype) -> np.ndarray:
        return self.payload.view(dtype)


def pack(op: Op, a: int = 0, b: int = 0, c: int = 0, payload: np.ndarray | None = None,
         out: np.ndarray | None = None) -> np.ndarray:
    """One message buffer: header then the payload's bytes (copied)."""
    nbytes = 0 if payload is None else payload.nbytes
    buf = out if out is not None and out.nbytes == HEADER_BYTES + nbytes else np.empty(
        HEADER_BYTES + nbytes, dtype=np.uint8)
    buf[:HEADER_BYTES].view(np.int64)[:] = (int(op), a, b, c)
    if nbytes:
        buf[HEADER_BYTES:] = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    return buf


class Endpoint:
    """This rank's side of the protocol on the parameter-server communicator.

    ``send`` starts a synchronous-mode send and keeps the buffer alive until it completes;
    ``try_recv``/``recv`` take whole messages; ``drain`` is the clean end of a session.
    """

    def __init__(self, comm: MPI.Intracomm, poll_max_s: float = POLL_MAX_S):
        self.comm = comm
        self.poll_max_s = poll_max_s
        self._pending: list[tuple[MPI.Request, np.ndarray]] = []
        self._status = MPI.Status()

    # -- sending ---------------------------------------------------------------------------
    def send(self, dest: int, buf: np.ndarray, tag: int = TAG_REQUEST) -> MPI.Request:
        req = self.comm.Issend([buf, MPI.BYTE], dest=dest, tag=tag)
        self._pending.append((req, buf))
        return req

    def progress(self) -> None:
        """Retire completed sends (drops our reference to their buffers)."""
        if self._pending:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]

    @property
    def pending(self) -> int:
        return len(self._pending)

    def wait(self, requests: list[MPI.Request]) -> None:
        """Wait for ``requests`` with polling (MPI progress happens inside ``Testall``)."""
        backoff = Backoff(self.poll_max_s)
        while not MPI.Request.Testall(requests):
            backoff.idle()
        self.progress()

    # -- receiving -------------------------------------------------------------------------
    def try_recv(self, source: int = MPI.ANY_SOURCE, tag: int = TAG_REQUEST) -> Message | None:
        msg = self.comm.Improbe(source, tag, self._status)
        if msg is None:
            return None
        nbytes = self._status.Get_count(MPI.BYTE)
        src = self._status.Get_source()
        buf = np.empty(nbytes, dtype=np.uint8)
        msg.Recv([buf, MPI.BYTE])
        if nbytes < HEADER_BYTES:
            raise DistBeliefError(f"rank {self.comm.Get_rank()}: malformed message of "
                                  f"{nbytes} bytes from rank {src}")
        op, a, b, c = (int(v) for v in buf[:HEADER_BYTES].view(np.int64))
        return Message(src, Op(op), a, b, c, buf[HEADER_BYTES:])

    def recv(self, source: int = MPI.ANY_SOURCE, tag: int = TAG_REQUEST) -> Message:
        backoff = Backoff(self.poll_max_s)
        while True:
            m = self.try_recv(source, tag)
            if m is not None:
                return m
            self.progress()
            backoff.idle()

    # -- the end of a session --------------------------------------------------------------
    def drain(self, handle: Callable[[Message], None]) -> None:
        """Collective end of the session: returns once every rank has called ``drain``.

        First finish our own sends while answering whatever arrives (``handle`` sees it), then
        enter a nonblocking barrier and keep answering until every rank has entered it. Since
        every send is synchronous-mode, a rank in the barrier has had all its messages received,
        so when the barrier completes nothing addressed to anyone is still in flight. A rank that
        never calls ``drain`` (hung, or exited) keeps the others here: an MPI job ends as a whole.
        """
        backoff = Backoff(self.poll_max_s)
        while self._pending:
            got = self._handle_any(handle)
            self.progress()
            if not got:
                backoff.idle()
            else:
                backoff.reset()
        barrier = self.comm.Ibarrier()
        while not barrier.Test():
            if self._handle_any(handle):
                backoff.reset()
            else:
                backoff.idle()
            if self._pending:  # replies sent by ``handle``: the asker is waiting for them
                self.wait([r for r, _ in self._pending])

    def _handle_any(self, handle: Callable[[Message], None]) -> bool:
        got = False
        for tag in (TAG_REQUEST, TAG_REPLY):
            m = self.try_recv(MPI.ANY_SOURCE, tag)
            if m is not None:
                handle(m)
                got = True
        return got


# -- the session: what every rank agrees on before the first message ---------------------------

DOWNPOUR, SANDBLASTER = 1, 2
_ROLE_CODES = {SERVER: 0, WORKER: 1, COORDINATOR: 2}  # a rank's role in the handshake table


def handshake(roles: Roles, fields: dict[str, int]) -> list[dict[str, int]]:
    """Collective: every rank's ``fields`` (same keys everywhere), in rank order.

    Used at the start of a session so each side learns the other's settings (which part of the
    vector each worker uses, the warm-start length, ...) and checks the ones that must agree.
    """
    keys = sorted(fields)
    mine = np.array([_ROLE_CODES[roles.role]] + [int(fields[k]) for k in keys], dtype=np.int64)
    table = np.empty((roles.size, len(mine)), dtype=np.int64)
    roles.comm.Allgather(mine, table)
    return [dict(zip(["role"] + keys, (int(v) for v in row))) for row in table]


def check_agree(rows: list[dict[str, int]], key: str, ranks=None) -> int:
    """The common value of ``key`` among ``ranks`` (default all); raise on every rank if not."""
    ranks = range(len(rows)) if ranks is None else ranks
    values = {r: rows[r][key] for r in ranks}
    if len(set(values.values())) > 1:
        raise DistBeliefError(f"ranks disagree on {key}: "
                              + ", ".join(f"rank {r}: {v}" for r, v in values.items()))
    return next(iter(values.values()))


@dataclass(frozen=True)
class Session:
    """What every rank learned at the start of a Downpour or Sandblaster session."""

    mode: int  # DOWNPOUR or SANDBLASTER
    worker_ranges: dict[int, tuple[int, int]]  # worker rank -> the part of the vector it uses
    warm_start_steps: int  # Downpour: solo steps of replica 0 before the others start
    init_ranges: dict[int, tuple[int, int]] = None  # replica 0's ranks -> what they send at start

    def init_senders(self, layout: ShardLayout, k: int) -> list[tuple[int, tuple[int, int]]]:
        """``(rank, global [a, b))`` of each piece of shard k's initial values, in rank order."""
        return [(w, layout.overlap(k, *r)) for w, r in sorted(self.init_ranges.items())
                if layout.overlap(k, *r) is not None]

    def workers_of_shard(self, roles: Roles, layout: ShardLayout, k: int) -> list[int]:
        """Ranks of the workers that use some of shard k (the ones it waits for)."""
        return [w for w in roles.workers
                if layout.overlap(k, *self.worker_ranges[w]) is not None]


def open_session(roles: Roles, layout: ShardLayout, mode: int, *, param_range=(0, 0),
                 warm_start_steps: int = 0, optimizer_code: int = 0,
                 optimizer_lr: float = 0.0) -> Session:
    """Collective: exchange and check the settings of a session (one handshake allgather).

    Every rank must agree on the mode, the layout and the partitions; workers on the warm-start
    length; servers on the update rule. A disagreement raises ``DistBeliefError`` on every rank,
    naming each rank's value, instead of a protocol that silently misbehaves. With partitioned
    replicas, each replica's partition ranges must tile the vector in partition order.
    """
    lr_bits = int(np.array([optimizer_lr], dtype=np.float64).view(np.int64)[0])
    rows = handshake(roles, {
        "mode": mode, "numel": layout.numel, "n_shards": layout.n_shards,
        "itemsize": layout.dtype.itemsize, "lo": param_range[0], "hi": param_range[1],
        "warm": warm_start_steps, "opt": optimizer_code, "lr_bits": lr_bits,
        "parts": roles.n_partitions})
    for key in ("mode", "numel", "n_shards", "itemsize", "parts"):
        check_agree(rows, key)
    warm = check_agree(rows, "warm", roles.workers)
    check_agree(rows, "opt", roles.servers)
    check_agree(rows, "lr_bits", roles.servers)
    if layout.n_shards != roles.n_servers:
        raise DistBeliefError(f"{layout} has {layout.n_shards} shards but the job has "
                              f"{roles.n_servers} server rank(s)")
    ranges = {w: (rows[w]["lo"], rows[w]["hi"]) for w in roles.workers}
    M = roles.n_partitions
    if M == 1:
        init = {roles.workers[0]: (0, layout.numel)}  # worker 0 sends the whole vector
    else:
        for r in range(roles.n_replicas):
            tiles = [ranges[w] for w in roles.replica_ranks(r)]
            ends = [0] + [hi for _, hi in tiles]
            if any(lo != ends[i] for i, (lo, _) in enumerate(tiles)) or ends[-1] != layout.numel:
                raise PartitionError(f"replica {r}: partition parameter ranges {tiles} do not "
                                     f"tile [0, {layout.numel}) in partition order")
        init = {w: ranges[w] for w in roles.replica_ranks(0)}
    return Session(mode, ranges, warm, init)
