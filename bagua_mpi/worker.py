"""The communication thread and the handles of asynchronous operations.

Why a thread: an asynchronous allreduce must make progress while Python runs backward. MPICH
advances nonblocking collectives only inside MPI calls, and its nonblocking algorithms are slower
than the blocking ones, so instead one daemon thread per process runs ordinary blocking MPI calls
(mpi4py releases the GIL inside them) taken from a FIFO queue.

Ordering: every rank must issue collectives on a communicator in the same order. All library
operations therefore run through one serial executor: queued operations run in submission order,
and a synchronous call runs inline only when nothing is queued or running (otherwise it queues
behind them and waits), so the per-rank order is always program order.

Nesting: an operation may compose others with the synchronous ``run`` (it runs inline: the
outer operation already holds the executor), but it may not ``submit``: the new operation would
queue behind the very operation that submits it, so waiting for it there deadlocks (and not
waiting leaves a handle no one owns). ``submit`` from inside an operation therefore raises
``NestedAsyncError`` at once.

Devices: a thread's current CUDA device is its own, and this thread's would stay device 0. So
an operation runs with the CUDA device that was current where it was submitted (when torch has
initialized CUDA there): torch's allocations on ``"cuda"``, its current streams and the context
Numba launches the compression kernels in are then the submitting rank's GPU, not device 0 of
a node whose GPUs every rank sees. A gradient bucket is run with its own device
(``engine.py`` passes it). Its device work runs on that device's default stream, kept in order
with a caller on another stream (``streams.py``).

Recording: the executor also writes each operation into this rank's flight recorder
(``flight_recorder.py``; ``BAGUA_MPI_FLIGHT_RECORDER_SIZE``, 0 = off), the ring buffer the stall
watchdog's hang reports and abort dumps are made of. Nested operations are part of the one
that runs them and are not recorded on their own. The communication log (``comm_log.py``,
``BAGUA_MPI_COMM_LOG``) counts the same operations, with the same start times, when it is on.
"""
from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from typing import Any, Callable

from . import config, streams
from .exceptions import BaguaMPIError, CommunicationError, NestedAsyncError
from .flight_recorder import FlightRecorder, describe_text


class Handle:
    """A pending asynchronous operation. Owns its buffers until it completes.

    ``poll(handle)`` tells whether it is done; ``synchronize(handle)`` waits and returns the
    result (the output tensor for collectives) or raises the error the operation hit. Waiting
    again (from any thread) returns the same result or raises the same error; the finishing step
    (e.g. the copy back to a CUDA tensor) runs exactly once.
    """

    __slots__ = ("name", "_done", "_result", "_error", "_owned", "_finish", "_finish_lock",
                 "_device")

    def __init__(self, name: str, owned: tuple = (), finish: Callable[[Any], Any] | None = None,
                 device=None):
        self.name = name
        self._device = device  # the CUDA device it ran with (None: none)
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None
        self._owned = owned  # keeps input/output/staging buffers alive while MPI uses them
        self._finish = finish  # runs in the waiting thread (e.g. copy back to a CUDA tensor)
        # Two threads may wait for one handle: only one of them runs ``finish``.
        self._finish_lock = threading.Lock() if finish is not None else None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError(f"operation {self.name!r} did not complete within {timeout} s")
        if self._error is not None:
            err = self._error
            if isinstance(err, BaguaMPIError):
                raise err
            raise CommunicationError(f"operation {self.name!r} failed: {err!r}") from err
        # what it wrote on the default stream comes before the waiting thread's next kernels
        streams.caller_waits_for_library(self._device, self._result)
        if self._finish_lock is not None:
            with self._finish_lock:
                if self._finish is not None:
                    self._result = self._finish(self._result)
                    self._finish = None
        self._owned = ()
        return self._result

    def then(self, transform: Callable[[Any], Any]) -> "Handle":
        """Make ``wait`` return ``transform(result)`` (after any finishing step already set);
        call before anyone waits. Returns the handle."""
        earlier = self._finish
        self._finish = transform if earlier is None else (lambda r: transform(earlier(r)))
        if self._finish_lock is None:
            self._finish_lock = threading.Lock()
        return self

    def _complete(self, result=None, error: BaseException | None = None) -> None:
        self._result = result
        self._error = error
        self._done.set()

    def __repr__(self) -> str:
        return f"Handle({self.name!r}, done={self.done()})"


class CommWorker:
    """Serial executor of MPI operations: a daemon thread plus an inline fast path."""

    def __init__(self, watch: Callable[[Any], None] | None = None, rank: int | None = None,
                 recorder_size: int | None = None):
        """``recorder_size``: flight recorder entries, 0 for none; default from the
        environment (``BAGUA_MPI_FLIGHT_RECORDER_SIZE``)."""
        self.rank = rank  # for messages only
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._exec_lock = threading.Lock()  # held while any operation runs
        # the thread running an operation (one at a time: ``_exec_lock``); an ident compare is
        # cheaper than a threading.local lookup on the latency-bound small-collective path
        self._active: int | None = None
        self._count_lock = threading.Lock()
        self._pending = 0  # queued + running asynchronous operations
        if recorder_size is None:
            recorder_size = config.flight_recorder_size()
        # Read once per operation; setting it to None stops recording (benchmarks compare).
        self.recorder: FlightRecorder | None = (FlightRecorder(recorder_size) if recorder_size
                                                 else None)
        self.current: tuple[Any, float] | None = None  # (description, start) for the watchdog
        self._thread = threading.Thread(target=self._loop, name="bagua_mpi-comm", daemon=True)
        self._closed = False
        self.observer: Callable[[Any, float, float], None] | None = None  # timeline hook
        # comm_log.CommLog while the communication log is on (``comm_log.py``), else None: the
        # one attribute check per operation that the log costs when it is off
        self.comm_log = None
        self._thread.start()

    def running_here(self) -> bool:
        """Whether the calling thread is inside one of this executor's operations."""
        return self._active == threading.get_ident()

    # -- submission -------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], describe, owned: tuple = (),
               finish: Callable[[Any], Any] | None = None, device=None) -> Handle:
        """Queue ``fn`` to run on the communication thread; return its handle at once. It runs
        with CUDA ``device`` current (a torch device or an index), by default the one current
        here."""
        if self._closed:
            raise BaguaMPIError("bagua_mpi has been shut down; call bagua_mpi.init() again")
        if self._active == threading.get_ident():
            self._refuse_nested(describe)
        return self._enqueue(fn, describe, owned, finish, record=True, device=device)

    def _enqueue(self, fn, describe, owned, finish, record: bool, device=None) -> Handle:
        if device is None:
            device = _current_cuda_device()
        # what the caller's stream has queued so far comes before the operation's device work
        entry = streams.entry_event(device)
        handle = Handle(_name_of(describe), owned, finish, device)
        recorder = self.recorder if record else None
        with self._count_lock:
            self._pending += 1
            # numbered and queued under one lock: sequence order is queue order
            seq = recorder.queue(describe) if recorder is not None else 0
            self._queue.put((fn, describe, handle, seq, device, entry))
        return handle

    def _refuse_nested(self, describe) -> None:
        where = ("the communication thread" if threading.current_thread() is self._thread
                 else f"thread {threading.current_thread().name!r}")
        running = self.current[0] if self.current is not None else None
        who = f"rank {self.rank}: " if self.rank is not None else ""
        raise NestedAsyncError(
            f"bagua_mpi {who}{describe_text(describe)} was submitted asynchronously from inside "
            f"the running operation {describe_text(running)} (on {where}, e.g. in an "
            f"algorithm's reduce_bucket). It would only start after that operation ends, so "
            f"waiting for it there deadlocks. Call the synchronous form instead (allreduce_ "
            f"rather than allreduce_async_ + synchronize, ...): nested, it runs at once, inline.")

    def run(self, fn: Callable[[], Any], describe, device=None):
        """Run ``fn`` now in this thread if the queue is idle, else behind the queued work;
        either way with CUDA ``device`` current (a torch device or an index), by default the
        one current here, as ``submit``'s work runs.

        Called from inside a running operation (an algorithm composing collectives, on the
        communication thread or inline), it runs ``fn`` at once: that operation already holds
        the executor (and ``device``, where given, is made current for it).
        """
        if getattr(device, "type", "cuda") != "cuda":
            device = None  # a host tensor's device: nothing to make current
        me = threading.get_ident()
        if self._active == me:  # nested in an operation that already holds the executor
            if device is None:
                return fn()
            with using_cuda_device(device):
                return fn()
        with self._exec_lock:
            if self._pending == 0:
                started = time.monotonic()
                self.current = (describe, started)
                self._active = me
                recorder = self.recorder
                seq = recorder.begin(describe, started) if recorder is not None else 0
                failed = True
                try:
                    on = _current_cuda_device() if device is None else device
                    if on is None:
                        result = fn()
                    else:  # on the default stream, as on the communication thread
                        with using_cuda_device(device), \
                                streams.on_the_library_stream(on) as caller_takes:
                            result = fn()
                            caller_takes(result)
                    failed = False
                    return result
                finally:
                    self._active = None
                    self.current = None
                    if seq:
                        recorder.finish(seq, failed)
                    log = self.comm_log  # read once: another thread may switch it off
                    if log is not None and not failed:
                        log.record(describe, started, time.monotonic())
        return self.submit(fn, describe, device=device).wait()

    def thread_alive(self) -> bool:
        """Whether the communication thread still runs (after ``close``: stuck in an operation)."""
        return self._thread.is_alive()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has run. False on timeout."""
        # not recorded: a local marker, not an operation the other ranks take part in
        marker = self._enqueue(lambda: None, "drain", (), None, record=False)
        return marker._done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, describe, handle, seq, device, entry = item
            with self._exec_lock:
                started = time.monotonic()
                self.current = (describe, started)
                self._active = threading.get_ident()
                recorder = self.recorder if seq else None  # None: submitted while it was off
                if recorder is not None:
                    recorder.start(seq, started)
                failed = True
                try:
                    if device is None:  # no CUDA where it was submitted: nothing to set
                        result = fn()
                    else:
                        with using_cuda_device(device):
                            streams.wait_for_entry(device, entry)
                            result = fn()
                    failed = False
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                    handle._complete(error=exc)
                else:
                    handle._complete(result)
                finally:
                    self._active = None
                    self.current = None
                    if recorder is not None:
                        recorder.finish(seq, failed)
                    log = self.comm_log  # read once: another thread may switch it off
                    if log is not None and not failed:
                        log.record(describe, started, time.monotonic())
                    if self.observer is not None:
                        self.observer(describe, started, time.monotonic())
                    with self._count_lock:
                        self._pending -= 1

    @property
    def pending(self) -> int:
        return self._pending


def _name_of(describe) -> str:
    if isinstance(describe, tuple) and describe:
        return str(describe[0])
    return str(describe)


def _current_cuda_device() -> int | None:
    """The calling thread's current CUDA device, where torch has initialized CUDA (else None,
    at the cost of a lookup: nothing is imported or initialized here)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def using_cuda_device(device) -> contextlib.AbstractContextManager:
    """``device`` (an index or a torch device) current on this thread for the enclosed work;
    nothing for None or a host device."""
    if device is None or getattr(device, "type", "cuda") != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)
