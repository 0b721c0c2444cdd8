"""Single-process unit tests of the pieces under the collectives (MPI as a singleton)."""
import threading
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi import buffers, config, consistency, ops, topology
from bagua_mpi.worker import CommWorker


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
    with pytest.raises(TypeError, match="int16"):
        buffers.dtype_name(np.zeros(1, np.int16))
    assert buffers.reduce_dtype("bfloat16") == "float32" and buffers.reduce_dtype("int64") == "int64"
    # zero-copy: the MPI view shares memory with the tensor (bfloat16 as raw 16-bit words)
    t = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    view = buffers.host_view(t)
    assert view.dtype == np.uint16 and view[0] == 0x3F80
    view[1] = 0x4040  # 3.0 in bfloat16
    assert t[1].item() == 3.0
    f = torch.ones(4)
    assert buffers.mpi_buffer(f).obj.ctypes.data == f.data_ptr()


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

    if aware and not cuda.probe_cuda_aware():
        pytest.skip("this MPI is not CUDA-aware (probe failed)")
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
    """An operation that itself calls the executor (an algorithm composing collectives) must
    not deadlock, inline or on the comm thread, even while asynchronous work is queued."""
    worker = CommWorker()
    log = []

    def outer():
        h = worker.submit(lambda: log.append("queued"), ("queued",))
        log.append(worker.run(lambda: "nested", ("nested",)))
        return h

    h = worker.run(outer, ("outer",))
    h.wait(5)
    h2 = worker.submit(lambda: worker.run(lambda: "in thread", ("nested",)), ("outer-async",))
    assert h2.wait(5) == "in thread"
    assert log == ["nested", "queued"]
    worker.close(5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("aware", [False, True])
def test_gtopk_on_cuda_tensors_matches_host(initialized, aware):
    """One rank: gTop-k of CUDA tensors (device-resident with a CUDA-aware MPI, staged without)
    gives the host result and residual bit for bit."""
    from bagua_mpi import cuda
    from bagua_mpi.primitives.sparse import gtopk_allreduce_

    if aware and not cuda.probe_cuda_aware():
        pytest.skip("this MPI is not CUDA-aware (probe failed)")
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
