"""Asynchronous model averaging (``async``): training never waits for communication.

A background thread per rank keeps averaging the models over a private duplicate communicator
(C_FP_S in a thread, paper §3.2 "Discussion"), while the training thread only does memory
copies at step boundaries:

1. after a step, if no exchange is in flight and ``sync_interval_ms`` has passed since the last
   one started, the training thread copies its parameters into the exchange buffer (a
   snapshot) and wakes the thread; on a GPU it queues the copies and records an event that
   the exchange thread's stream waits for, so it never waits for the device itself;
2. the thread allreduces [snapshot, continue-flag] and computes delta = average - snapshot;
3. after a later step, the training thread applies ``params += delta`` (the average of the
   snapshots, plus whatever local progress was made since). With ``max_staleness=k`` an
   exchange still in flight k steps after it started is waited for: with
   ``sync_interval_ms=0`` and ``max_staleness=1`` every step's snapshot is averaged and
   applied one step later, the same on every run (and so resumable bit for bit); without a
   bound, when a result is applied depends on timing.

No torn reads: the background thread never touches the parameters. The training thread reads
them (snapshot) and writes them (apply) itself, between steps.

Where the buffers live: on the model's GPU when its payloads travel from there, over NCCL or a
CUDA-aware MPI (snapshot, allreduce and delta never leave the device; the exchange thread has
its own communicator and stream), else in page-locked host memory allocated once (a CUDA model's
snapshot and delta are then the only copies, counted in ``accounting.staging``), or plain host
memory for a CPU model.

Clean stop: every exchange carries a flag, 1 to continue and 0 from a rank that is closing; the
exchange in which the flags do not all say continue is the last one on *every* rank, so all
ranks stop after the same number of exchanges and none waits for a peer that has left. ``close()``
(``DistributedOptimizer.close()``, also run at ``bagua_mpi.shutdown()`` and at exit) keeps
feeding snapshots until its thread stops, then does a final synchronous average so the ranks
end with identical models.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
from mpi4py import MPI

from .. import backends, process_groups, runtime
from ..accounting import staging
from ..transport import Transport
from .base import Algorithm, AlgorithmImpl
from .registry import register
from .validation import non_negative_real, optional, positive_int


def exchange_device(model_device: torch.device, backend: str | None = None) -> torch.device:
    """Where the exchange buffers live: the model's GPU if its payloads travel from there
    (NCCL or a CUDA-aware MPI), else the host."""
    if model_device.type == "cuda" and backends.device_carrier(
            backends.resolve(backend)) in ("nccl", "mpi_device"):
        return model_device
    return torch.device("cpu")


class AsyncAverageImpl(AlgorithmImpl):
    communicates_gradients = False
    wants_flat_params = True

    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.exchanges = 0  # completed exchanges
        self._comm: MPI.Intracomm | None = None
        self._buffer: torch.Tensor | None = None  # [flat params of every bucket..., flag]
        self._snapshot: torch.Tensor | None = None
        self._delta: torch.Tensor | None = None
        self._filled = None  # on a GPU: recorded after the training thread filled the buffer
        self._model_device = torch.device("cpu")
        self._wake = threading.Event()  # a snapshot is ready for the thread
        self._done = threading.Event()  # the thread finished an exchange; delta is ready
        self._in_flight = False
        self._closing = False
        self._stopped = threading.Event()
        self._last_start = 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._started_step = 0  # step after which the exchange in flight started
        self._resume_in_flight = False  # a loaded checkpoint carries an exchange's result
        # a restore mid-run (elastic): the exchange under way belongs to the abandoned steps and
        # is dropped when it ends; the restored state's own exchange result is applied instead
        self._discard_in_flight = False
        self._restored_delta: torch.Tensor | None = None
        self.closed = False

    def init_buckets(self, buckets) -> None:
        super().init_buckets(buckets)
        topo = self.ctx.topo
        self._comm = runtime.get().worker.run(topo.comm.Dup, ("dup", "async"))
        total = sum(b.numel for b in buckets)
        self._model_device = buckets[0].device if buckets else torch.device("cpu")
        home = exchange_device(self._model_device, self.backend)
        pin = home.type == "cpu" and self._model_device.type == "cuda"
        # float32 like the models (float64 doubled the bytes); the continue flags sum to at
        # most n, exact in float32
        self._buffer = torch.zeros(total + 1, dtype=torch.float32, device=home, pin_memory=pin)
        self._snapshot = torch.zeros(total, dtype=torch.float32, device=home, pin_memory=pin)
        self._delta = torch.zeros(total, dtype=torch.float32, device=home, pin_memory=pin)
        if self._resume_in_flight:  # the saved run had an exchange in flight: its result
            self._take_saved_delta(self._delta)
            self._in_flight = True
            self._done.set()
        self._thread = threading.Thread(target=self._loop, name="bagua_mpi-async", daemon=True)
        self._thread.start()
        runtime.on_shutdown(self.close)

    # -- training thread --------------------------------------------------------------------------
    def after_step(self, optimizer) -> None:
        if self._thread is None or self._stopped.is_set():
            return
        self._raise_background_error()
        bound = self.algorithm.max_staleness
        if self._in_flight and bound is not None and (
                self._discard_in_flight or self.step - self._started_step >= bound):
            # bounded staleness: this step may not run ahead any further. An exchange left
            # from before an elastic restore is waited for too: the restored run must start
            # its own exchange at this step, as the saved run did, and could not while the old
            # one is on the wire (when it ended first, which a fast wire made the rule, the
            # restore was exact; a slower one, gloo's here, skipped that step's exchange)
            self._done.wait()
            self._raise_background_error()
        if self._in_flight and self._done.is_set():
            self._finish_in_flight()
        self._apply_restored()
        interval = self.algorithm.sync_interval_ms / 1000.0
        if not self._in_flight and time.monotonic() - self._last_start >= interval:
            self._start_exchange(continue_flag=1.0)

    def _crosses_to_host(self) -> bool:
        return self._model_device.type == "cuda" and self._buffer.device.type == "cpu"

    def _start_exchange(self, continue_flag: float) -> None:
        with torch.no_grad():
            for bucket, snapshot in self.bucket_slices(self._snapshot):
                snapshot.copy_(bucket.flat_param.reshape(-1))
            if self._crosses_to_host():
                staging.d2h(self._snapshot.numel() * 4, dense=True)
            self._buffer[:-1].copy_(self._snapshot)
            self._buffer[-1:].fill_(continue_flag)
        if self._buffer.is_cuda:
            # the exchange thread reads the buffer on a stream of its own: it waits on the
            # device for this event, so the training thread does not wait for its own stream
            self._filled = torch.cuda.Event()
            self._filled.record(torch.cuda.current_stream(self._buffer.device))
        self._done.clear()
        self._in_flight = True
        self._started_step = self.step
        self._last_start = time.monotonic()
        self._wake.set()

    def _apply_delta(self, deltas: torch.Tensor) -> None:
        with torch.no_grad():
            for bucket, delta in self.bucket_slices(deltas):
                flat = bucket.flat_param
                # the float32 delta added as it is: rounded once into a 16-bit model, where
                # casting it first rounded twice (ranks then disagreed in ~2% of elements)
                flat.add_(delta.to(device=flat.device))
        if self._crosses_to_host():
            staging.h2d(deltas.numel() * 4)
        self.exchanges += 1

    def _finish_in_flight(self) -> None:
        """The exchange in flight has ended: apply its result, or drop it if it started before
        a restore (not this run's)."""
        if self._discard_in_flight:
            self._discard_in_flight = False
        else:
            self._apply_delta(self._delta)
        self._in_flight = False

    def _apply_restored(self) -> None:
        """The restored state's exchange result, at the step the saved run applied it."""
        if self._restored_delta is not None:
            self._apply_delta(self._restored_delta)
            self._restored_delta = None

    def _take_saved_delta(self, into: torch.Tensor) -> None:
        """The saved exchange's result (``in_flight_delta``, held since the load) into ``into``."""
        for bucket, delta in self.bucket_slices(into):
            delta.copy_(self.tensor_state("in_flight_delta", bucket.segments()).data)
        self.state.drop("in_flight_delta")
        self._resume_in_flight = False

    def load_state_dict(self, state: dict) -> None:
        """Before the first step (a resumed job) ``init_buckets`` takes the saved exchange's
        result. Later (an elastic restore, on every rank after an error they all saw) the
        exchange under way started in the abandoned steps: it cannot be called back (every
        rank's thread is in it, or will be), so its result is dropped when it ends, and the
        restored state's own result is applied at the next step, as the saved run did."""
        super().load_state_dict(state)
        if self._thread is None:
            return
        self._discard_in_flight = self._in_flight
        self._restored_delta = None
        if self._resume_in_flight:
            self._restored_delta = torch.zeros_like(self._delta)
            self._take_saved_delta(self._restored_delta)

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("async averaging thread failed") from self._error

    # -- background thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        """The exchange thread: its own communicator (``self._comm``, so its own NCCL or gloo
        group too) and, on a GPU, its own stream, so the exchange never queues behind the
        training thread's kernels."""
        n = self._comm.Get_size()
        wire = Transport(self._comm, self.backend)
        on_device = self._buffer.is_cuda
        try:
            stream = None
            if on_device:
                torch.cuda.set_device(self._buffer.device)
                stream = torch.cuda.Stream(self._buffer.device)
            while True:
                self._wake.wait()
                self._wake.clear()
                with (torch.cuda.stream(stream) if stream is not None
                      else contextlib.nullcontext()):
                    if stream is not None:  # the snapshot the training thread queued
                        stream.wait_event(self._filled)
                    wire.allreduce_(self._buffer)
                    self.wire.allreduce(self._buffer.numel() * 4, n)
                    everyone_continues = self._buffer[-1].item() == n
                    with torch.no_grad():
                        torch.div(self._buffer[:-1], n, out=self._delta).sub_(self._snapshot)
                    if stream is not None:  # the training thread reads the delta next
                        stream.synchronize()
                self._done.set()
                if not everyone_continues:
                    self._stopped.set()
                    return
        except BaseException as exc:  # noqa: BLE001 - reported in the training thread
            self._error = exc
            self._stopped.set()
            self._done.set()

    # -- stop ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread after an exchange all ranks agree is the last; final average."""
        if self.closed or self._thread is None:
            self.closed = True
            return
        self.closed = True
        while not self._stopped.is_set():
            if self._in_flight:
                self._done.wait(0.05)
                if self._done.is_set() and not self._stopped.is_set():
                    self._finish_in_flight()
                continue
            self._start_exchange(continue_flag=0.0)
        if self._in_flight and self._done.is_set():
            self._finish_in_flight()
        self._apply_restored()
        self._thread.join()
        self._raise_background_error()
        # the final synchronisation: identical models everywhere
        self.dense_allreduce_([b.flat_param for b in self.buckets], average_models=True)
        process_groups.forget([self._comm])  # the exchange thread's group, over this one
        self._comm.Free()

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The state, with the result of the exchange in flight where this rank can have it, so
        that a resumed job applies it at the same step as the uninterrupted one would.

        In lockstep (``sync_interval_ms=0``, ``max_staleness=1``: every rank starts the same
        exchange at every step) this waits for it. Otherwise it takes the result only if the
        exchange has ended: waiting could hang, since an exchange this rank started may need a
        rank that has not started it yet, and that rank may next enter a collective (a
        checkpoint's, a logged loss's) that waits for this one. When an exchange's result is
        applied depends on timing there anyway."""
        result = self._restored_delta  # a restored result not applied yet, else the live one
        live = (self._in_flight and self._thread is not None and not self._discard_in_flight)
        if result is None and live and (self._done.is_set() or self._lockstep()):
            self._done.wait()
            self._raise_background_error()
            result = self._delta
        if result is not None:
            for bucket, delta in self.bucket_slices(result):
                self.tensor_state("in_flight_delta", bucket.segments()).data.copy_(delta)
        state = super().state_dict()
        state["extra"]["in_flight"] = result is not None
        self.state.drop("in_flight_delta")
        return state

    def _lockstep(self) -> bool:
        return self.algorithm.sync_interval_ms == 0 and self.algorithm.max_staleness == 1

    def extra_state(self) -> dict:
        return {"exchanges": self.exchanges, "started_step": self._started_step}

    def load_extra_state(self, extra: dict) -> None:
        self.exchanges = int(extra.get("exchanges", 0))
        self._started_step = int(extra.get("started_step", 0))
        self._resume_in_flight = bool(extra.get("in_flight", False))


@register
@dataclass(frozen=True)
class AsyncModelAverage(Algorithm):
    """Average models in a background thread every ``sync_interval_ms``; never wait for it."""

    name = "async"
    impl_class = AsyncAverageImpl
    averages_models = True
    hierarchical_refusal = ("its background thread averages with one allreduce on a private "
                            "communicator while training runs; use hierarchical=False (MPI's "
                            "own allreduce already follows the node structure)")
    sync_interval_ms: float = 50.0
    max_staleness: int | None = None
    validators = {"sync_interval_ms": non_negative_real(),
                  "max_staleness": optional(positive_int(because="steps an exchange may stay "
                                                         "in flight; None: unbounded"))}

    def compression_refusal(self) -> str:
        return ("the background exchange is a float32 allreduce that MPI sums itself; a 16-bit "
                "wire would need the two-phase cast exchange inside the thread; use "
                "compression=none")
