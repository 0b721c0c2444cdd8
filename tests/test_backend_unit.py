"""Backend choice (auto / MPI / NCCL / gloo) and its errors, and the transport's routing,
staging reuse and counting, on a machine without a GPU. The NCCL collectives themselves run in
``tests/gpu/run.sh``; the gloo process-group plane runs under mpiexec in
``tests/mpi/transport_suite.py``."""
import numpy as np
import pytest
import torch

from bagua_mpi import backends, transport
from bagua_mpi import cuda as bcuda
from bagua_mpi.accounting import overhead, staging
from bagua_mpi.exceptions import BaguaMPIError


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(backends.ENV, raising=False)
    backends.reset()
    yield
    backends.reset()
    bcuda.set_cuda_aware(None)


def test_default_is_auto_and_env_and_init_choose(monkeypatch):
    assert backends.resolve() == "auto"
    monkeypatch.setenv(backends.ENV, "NCCL")
    assert backends.resolve() == "nccl"
    assert backends.resolve("mpi") == "mpi"  # an explicit choice (per optimizer) wins
    monkeypatch.setenv(backends.ENV, "gloo")
    assert backends.resolve() == "gloo"


@pytest.mark.parametrize("bad", ["ucc", "", 3])
def test_unknown_backend_names_what_is_valid(bad, monkeypatch):
    if bad == "":
        monkeypatch.setenv(backends.ENV, "ncl")
        from bagua_mpi.exceptions import ConfigError
        with pytest.raises(ConfigError, match="BAGUA_MPI_BACKEND='ncl'.*nccl"):
            backends.resolve()
        return
    with pytest.raises(backends.BackendError,
                       match="valid: auto, mpi, nccl, nccl_hierarchical, gloo"):
        backends.resolve(bad)
    assert issubclass(backends.BackendError, BaguaMPIError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no GPU is present")
@pytest.mark.parametrize("name", ["nccl", "nccl_hierarchical"])
def test_nccl_without_gpu_is_a_clear_error_not_a_fallback(name):
    with pytest.raises(backends.BackendUnavailableError, match="needs a CUDA GPU"):
        backends.set_default(name)
    assert backends.resolve() == "auto"  # the failed choice left nothing behind
    assert issubclass(backends.BackendUnavailableError, BaguaMPIError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where no GPU is present")
def test_auto_without_gpu_falls_back_to_mpi_and_says_why():
    name, why = backends.auto_backend()
    assert name == "mpi" and "no CUDA GPU" in why
    assert backends.device_carrier("auto") == "mpi_staged"


def test_nccl_missing_from_torch_is_named(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(backends.BackendUnavailableError, match="needs NCCL.*is_nccl_available"):
        backends.check_available("nccl")
    assert backends.auto_backend()[0] == "mpi"


@pytest.mark.parametrize("gpus,ranks,expected", [(1, 2, "mpi"), (2, 2, "nccl"), (8, 4, "nccl")])
def test_auto_picks_nccl_only_with_a_gpu_per_local_rank(monkeypatch, gpus, ranks, expected):
    monkeypatch.setattr(backends, "nccl_missing", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    backends.set_node_ranks(ranks)
    name, why = backends.auto_device_backend()
    assert name == expected, why
    if expected == "mpi":
        assert f"{ranks} ranks share this node's {gpus} GPU" in why


@pytest.mark.parametrize("gpus,ranks", [(1, 2), (2, 2)])
def test_the_wire_every_rank_must_agree_on(monkeypatch, gpus, ranks):
    """``wire`` (what the optimizer compares across ranks) for each backend, CPU and CUDA
    models: device and host payloads both count; auto follows the node (NCCL with a GPU per
    local rank, else MPI), and says why."""
    monkeypatch.setattr(backends, "nccl_missing", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    backends.set_node_ranks(ranks)
    try:
        auto = "nccl" if gpus >= ranks else "mpi"
        expected = {"auto": (auto, "mpi"), "mpi": ("mpi", "mpi"), "nccl": ("nccl", "mpi"),
                    "nccl_hierarchical": ("nccl_hierarchical", "mpi"),
                    "gloo": ("mpi (host payloads: gloo)", "gloo")}
        assert set(expected) == set(backends.BACKENDS)
        for name, (cuda_wire, cpu_wire) in expected.items():
            assert backends.wire(name, "cuda") == cuda_wire, name
            assert backends.wire(name, "cpu") == cpu_wire, name
            if name in ("auto", "mpi", "gloo"):  # who moves device payloads agrees with it
                on_nccl = backends.device_carrier(name) == "nccl"
                assert on_nccl == cuda_wire.startswith("nccl"), name
        assert backends.why_wire("auto", "cuda").startswith("backend='auto': ")
        assert backends.why_wire("gloo", "cuda") == "backend='gloo'"
    finally:
        backends.set_node_ranks(None)


def test_nccl_allreduce_refuses_ops_it_cannot_reduce():
    with pytest.raises(backends.BackendError, match="op 'bitwise_or' has no NCCL reduction"):
        transport.nccl_allreduce_(torch.zeros(1), None, "nccl", op="bitwise_or")


class FakeDeviceArray:
    """Stands for a device buffer (a Numba device array's copy methods) without a GPU."""

    def __init__(self, values):
        self.data = np.array(values)
        self.dtype, self.shape, self.size = self.data.dtype, self.data.shape, self.data.size
        self.nbytes = self.data.nbytes

    def copy_to_host(self, host):
        host[...] = self.data

    def copy_to_device(self, host):
        self.data[...] = host


class FakeComm:
    """A one-rank communicator whose allreduce doubles the data (so the copy back is visible)."""

    def __init__(self):
        self.seen = []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2  # claims two ranks, so the transport does not skip the call

    def Allreduce(self, send, recv, op=None):
        from mpi4py import MPI
        self.seen.append(type(recv))
        if send is MPI.IN_PLACE:
            recv *= 2
        else:
            recv[...] = send * 2


def test_host_tensors_never_go_to_nccl_and_gloo_takes_host_payloads(monkeypatch):
    comm = FakeComm()
    assert transport.Transport(comm, "nccl").carrier(torch.zeros(3)) == "mpi"
    assert transport.Transport(comm, "gloo").carrier(np.zeros(3)) == "gloo"
    assert transport.Transport(comm, "mpi").carrier(torch.zeros(3)) == "mpi"
    bcuda.set_cuda_aware(False)
    assert transport.Transport(comm, "gloo").carrier(FakeDeviceArray([1.0])) == "mpi_staged"
    bcuda.set_cuda_aware(True)
    assert transport.Transport(comm, "mpi").carrier(FakeDeviceArray([1.0])) == "mpi_device"


def test_device_payload_with_nccl_chosen_but_unavailable_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(backends.BackendUnavailableError, match="needs a CUDA GPU"):
        transport.Transport(FakeComm(), "nccl").carrier(FakeDeviceArray([1.0]))


@pytest.mark.parametrize("dense", [False, True])
def test_staging_reuses_pool_buffers_and_counts_bytes(dense):
    bcuda.set_cuda_aware(False)
    transport.pinned_pool.clear()
    comm = FakeComm()
    wire = transport.Transport(comm, "mpi")
    allocations = None
    for step in range(4):
        values = np.arange(100 - step, dtype=np.float32)  # same or smaller each step
        payload = FakeDeviceArray(values)
        staging.reset()
        wire.allreduce_(payload, dense=dense)
        assert np.array_equal(payload.data, 2 * values)
        snap = staging.snapshot()
        assert snap["d2h_bytes"] == payload.nbytes and snap["h2d_bytes"] == payload.nbytes
        assert snap["dense_d2h_bytes"] == (payload.nbytes if dense else 0)
        assert comm.seen[-1] is np.ndarray  # MPI got the host (pool) buffer
        if allocations is None:
            allocations = transport.pinned_pool.allocations
        assert transport.pinned_pool.allocations == allocations, "a buffer allocated per step"
    bigger = FakeDeviceArray(np.ones(1000, dtype=np.float32))
    wire.allreduce_(bigger)
    assert transport.pinned_pool.allocations == allocations + 1  # grown once, then reused
    assert np.array_equal(bigger.data, np.full(1000, 2.0, dtype=np.float32))


def test_cuda_aware_mpi_reads_device_memory_after_one_counted_wait():
    bcuda.set_cuda_aware(True)
    comm = FakeComm()
    payload = FakeDeviceArray(np.ones(8, dtype=np.float32))
    staging.reset()
    before = overhead.snapshot()[1]
    transport.Transport(comm, "mpi")._mover(payload).allreduce_(payload.data, "sum", False)
    assert overhead.snapshot()[1] == before + 1, "one host wait before MPI reads the device"
    assert staging.snapshot()["d2h_bytes"] == 0, "nothing staged"


def test_pool_views_are_independent_per_key():
    a = transport.pinned_pool.get(("k", 1), 16)
    b = transport.pinned_pool.get(("k", 2), 16)
    a[:] = 1
    b[:] = 2
    assert (a == 1).all() and transport.pinned_pool.get(("k", 1), 8).base is not None


def test_receive_buffers_of_the_wrong_size_are_refused():
    wire = transport.Transport(FakeComm(), "mpi")
    with pytest.raises(ValueError, match="allgather over 2 ranks: the receive buffer must hold "
                                         "8 elements, got 6"):
        wire.allgather(np.zeros(4), np.zeros(6))
    with pytest.raises(ValueError, match="live together"):
        wire.alltoall(FakeDeviceArray(np.zeros(4)), np.zeros(4))
    with pytest.raises(ValueError, match="one receive buffer per peer"):
        wire.exchange(np.zeros(4), [np.zeros(4)], [1, 0])


def test_dense_staging_is_counted_as_dense():
    staging.reset()
    staging.d2h(4096, dense=True)
    staging.d2h(100)
    snap = staging.snapshot()
    assert snap == {"d2h_bytes": 4196, "h2d_bytes": 0, "d2h_copies": 2, "largest_d2h": 4096,
                    "dense_d2h_bytes": 4096}


def test_cuda_aware_probe_says_how_it_decided(monkeypatch):
    monkeypatch.setenv("BAGUA_MPI_CUDA_AWARE", "0")
    bcuda.set_cuda_aware(None)
    assert bcuda.mpi_is_cuda_aware() is False
    assert bcuda.how_decided() == "forced by BAGUA_MPI_CUDA_AWARE=0"
    monkeypatch.delenv("BAGUA_MPI_CUDA_AWARE")
    bcuda.set_cuda_aware(None)
    if not torch.cuda.is_available():
        assert bcuda.mpi_is_cuda_aware() is False and bcuda.how_decided() == "no CUDA GPU"


@pytest.mark.parametrize("nprocs", [1, 3])
def test_nccl_bootstrap_over_mpi_meets_in_one_store(nprocs):
    from mpi_harness import assert_mpi_ok, run_mpi
    assert_mpi_ok(run_mpi("gpu_backend_suite.py", nprocs, env={"BAGUA_MPI_RANKS_PER_NODE": "2"},
                          timeout=120), f"NCCL bootstrap over MPI OK on {nprocs} ranks")


def test_async_exchange_buffers_follow_the_model_only_when_its_payloads_leave_from_it(
        monkeypatch):
    """async keeps its snapshot/allreduce/delta on the model's GPU with NCCL or a CUDA-aware
    MPI, and in host memory otherwise (a CPU model always on the host)."""
    from bagua_mpi.algorithms.async_average import exchange_device

    gpu = torch.device("cuda", 1)
    bcuda.set_cuda_aware(True)
    assert exchange_device(gpu, "mpi") == gpu
    assert exchange_device(torch.device("cpu"), "mpi") == torch.device("cpu")
    bcuda.set_cuda_aware(False)
    assert exchange_device(gpu, "mpi") == torch.device("cpu")
    monkeypatch.setattr(backends, "check_available", lambda name: None)
    assert exchange_device(gpu, "nccl") == gpu


def test_per_bucket_launches_and_waits_reach_communication_stats(monkeypatch):
    """The framework reads the counters around each bucket's exchange: a CPU model makes no
    kernel launch and no host wait, and a counted wait inside an exchange shows up in that
    bucket's entry."""
    import bagua_mpi as bm
    from bagua_mpi.algorithms import dense

    bm.init(abort_on_exception=False)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      bucket_size_mb=1e-4)  # one bucket per parameter
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 8)).sum().backward()
            opt.step()
        stats = opt.communication_stats()
        assert set(stats["launches_per_bucket"]) == {b.index for b in opt.buckets}
        assert set(stats["launches_per_bucket"].values()) == {0}
        assert set(stats["syncs_per_bucket"].values()) == {0}
        assert set(stats["allocations_per_bucket"]) == set(stats["launches_per_bucket"])
        assert set(stats["allocations_per_bucket"].values()) == {0}
        original = dense.allreduce_

        def waiting(*args, **kwargs):
            overhead.sync()
            return original(*args, **kwargs)
        monkeypatch.setattr(dense, "allreduce_", waiting)
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        assert set(opt.communication_stats()["syncs_per_bucket"].values()) == {1}
        assert opt.backend == "mpi"
        opt.close()
    finally:
        bm.shutdown()
