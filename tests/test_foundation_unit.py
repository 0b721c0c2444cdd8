"""Single-process unit tests of the pieces under the collectives (MPI as a singleton)."""
import contextlib
import os
import threading
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi import buffers, config, consistency, ops, topology
from bagua_mpi.collectives import _core
from bagua_mpi.exceptions import ConfigError, NestedAsyncError
from bagua_mpi.worker import CommWorker
from mpi_harness import skip_unless_mpi_cuda_aware


@pytest.fixture
def initialized():
    bm.init(abort_on_exception=False)
    yield
    bm.shutdown()


def test_functions_before_init_raise_named_error():
    assert not bm.is_initialized()
    with pytest.raises(bm.NotInitializedError):
        bm.rank()
    with pytest.raises(bm.NotInitializedError):
        bm.allreduce(torch.ones(1))


def test_single_rank_world(initialized):
    assert (bm.rank(), bm.size(), bm.local_rank(), bm.local_size()) == (0, 1, 0, 1)
    assert (bm.cross_rank(), bm.cross_size()) == (0, 1)
    assert bm.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    x = torch.arange(6.0).reshape(2, 3)
    torch.testing.assert_close(bm.allreduce(x), x)
    assert bm.allgather(x).shape == (2, 3)


def test_init_uses_a_private_duplicate(initialized):
    comm = bm.runtime.get().topo.comm
    assert MPI.Comm.Compare(comm, MPI.COMM_WORLD) == MPI.CONGRUENT  # same group, new context


def test_init_twice_is_noop_and_reinit_after_shutdown():
    bm.init(abort_on_exception=False)
    first = bm.runtime.get()
    bm.init(abort_on_exception=False)
    assert bm.runtime.get() is first
    bm.shutdown()
    assert not bm.is_initialized()
    bm.init(abort_on_exception=False)
    assert bm.runtime.get() is not first
    bm.shutdown()


def test_init_rejects_bad_arguments():
    with pytest.raises(TypeError, match="intracommunicator"):
        bm.init(comm="world", abort_on_exception=False)
    with pytest.raises(ValueError, match="positive integer"):
        bm.init(ranks_per_node=0, abort_on_exception=False)
    assert not bm.is_initialized()


@pytest.mark.parametrize("value,expected", [("1", True), ("off", False), ("", True)])
def test_env_flag(monkeypatch, value, expected):
    monkeypatch.setenv("X_FLAG", value)
    assert config.env_flag("X_FLAG", True) is expected


def test_env_parsing_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("X_FLAG", "maybe")
    with pytest.raises(ValueError, match="X_FLAG='maybe'"):
        config.env_flag("X_FLAG", True)
    monkeypatch.setenv("X_INT", "-2")
    with pytest.raises(ValueError, match="X_INT='-2'"):
        config.env_int("X_INT", None)


def test_dtype_names_and_views():
    for t, name in [(torch.zeros(1, dtype=torch.bfloat16), "bfloat16"),
                    (np.zeros(1, np.float16), "float16"), (torch.zeros(1, dtype=torch.bool), "bool")]:
        assert buffers.dtype_name(t) == name
    # the dtypes listed are those of the kind given: NumPy has no bfloat16, and no int8/int16 here
    with pytest.raises(TypeError, match="int16 for a ndarray; supported: float16, float32, "
                                        "float64, int32, int64, uint8, bool$"):
        buffers.dtype_name(np.zeros(1, np.int16))
    assert buffers.reduce_dtype("bfloat16") == "float32" and buffers.reduce_dtype("int64") == "int64"
    # zero-copy: the MPI view shares memory with the tensor (bfloat16 as raw 16-bit words)
    t = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    view = buffers.host_view(t)
    assert view.dtype == np.uint16 and view[0] == 0x3F80
    view[1] = 0x4040  # 3.0 in bfloat16
    assert t[1].item() == 3.0
    f = torch.ones(4)
    from bagua_mpi import transport
    assert transport.mpi_buffer(f).obj.ctypes.data == f.data_ptr()


def test_fused_tensors_gather_and_scatter_every_tensor_in_its_own_layout():
    """One buffer for several tensors (``buffers.FusedTensors``, what PowerSGD's kept plans sum
    as one message): gathered end to end in order, strided views included, and scattered back
    into each; empty tensors take no part, one tensor is its own buffer, and tensors of two
    dtypes are refused by name."""
    base = torch.arange(40, dtype=torch.float32)
    strided = base[:24].view(4, 6)[:, ::2]            # a view that is not contiguous
    flat, empty, matrix = torch.arange(5.0) + 100, torch.empty(0), torch.ones(2, 3) * 7
    fused = buffers.FusedTensors([strided, empty, flat, matrix])
    gathered = fused.gather()
    expected = torch.cat([strided.reshape(-1), flat, matrix.reshape(-1)])
    assert torch.equal(gathered, expected) and len(fused.tensors) == 3
    gathered.mul_(-1)
    fused.scatter()
    assert torch.equal(strided, -expected[:12].view(4, 3))
    assert torch.equal(flat, -expected[12:17]) and torch.equal(matrix, -expected[17:].view(2, 3))
    assert torch.equal(base[:24].view(4, 6)[:, 1::2], torch.arange(24.0).view(4, 6)[:, 1::2])
    alone = torch.arange(3.0)
    assert buffers.FusedTensors([alone, empty]).gather() is not None
    assert buffers.FusedTensors([alone]).gather().data_ptr() == alone.data_ptr()
    assert buffers.FusedTensors([empty]).gather() is None
    with pytest.raises(ValueError, match="one dtype and device"):
        buffers.FusedTensors([alone, alone.double()])


def test_reduce_op_mapping():
    assert ops.mpi_op(bm.Sum, "float32") == MPI.SUM
    assert ops.mpi_op(bm.Average, "bfloat16") == MPI.SUM
    assert ops.mpi_op(bm.Max, "bool") == MPI.LOR and ops.mpi_op(bm.Min, "bool") == MPI.LAND
    with pytest.raises(TypeError):
        ops.mpi_op(bm.Average, "int64")
    assert ops.ReduceOp.parse("sum") is bm.Sum and ops.ReduceOp.parse("MAX") is bm.Max
    with pytest.raises(ValueError, match="valid: Average, Sum, Min, Max, Product"):
        ops.ReduceOp.parse("median")


def test_signature_hash_is_stable_and_discriminating():
    a = ("allreduce", ("op", "Sum"), ("dtype", "float32"), ("shape", (3,)))
    b = ("allreduce", ("op", "Sum"), ("dtype", "float32"), ("shape", (4,)))
    assert consistency.signature_hash(a) == consistency.signature_hash(a) != consistency.signature_hash(b)
    assert 0 <= consistency.signature_hash(a) < 2 ** 62
    text = consistency.describe_mismatch(1, [a, b])
    assert "rank 0: allreduce(op=Sum, dtype=float32, shape=(3,))" in text
    assert "rank 1: allreduce(op=Sum, dtype=float32, shape=(4,))" in text


def test_a_signature_that_is_not_all_pairs_still_formats():
    """The mismatch report must not fail in place of the mismatch it reports."""
    text = consistency.describe_mismatch(0, [("bucket", "qsgd", 3), ("bucket", ("index", 3))])
    assert "rank 0: bucket('qsgd', 3)" in text and "rank 1: bucket(index=3)" in text


@pytest.mark.parametrize("name", sorted(bm.algorithms.names()))
def test_every_signature_an_algorithm_checks_is_key_value_pairs(initialized, monkeypatch, name):
    """One rank, two steps of each registered algorithm: every signature that reaches the
    agreement check is (operation, (key, value), ...), which its mismatch report shows as
    key=value (the bucket exchange's once held bare values, and the report failed with a
    ValueError instead of naming the ranks' algorithms)."""
    seen = []
    original = consistency.verify

    def recording(comm, signature, join=None, cache=True):
        seen.append(signature)
        return original(comm, signature, join, cache)
    monkeypatch.setattr(consistency, "verify", recording)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    kind = torch.optim.Adam if name == "onebit_adam" else torch.optim.SGD
    opt = bm.DistributedOptimizer(kind(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), algorithm=name)
    try:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 8)).square().mean().backward()
            opt.step()
    finally:
        opt.close()
    assert seen, f"{name}: no signature reached the check"
    bad = [sig for sig in seen if not isinstance(sig[0], str) or not all(
        isinstance(f, tuple) and len(f) == 2 and isinstance(f[0], str) for f in sig[1:])]
    assert not bad, f"{name}: signatures with fields that are not (key, value) pairs: {bad}"


def test_consistency_check_switch(initialized):
    bm.set_consistency_check(False)
    try:
        assert not consistency.enabled()
        assert bm.allreduce(torch.ones(2), bm.Sum).tolist() == [1.0, 1.0]
    finally:
        bm.set_consistency_check(True)
    assert consistency.enabled()


def test_worker_runs_in_submission_order_and_sync_waits_behind():
    worker = CommWorker()
    log = []
    gate = threading.Event()
    h1 = worker.submit(lambda: (gate.wait(5), log.append(1)), ("first",))
    h2 = worker.submit(lambda: log.append(2) or "two", ("second",))
    threading.Timer(0.2, gate.set).start()
    assert worker.run(lambda: log.append(3) or "three", ("sync",)) == "three"
    assert log == [1, 2, 3]
    assert h1.done() and h2.wait() == "two"
    worker.close(5)


def test_worker_runs_an_operation_on_the_cuda_device_current_where_it_was_submitted(
        monkeypatch):
    """A thread's current CUDA device is its own: the communication thread's would stay device 0
    while a rank works on cuda:3. An operation submitted where CUDA is initialized runs with the
    submitter's device current (a stand-in device guard records it, with the thread it ran on);
    where CUDA is not initialized nothing is set."""
    entered = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append((self.device, threading.current_thread().name))

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "device", Guard)
    FakeCudaStreams(monkeypatch, [])   # every thread on the default stream: nothing to order
    worker = CommWorker()
    try:
        assert worker.submit(lambda: "host", ("no cuda",)).wait(5) == "host"
        assert entered == []
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        assert worker.submit(lambda: "done", ("on cuda:3",)).wait(5) == "done"
        assert entered == [(3, "bagua_mpi-comm"), "exit"]
        bucket_device = torch.device("cuda", 1)  # the engine names a bucket's own device
        assert worker.submit(lambda: "b", ("bucket",), device=bucket_device).wait(5) == "b"
        assert entered[2:] == [(bucket_device, "bagua_mpi-comm"), "exit"]
    finally:
        worker.close(5)


class FakeCudaStreams:
    """torch.cuda's streams and events, for a machine without a GPU: a current stream per
    thread (the default one unless ``torch.cuda.stream`` says otherwise), and a ``log`` of
    every record and wait, in the order they are queued."""

    class Stream:
        def __init__(self, name, log):
            self.name, self.log = name, log

        def wait_stream(self, other):
            self.log.append((self.name, "waits for", other.name))

        def wait_event(self, event):
            self.log.append((self.name, "waits for", event.name))

        def synchronize(self):
            self.log.append(("host", "waits for", self.name))

    def __init__(self, monkeypatch, log):
        self.log, self.default, self.local = log, self.Stream("default", log), threading.local()
        fakes = self

        class Event:
            def record(self, stream):
                self.name = f"event on {stream.name}"
                log.append(("record", stream.name))

        @contextlib.contextmanager
        def stream(s):
            before = fakes.current()
            fakes.local.stream = s
            try:
                yield
            finally:
                fakes.local.stream = before

        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fakes.current())
        monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: fakes.default)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)

    def current(self):
        return getattr(self.local, "stream", self.default)

    @classmethod
    def on_device_zero(cls, monkeypatch, log):
        """The fakes, with CUDA initialized and device 0 current."""
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        return cls(monkeypatch, log)


def test_a_caller_on_another_stream_takes_the_cuda_tensors_of_a_result(monkeypatch):
    """What the library allocated on the default stream is marked as used on the caller's
    stream (``record_stream``), queued or run at once: every CUDA tensor of the result, in
    tuples, lists and dicts, and nothing else; on the default stream nothing is marked."""
    log = []
    side = FakeCudaStreams.on_device_zero(monkeypatch, log).Stream("side", log)

    class OnCuda:
        is_cuda = True

        def __init__(self, name):
            self.name = name

        def record_stream(self, stream):
            log.append((self.name, "used on", stream.name))

    def result():
        return OnCuda("a"), [OnCuda("b"), torch.zeros(1)], {"c": OnCuda("c")}, 7

    def marked():
        return [entry for entry in log if entry[1] == "used on"]
    worker = CommWorker()
    try:
        with torch.cuda.stream(side):
            worker.submit(result, ("queued",)).wait(5)
            assert marked() == [(name, "used on", "side") for name in "abc"], log
            log.clear()
            worker.run(result, ("inline",))
            assert marked() == [(name, "used on", "side") for name in "abc"], log
            log.clear()
        worker.submit(result, ("q",)).wait(5)
        worker.run(result, ("i",))
        assert not marked(), log
    finally:
        worker.close(5)


def test_worker_orders_its_device_work_with_a_caller_on_another_stream(monkeypatch):
    """A training loop under ``torch.cuda.stream(side)`` puts its kernels on a stream that
    nothing orders with the default one, where the library's device work runs. Queued, an
    operation's default stream waits for an event on the caller's stream, and the thread that
    waits for its handle has its stream wait for the default one before it uses the result;
    run at once on the caller's thread, the operation runs with the default stream current,
    between the same two waits; on the default stream nothing is recorded or waited for."""
    log = []
    side = FakeCudaStreams.on_device_zero(monkeypatch, log).Stream("side", log)
    worker = CommWorker()

    def op(name):
        return lambda: log.append((name, "runs on", torch.cuda.current_stream().name)) or name

    try:
        with torch.cuda.stream(side):
            handle = worker.submit(op("queued"), ("queued",))
            assert handle.wait(5) == "queued"
            assert log == [("record", "side"), ("default", "waits for", "event on side"),
                           ("queued", "runs on", "default"), ("side", "waits for", "default")]
            log.clear()
            assert worker.run(op("inline"), ("inline",)) == "inline"
            assert log == [("default", "waits for", "side"), ("inline", "runs on", "default"),
                           ("side", "waits for", "default")]
            assert torch.cuda.current_stream() is side   # the caller's stream is put back
            log.clear()
        assert worker.submit(op("q"), ("q",)).wait(5) == "q"
        assert worker.run(op("i"), ("i",)) == "i"
        assert log == [("q", "runs on", "default"), ("i", "runs on", "default")]
    finally:
        worker.close(5)


def on_cuda1_with_cuda3_current(monkeypatch, log):
    """The stream fakes with cuda:3 current, the devices made current recorded in a list, and
    a stand-in buffer on cuda:1 that the collectives take for a CUDA tensor."""
    cuda, guarded = FakeCudaStreams(monkeypatch, log), []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device",
                        lambda d: guarded.append(d) or contextlib.nullcontext())

    class OnCuda1:
        device = torch.device("cuda", 1)

    buffer = OnCuda1()
    monkeypatch.setattr(_core, "is_cuda", lambda t: t is buffer)
    return cuda, guarded, buffer


def test_an_asynchronous_collective_returns_without_waiting_for_the_callers_stream(
        monkeypatch, initialized):
    """``allreduce_async`` and its kin hand the caller a handle at once, as Horovod's do: the
    operation is ordered after the caller's stream on the device (an event on the stream of the
    buffer's device, which the default stream waits for), never by a host wait, which would hold
    the caller (a backward hook, say) until the GPU had caught up. A stand-in buffer on cuda:1,
    with cuda:3 current, shows whose device the executor orders."""
    log = []
    cuda, guarded, buffer = on_cuda1_with_cuda3_current(monkeypatch, log)
    side = cuda.Stream("side", log)
    rt = bm.runtime.get()
    with torch.cuda.stream(side):
        handle = _core.start(rt, lambda: log.append(("op", "runs on",
                                                     torch.cuda.current_stream().name)),
                             ("allreduce", "stand-in"), (buffer,))
        handle.wait(5)
    assert log == [("record", "side"), ("default", "waits for", "event on side"),
                   ("op", "runs on", "default"), ("side", "waits for", "default")]
    assert guarded == [torch.device("cuda", 1)]


def test_a_synchronous_collective_runs_with_its_buffers_device_current(monkeypatch, initialized):
    """As an asynchronous one does, inline and queued behind other work alike: torch exports a
    CUDA tensor to a CUDA-aware MPI only from its own device, and the caller's current device
    may be another GPU of the node. A stand-in buffer on cuda:1, with cuda:3 current; a host
    buffer changes nothing."""
    _, guarded, buffer = on_cuda1_with_cuda3_current(monkeypatch, [])
    rt = bm.runtime.get()
    assert _core.run_now(rt, lambda: "inline", ("allreduce", "stand-in"),
                         (torch.ones(1), buffer)) == "inline"
    assert guarded == [torch.device("cuda", 1)]
    guarded.clear()
    release = threading.Event()
    busy = rt.worker.submit(lambda: release.wait(5), ("busy",))
    threading.Timer(0.2, release.set).start()
    assert _core.run_now(rt, lambda: "queued", ("allreduce", "stand-in"), (buffer,)) == "queued"
    busy.wait(5)
    assert torch.device("cuda", 1) in guarded, guarded
    guarded.clear()
    assert _core.run_now(rt, lambda: "host", ("allreduce", "host"), (torch.ones(1),)) == "host"
    assert guarded == [], guarded


def test_a_cuda_aware_mpi_verb_runs_with_its_buffers_device_current(monkeypatch):
    """The transport's verbs on device memory make the first CUDA tensor's device current
    (lists of buffers too) while the host waits for it and MPI reads it: model averaging and
    the sparse allgather reach them from the caller's thread. With no CUDA tensor (Numba
    device arrays, host arrays) nothing is made current."""
    from bagua_mpi import transport

    current, seen = [3], []

    @contextlib.contextmanager
    def device(d):
        current.append(d.index)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(transport, "device_ready", lambda: seen.append(("ready", current[-1])))
    monkeypatch.setattr(transport._HostMPI, "exchange",
                        lambda self, *args: seen.append(("exchange", current[-1])))

    class OnCuda1(torch.Tensor):
        is_cuda = True
        device = torch.device("cuda", 1)

    wire = transport._DeviceMPI(None)
    wire.exchange(np.ones(2), [torch.ones(1), torch.ones(2).as_subclass(OnCuda1)], [1], 0)
    assert seen == [("ready", 1), ("exchange", 1)] and current == [3], (seen, current)
    seen.clear()
    wire.exchange(np.ones(2), [np.ones(2)], [1], 0)
    assert seen == [("ready", 3), ("exchange", 3)], seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_an_asynchronous_allreduce_on_a_side_stream_returns_at_once_and_reads_the_write(
        initialized):
    """The test above on a GPU: the caller's fill is held back ~50 ms on its side stream;
    ``allreduce_async`` must return well before that (no host wait) and still sum the filled
    values (the operation waits for the caller's stream on the device)."""
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    bm.allreduce(x.clone(), op=bm.Sum)   # the route and any communicator set up outside the clock
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)   # ~50 ms on the side stream
        x.fill_(3.0)
        began = time.perf_counter()
        handle = bm.allreduce_async(x, op=bm.Sum)
        returned = time.perf_counter() - began
        summed = bm.synchronize(handle).clone()
    torch.cuda.synchronize()
    assert returned < 0.025, f"allreduce_async held the caller {returned * 1e3:.1f} ms"
    assert bool((summed == 3.0 * bm.size()).all()), "the allreduce read before the caller wrote"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_a_caller_on_a_side_stream_and_the_library_see_each_others_writes():
    """The test above on a GPU, where a missing wait shows as a stale read: a 50 ms sleep on one
    stream holds back the write that the other stream's work must follow. Queued and inline:
    the operation copies what the caller wrote on its side stream after a sleep there, and
    writes on the default stream after a sleep there what the caller then copies."""
    worker = CommWorker()
    side = torch.cuda.Stream()
    mine, theirs = torch.zeros(1 << 20, device="cuda"), torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()

    def exchange(seen):
        seen.append(mine.clone())                 # must see the caller's fill
        torch.cuda._sleep(100_000_000)            # ~50 ms on the stream current here
        theirs.fill_(len(seen))                   # the caller must see this fill
        return seen

    try:
        for how in ("queued", "inline"):
            with torch.cuda.stream(side):
                torch.cuda._sleep(100_000_000)
                mine.fill_(7.0)
                seen = (worker.submit(lambda: exchange([]), (how,)).wait(30) if how == "queued"
                        else worker.run(lambda: exchange([]), (how,)))
                copied = theirs.clone()
            torch.cuda.synchronize()
            assert bool((seen[0] == 7.0).all()), f"{how}: the library read before the caller wrote"
            assert bool((copied == 1.0).all()), f"{how}: the caller read before the library wrote"
            mine.zero_(), theirs.zero_()
            torch.cuda.synchronize()
    finally:
        worker.close(5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_worker_allocates_on_the_submitters_gpu():
    """On a machine with two GPUs: after set_device(1) on this thread, an operation on the
    communication thread allocates "cuda" memory on cuda:1, not on its own device 0."""
    worker = CommWorker()
    previous = torch.cuda.current_device()
    torch.cuda.set_device(1)
    try:
        made = worker.submit(lambda: torch.empty(1, device="cuda").device, ("alloc",)).wait(30)
        assert made == torch.device("cuda", 1)
    finally:
        torch.cuda.set_device(previous)
        worker.close(5)


def test_worker_errors_reach_the_waiter_as_library_errors():
    worker = CommWorker()
    h = worker.submit(lambda: 1 / 0, ("divide",))
    with pytest.raises(bm.CommunicationError, match="divide") as info:
        h.wait(5)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    h2 = worker.submit(lambda: (_ for _ in ()).throw(bm.MismatchError("x")), ("m",))
    with pytest.raises(bm.MismatchError):
        h2.wait(5)
    worker.close(5)


def test_handle_wait_timeout():
    worker = CommWorker()
    gate = threading.Event()
    h = worker.submit(lambda: gate.wait(5), ("slow",))
    with pytest.raises(TimeoutError, match="slow"):
        h.wait(0.05)
    gate.set()
    assert h.wait(5) is True
    worker.close(5)


def test_watchdog_logs_a_stalled_operation(caplog):
    from bagua_mpi.watchdog import Watchdog

    worker = CommWorker()
    dog = Watchdog(worker, rank=0, warn_after=0.1, abort_after=0)
    gate = threading.Event()
    with caplog.at_level("WARNING", logger="bagua_mpi.watchdog"):
        h = worker.submit(lambda: gate.wait(5), ("allreduce", "Sum", "float32", (3,)))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not caplog.records:
            time.sleep(0.02)
        gate.set()
        h.wait(5)
    dog.stop()
    worker.close(5)
    assert any("allreduce(Sum, float32, (3,)) has waited" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError):
        Watchdog(worker, 0, warn_after=0, abort_after=1)


@pytest.mark.parametrize("describe, departed, hinted", [
    (("bucket", 0, 24), {0: (1, -1)}, True),                   # the end of its program
    (("allreduce", "Average", "float32", (2,)), {1: (0, 0)}, True),  # shutdown()
    (("grouped_allreduce", "Sum", 3), {2: (1, 0)}, True),      # sys.exit(0)
    (("bucket", 0, 24), {0: (1, 3)}, False),                   # sys.exit(3): the cause itself
    (("bucket", 0, 24), {0: (2, -1)}, False),                  # an uncaught exception
    (("bucket", 0, 24), {0: (1, -1), 2: (2, -1)}, False),      # one clean, one not
    (("allgather", "float32", (2,)), {0: (1, -1)}, False),     # join() gives no zeros there
    (("barrier",), {0: (1, -1)}, False),
])
def test_a_clean_departure_during_an_exchange_suggests_join(describe, departed, hinted):
    from bagua_mpi import faults
    from bagua_mpi.watchdog import _uneven_work_hint

    assert (faults.LEFT_SHUTDOWN, faults.LEFT_EXIT, faults.LEFT_EXCEPTION) == (0, 1, 2)
    hint = _uneven_work_hint(describe, departed)
    assert ("bagua_mpi.join()" in hint) is hinted, hint


def test_slurm_cross_check_warns_on_disagreement(initialized):
    topo = bm.runtime.get().topo
    agree = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    assert topology.check_slurm_agreement(topo, agree) == []
    assert topology.check_slurm_agreement(topo, {}) == []
    with pytest.warns(RuntimeWarning, match="--mpi=pmi2"):
        problems = topology.check_slurm_agreement(
            topo, {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "x"})
    assert problems == ["SLURM_PROCID=3 but MPI world rank is 0",
                        "SLURM_NTASKS=4 but MPI world size is 1",
                        "SLURM_LOCALID='x' is not an integer"]


TORCHRUN_REFUSAL = r"MPI sees a job of 1 rank, but WORLD_SIZE=4 .*RANK=2.*mpiexec -n 4 python"
SRUN_REFUSAL = (r"SLURM_PROCID=1: MPI sees a job of 1 rank, but SLURM_STEP_NUM_TASKS=2 .*"
                r"srun --mpi=pmi2 \(--mpi=pmix only where .*COMM_SELF")


@pytest.mark.parametrize("rule, environ, refusal", [
    # torchrun --nproc_per_node=4: four singletons
    ("refuse_lone_process_of_a_larger_job", {"WORLD_SIZE": "4", "RANK": "2"}, TORCHRUN_REFUSAL),
    ("refuse_lone_process_of_a_larger_job", {"WORLD_SIZE": "1", "RANK": "0"}, None),
    ("refuse_lone_process_of_a_larger_job", {}, None),
    ("refuse_lone_process_of_a_larger_job", {"WORLD_SIZE": "four"}, None),
    # srun --mpi=none -n 2
    ("refuse_lone_task_of_a_slurm_step", {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"},
     SRUN_REFUSAL),
    ("refuse_lone_task_of_a_slurm_step", {"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"},
     None),
    # python run from the batch script
    ("refuse_lone_task_of_a_slurm_step", {"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, None),
    ("refuse_lone_task_of_a_slurm_step", {}, None),
    ("refuse_lone_task_of_a_slurm_step", {"SLURM_STEP_NUM_TASKS": "two"}, None),
])
def test_a_lone_mpi_process_of_a_larger_launch_is_refused(rule, environ, refusal):
    """torchrun's and srun's processes that MPI sees as jobs of one rank are refused, naming
    the variables and the launch to use; other environments, and MPI's own larger jobs, pass."""
    from bagua_mpi.exceptions import MisuseError
    refuse = getattr(topology, rule)
    if refusal is not None:
        with pytest.raises(MisuseError, match=refusal):
            refuse(1, environ)
    else:
        refuse(1, environ)
    refuse(4, environ)  # MPI's own job of 4: fine


@pytest.mark.parametrize("launcher, environ, refusal", [
    ("torchrun", {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"},
     "bagua_mpi.init(): MPI sees a job of 1 rank, but WORLD_SIZE=4"),
    ("srun without --mpi", {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
                            "SLURM_NTASKS": "2"},
     "bagua_mpi.init() on Slurm task SLURM_PROCID=1: MPI sees a job of 1 rank, but "
     "SLURM_STEP_NUM_TASKS=2"),
])
def test_init_as_a_lone_process_of_a_larger_job_fails_and_comm_self_is_a_choice(
        launcher, environ, refusal):
    """A process that a launcher started as one of several (torchrun's WORLD_SIZE, a srun
    step of several tasks without a working --mpi plugin) but that MPI sees as a job of one
    rank: init raises, leaving nothing initialized; init(comm=MPI.COMM_SELF) runs it alone
    on purpose."""
    import subprocess
    import sys
    code = ("import bagua_mpi as bm\nfrom mpi4py import MPI\n"
            "try:\n    bm.init()\nexcept bm.MisuseError as e:\n"
            "    print('refused', bm.is_initialized(), str(e))\n"
            "bm.init(MPI.COMM_SELF)\nprint('alone', bm.size())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORLD_SIZE", "RANK",
                                                                     "SLURM_"))}
    proc = subprocess.run([sys.executable, "-c", code], env={**env, **environ},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (launcher, proc.stderr)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"refused False {refusal}") and lines[1:] == ["alone 1"], \
        (launcher, proc.stdout)


def test_cuda_awareness_override(monkeypatch):
    from bagua_mpi import cuda

    monkeypatch.setenv("BAGUA_MPI_CUDA_AWARE", "1")
    cuda.set_cuda_aware(None)
    assert cuda.mpi_is_cuda_aware() is True
    monkeypatch.setenv("BAGUA_MPI_CUDA_AWARE", "auto")
    cuda.set_cuda_aware(None)
    if not torch.cuda.is_available():
        # no GPU: no probe is attempted and CUDA tensors would be staged through the host
        assert cuda.mpi_is_cuda_aware() is False
    cuda.set_cuda_aware(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("aware", [False, True])
def test_cuda_tensors_staged_or_direct(initialized, aware):
    from bagua_mpi import cuda

    if aware:
        skip_unless_mpi_cuda_aware()
    cuda.set_cuda_aware(aware)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = torch.arange(10, device="cuda").to(dtype)
            assert torch.equal(bm.allreduce(x, bm.Sum).cpu(), x.cpu())
            assert torch.equal(bm.broadcast(x, 0).cpu(), x.cpu())
            assert bm.allgather(x).is_cuda
    finally:
        cuda.set_cuda_aware(None)


def test_nested_operations_run_inline_even_with_work_queued():
    """An operation that itself calls the executor synchronously (an algorithm composing
    collectives) must not deadlock, inline or on the comm thread, even with work queued."""
    worker = CommWorker()
    log = []
    gate = threading.Event()
    queued = worker.submit(lambda: (gate.wait(5), log.append("queued")), ("queued",))
    # queued work is pending: this runs on the comm thread behind it, the nested call inline
    h2 = worker.submit(lambda: worker.run(lambda: "in thread", ("nested",)), ("outer-async",))
    gate.set()
    assert h2.wait(5) == "in thread"
    assert worker.run(lambda: worker.run(lambda: "inline", ("nested",)), ("outer",)) == "inline"
    assert queued.done() and log == ["queued"]
    worker.close(5)


def test_nested_async_submission_raises_instead_of_deadlocking():
    """submit() from inside a running operation (comm thread or inline) would queue behind its
    own caller: waiting for it deadlocks, so it is refused with a named error."""
    worker = CommWorker(rank=3)

    def outer():
        inner = worker.submit(lambda: "never", ("allreduce", "Sum", "float32", (4,)))
        return inner.wait(5)  # the deadlock the guard prevents (a TimeoutError without it)

    h = worker.submit(outer, ("bucket", 0, 16))
    with pytest.raises(NestedAsyncError) as info:
        h.wait(10)
    text = str(info.value)
    assert "rank 3: allreduce(Sum, float32, (4,))" in text
    assert "bucket(0, 16)" in text and "communication thread" in text and "allreduce_" in text
    assert isinstance(info.value, bm.BaguaMPIError)
    with pytest.raises(NestedAsyncError, match="MainThread"):
        worker.run(outer, ("inline-outer",))
    assert worker.run(lambda: "still fine", ("after",)) == "still fine"
    worker.close(5)


def test_waiting_twice_returns_the_same_result_and_finishes_once():
    worker = CommWorker()
    calls = []
    h = worker.submit(lambda: [1, 2], ("op",), finish=lambda r: calls.append(1) or r + [3])
    first = h.wait(5)
    assert h.wait(5) is first and first == [1, 2, 3] and calls == [1]
    bad = worker.submit(lambda: 1 / 0, ("divide",))
    errors = []
    for _ in range(2):
        with pytest.raises(bm.CommunicationError) as info:
            bad.wait(5)
        errors.append(info.value)
    assert errors[0] is errors[1] or str(errors[0]) == str(errors[1])
    # two threads waiting at once: finish still runs once
    gate = threading.Event()
    calls.clear()
    h = worker.submit(lambda: gate.wait(5) and 7, ("slow",),
                      finish=lambda r: (calls.append(1), time.sleep(0.05), r * 2)[2])
    results = []
    threads = [threading.Thread(target=lambda: results.append(h.wait(5))) for _ in range(2)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(5)
    assert results == [14, 14] and calls == [1]
    worker.close(5)


def test_settings_are_validated_by_name(monkeypatch):
    monkeypatch.setenv("BAGUA_MPI_STALL_ABORT_S", "-1")
    with pytest.raises(ConfigError, match="BAGUA_MPI_STALL_ABORT_S='-1'"):
        config.stall_abort_s()
    monkeypatch.setenv("BAGUA_MPI_STALL_WARNING_S", "0")
    with pytest.raises(ValueError, match="BAGUA_MPI_STALL_WARNING_S='0'.*> 0"):
        config.stall_warning_s()
    monkeypatch.setenv("BAGUA_MPI_EXIT_TIMEOUT_S", "nan")
    with pytest.raises(ConfigError, match="finite"):
        config.exit_timeout_s()
    monkeypatch.setenv("BAGUA_MPI_EXIT_TIMEOUT_S", "0")
    assert config.exit_timeout_s() == 0.0
    monkeypatch.setenv("BAGUA_MPI_CHECKPOINT_SCHEME", "MPIO")
    assert config.checkpoint_scheme() == "mpio"
    monkeypatch.setenv("BAGUA_MPI_CHECKPOINT_SCHEME", "fast")
    with pytest.raises(ConfigError, match="expected auto, mpio or token"):
        config.checkpoint_scheme()
    monkeypatch.delenv("BAGUA_MPI_CHECKPOINT_SCHEME")
    monkeypatch.setenv("BAGUA_MPI_CHECKPOINT_FAULT", "written@2")
    assert config.checkpoint_fault(("written",)) == ("written", 2)
    assert config.checkpoint_fault() == ("written", 2)
    with pytest.raises(ConfigError, match="unknown phase 'written'"):
        config.checkpoint_fault(("prepared",))
    monkeypatch.setenv("BAGUA_MPI_CHECKPOINT_FAULT", "written@x")
    with pytest.raises(ConfigError, match="rank >= 0"):
        config.checkpoint_fault()
    monkeypatch.delenv("BAGUA_MPI_CHECKPOINT_FAULT")
    monkeypatch.setenv("BAGUA_MPI_KERNEL_THREADS", "0")
    with pytest.raises(ConfigError, match="BAGUA_MPI_KERNEL_THREADS='0'"):
        config.kernel_threads()
    monkeypatch.setenv("BAGUA_MPI_KERNEL_THREADS", "2")
    monkeypatch.setenv("BAGUA_MPI_TIMELINE", " /tmp/tl ")
    assert config.kernel_threads() == 2 and config.timeline_prefix() == "/tmp/tl"


def test_init_fails_on_a_malformed_setting_and_warns_on_unknown_ones(monkeypatch, caplog):
    monkeypatch.setenv("BAGUA_MPI_HIERARCHICAL", "sometimes")
    with pytest.raises(ConfigError, match="BAGUA_MPI_HIERARCHICAL='sometimes'"):
        bm.init(abort_on_exception=False)
    assert not bm.is_initialized()
    monkeypatch.delenv("BAGUA_MPI_HIERARCHICAL")
    monkeypatch.setenv("BAGUA_MPI_STALL_ABORT", "5")  # misspelt: would be a silent no-op
    with caplog.at_level("WARNING", logger="bagua_mpi.config"):
        bm.init(abort_on_exception=False)
        bm.shutdown()
    assert any("BAGUA_MPI_STALL_ABORT " in r.getMessage() + " " for r in caplog.records)
    assert config.unknown_variables({"BAGUA_MPI_CHECK": "1", "BAGUA_MPI_SLURM_DIR": "x",
                                     "BAGUA_MPI_CHEK": "0"}) == ["BAGUA_MPI_CHEK"]


def test_every_library_setting_has_an_accessor():
    """config.py is the only reader of BAGUA_MPI_* variables: each known name has an accessor,
    and the documented table lists each of them."""
    assert set(config.settings()) == set(config.KNOWN)
    for name in config.KNOWN:
        assert name in config.__doc__, name


def test_sys_exit_status_is_learned_only_when_the_interpreter_exits():
    """The wrapped sys.exit records the status only when the interpreter itself reads it (a
    caught and inspected SystemExit does not count), in a fresh interpreter."""
    import subprocess
    import sys

    program = (
        "import atexit, sys\n"
        "from bagua_mpi import faults\n"
        "faults.install(abort_on_exception=False)\n"
        "atexit.register(lambda: print('status', faults.exit_status()))\n"
        "try:\n"
        "    sys.exit(2)\n"
        "except SystemExit as e:\n"
        "    assert e.code == 2 and isinstance(e, SystemExit)\n"
        "print('caught', faults.exit_status())\n"
        "sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])\n")
    cases = (("3", 3, "(True, 3)"), ("0", 0, "(True, 0)"), ("bye", 1, "(True, 1)"))
    # the three interpreters side by side: each is mostly importing torch
    procs = [subprocess.Popen([sys.executable, "-c", program, arg], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for arg, _, _ in cases]
    for proc, (arg, code, expected) in zip(procs, cases):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == code, (arg, err)
        assert "caught (False, None)" in out and f"status {expected}" in out, (arg, out, err)


def test_thread_exception_hook_follows_abort_on_exception():
    from bagua_mpi import faults

    previous = threading.excepthook
    faults.install(abort_on_exception=False)
    try:
        assert threading.excepthook is previous and not faults.installed()
    finally:
        faults.uninstall()
    faults.install(abort_on_exception=True)
    try:
        assert threading.excepthook is faults._abort_on_thread_exception and faults.installed()
    finally:
        faults.uninstall()
    assert threading.excepthook is previous and sys_exit_restored()


def sys_exit_restored() -> bool:
    import sys
    from bagua_mpi import faults
    return sys.exit is not faults._exit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("aware", [False, True])
def test_gtopk_on_cuda_tensors_matches_host(initialized, aware):
    """One rank: gTop-k of CUDA tensors (device-resident with a CUDA-aware MPI, staged without)
    gives the host result and residual bit for bit."""
    from bagua_mpi import cuda
    from bagua_mpi.primitives.sparse import gtopk_allreduce_

    if aware:
        skip_unless_mpi_cuda_aware()
    cuda.set_cuda_aware(aware)
    try:
        g = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
        host, host_res = g.clone(), torch.zeros_like(g)
        dev, dev_res = g.cuda(), torch.zeros_like(g).cuda()
        for _ in range(2):
            gtopk_allreduce_(host, bm.runtime.get().topo.comm, 100, host_res, scale=0.5)
            gtopk_allreduce_(dev, bm.runtime.get().topo.comm, 100, dev_res, scale=0.5)
        assert torch.equal(dev.cpu(), host) and torch.equal(dev_res.cpu(), host_res)
    finally:
        cuda.set_cuda_aware(None)


@pytest.mark.parametrize("factor", [1 / 3, 1 / 6, 0.1, 0.7, 3.0])
def test_float16_is_scaled_by_the_factor_rounded_once(factor):
    """A host float16 tensor scaled in place (a 16-bit gradient's prescale or postscale under
    gloo, hierarchical or a process set) and scaled into a copy: the product correctly rounded
    to float16, where NumPy multiplied by the factor rounded to float16 first (a third of the
    products one step off)."""
    x = np.random.default_rng(3).uniform(-100, 100, 4096).astype(np.float16)
    want = (x.astype(np.float64) * factor).astype(np.float16)
    scaled = torch.from_numpy(x.copy())
    buffers.scale_(scaled, factor)
    copied = torch.empty_like(scaled)
    buffers.scaled_copy(copied, torch.from_numpy(x.copy()), factor)
    np.testing.assert_array_equal(scaled.numpy(), want)
    np.testing.assert_array_equal(copied.numpy(), want)
