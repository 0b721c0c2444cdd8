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
from mpi_harness import assert_check_passed, suite_job

import gpu_backend_suite


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
def test_before_init_auto_counts_the_gpus_this_process_sees(monkeypatch, gpus, ranks, expected):
    monkeypatch.setattr(backends, "nccl_missing", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(backends, "_node_ranks", ranks)
    assert backends.shared_gpus() is None  # init has gathered nothing
    name, why = backends.auto_device_backend()
    assert name == expected, why
    if expected == "mpi":
        assert f"{ranks} ranks share this node's {gpus} GPU" in why


H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("node_gpus,expected,needle", [
    # each rank sees only its own GPU (slurm/bind_gpu.sh): one device each, all different
    ([("GPU-a", H100), ("GPU-b", H100), ("GPU-c", H100), ("GPU-d", H100)], "nccl",
     "each of 4 local rank(s) has a GPU of its own"),
    ([("GPU-a", H100), ("GPU-a", H100)], "mpi",
     f"local ranks 0-1 on one GPU ({H100}, GPU-a), and NCCL refuses"),
    ([("GPU-a", H100), ("GPU-b", H100), ("GPU-a", H100), ("GPU-b", H100), ("GPU-a", H100)],
     "mpi", "local ranks 0,2,4 on one GPU (NVIDIA H100 80GB HBM3, GPU-a) (and 1 more"),
    ([("GPU-a", H100), None], "mpi", "local rank 1 of this node without a GPU"),
])
def test_auto_takes_nccl_when_no_two_local_ranks_map_to_one_gpu(monkeypatch, node_gpus,
                                                                expected, needle):
    """After init, ``auto`` decides from the node's gathered GPU ids, not from how many GPUs
    this process sees: with one visible GPU a rank (which counting took for four ranks on one
    GPU) it takes NCCL."""
    monkeypatch.setattr(backends, "nccl_missing", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(backends, "_node_gpus", node_gpus)
    monkeypatch.setattr(backends, "_node_ranks", len(node_gpus))
    name, why = backends.auto_device_backend()
    assert (name, needle in why) == (expected, True), why
    assert backends.device_carrier("auto") == ("nccl" if expected == "nccl" else "mpi_staged")


class OneNode:
    """A communicator of ``size`` ranks on one node whose allgather returns what the ranks
    would each send (``gpu_of`` of each local rank, this process playing them all)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def allgather(self, mine):
        return [backends.gpu_of(r) if r != self.rank else mine for r in range(self.size)]


class Props:
    def __init__(self, index):
        self.uuid, self.name = f"GPU-{index}", "FakeGPU"


@pytest.mark.parametrize("visible,expected", [(4, "nccl"), (2, "mpi"), (1, "mpi")])
def test_learn_node_gpus_maps_local_rank_to_visible_device_rank_mod_count(monkeypatch,
                                                                          visible, expected):
    """Four local ranks that all see ``visible`` GPUs map to device rank % visible: four
    distinct GPUs, or two ranks on each of two, or all on one."""
    monkeypatch.setattr(backends, "nccl_missing", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "get_device_properties", Props)
    backends.learn_node_gpus(OneNode(0, 4))
    assert backends.local_ranks() == 4
    assert [g[0] for g in backends._node_gpus] == [f"GPU-{r % visible}" for r in range(4)]
    assert backends.auto_device_backend()[0] == expected


def test_a_gpu_that_cannot_be_read_counts_as_none(monkeypatch, caplog):
    """Local rank 0's GPU raises when read: it counts as no GPU, so the node takes MPI."""
    def gpu_of(local_rank):
        if local_rank == 0:
            raise RuntimeError("CUDA driver error")
        return "GPU-1", "FakeGPU"
    monkeypatch.setattr(backends, "gpu_of", gpu_of)
    monkeypatch.setattr(backends, "nccl_missing", lambda: None)
    backends.learn_node_gpus(OneNode(0, 2))
    assert backends._node_gpus == [None, ("GPU-1", "FakeGPU")]
    assert "cannot be read" in caplog.text
    assert backends.auto_device_backend() == ("mpi", "local rank 0 of this node without a GPU")


@pytest.mark.parametrize("gpus,ranks", [(1, 2), (2, 2)])
def test_the_wire_every_rank_must_agree_on(monkeypatch, gpus, ranks):
    """``wire`` (what the optimizer compares across ranks) for each backend, CPU and CUDA
    models: device and host payloads both count; auto follows the node (NCCL with a GPU per
    local rank, else MPI), and says why."""
    monkeypatch.setattr(backends, "nccl_missing", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(backends, "_node_ranks", ranks)
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


def test_a_cuda_aware_mpi_carrier_waits_for_the_device_before_every_verb(monkeypatch):
    """MPI reads and writes device memory outside every stream, so the CUDA-aware carrier waits
    for the device before each of the host carrier's verbs, a receive included (a kernel queued
    before it may still read the buffer it lands in). The verbs are enumerated from the host
    carrier, so a verb added there without a wait fails here."""
    verbs = [name for name, fn in vars(transport._HostMPI).items()
             if callable(fn) and not name.startswith("_")]
    assert {"allreduce_", "send", "recv", "exchange"} <= set(verbs)
    waited = []
    monkeypatch.setattr(transport, "device_ready", lambda: waited.append("wait"))
    for name in verbs:
        monkeypatch.setattr(transport._HostMPI, name,
                            lambda self, *args, name=name: waited.append(name))
    carrier = transport._DeviceMPI(FakeComm())
    for name in verbs:
        waited.clear()
        getattr(carrier, name)()
        assert waited == ["wait", name], f"_DeviceMPI.{name}: {waited}"


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


# a stall limit of its own: the default (600 s) is also torch's NCCL default
backend_choice_job = suite_job("gpu_backend_suite.py", timeout=120,
                               env={"BAGUA_MPI_RANKS_PER_NODE": "2",
                                    "BAGUA_MPI_STALL_ABORT_S": "321"})


@pytest.mark.parametrize("nprocs", [1, 3])
@pytest.mark.parametrize("check", list(gpu_backend_suite.CHECKS))
def test_backend_choice_and_nccl_bootstrap_over_mpi(check, nprocs):
    """The NCCL bootstrap over MPI and the backend's choice at init and wrap time, each check
    on its own, one job per world size (1, and 3 as a node of two ranks and one of one)."""
    assert_check_passed(backend_choice_job(nprocs), check)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_async_on_nccl_starts_an_exchange_without_a_host_wait_and_averages_the_new_snapshot():
    """On a GPU, one rank: ``async`` in lockstep on NCCL. A ~50 ms sleep queued before a step
    holds back the optimizer's update and the snapshot's copies behind it; the step must return
    well before that (the exchange thread's stream waits for the copies on the device, not the
    training thread on the host), and the model must end as plain SGD's, bit for bit: at one
    rank every exchange's delta is zero, unless the exchange read the buffer before the
    training thread's copies had landed (a stale snapshot gives a nonzero delta)."""
    import time

    import bagua_mpi as bm
    from bagua_mpi.algorithms import AsyncModelAverage

    bm.init(abort_on_exception=False)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 512).cuda()
        plain = torch.nn.Linear(512, 512).cuda()
        plain.load_state_dict(model.state_dict())
        opt = bm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            algorithm=AsyncModelAverage(sync_interval_ms=0, max_staleness=1), backend="nccl")
        reference = torch.optim.SGD(plain.parameters(), lr=0.1)
        x = torch.randn(64, 512, device="cuda")
        held = []
        for step in range(6):
            for net, optimizer in ((model, opt), (plain, reference)):
                optimizer.zero_grad()
                net(x).square().mean().backward()
            reference.step()
            torch.cuda.synchronize()
            time.sleep(0.05)   # the exchange started at the step before has ended
            torch.cuda._sleep(100_000_000)   # ~50 ms before this step's update
            began = time.perf_counter()
            opt.step()
            held.append(time.perf_counter() - began)
        torch.cuda.synchronize()
        opt.close()   # the last exchange applied, then the final average (of one rank)
        # steps 0 and 1 may wait for the exchange thread's first call (its NCCL group's setup)
        assert max(held[2:]) < 0.025, f"opt.step() held the caller {held} s"
        for mine, theirs in zip(model.parameters(), plain.parameters()):
            assert torch.equal(mine, theirs), "an exchange averaged a stale snapshot"
    finally:
        bm.shutdown()


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_gpu_of_names_the_physical_device_of_local_rank_mod_count():
    """On a real GPU: the id is the device's (the same for local ranks count apart), and the
    name is torch's."""
    count = torch.cuda.device_count()
    gpu_id, name = backends.gpu_of(0)
    assert gpu_id and name == torch.cuda.get_device_name(0)
    assert backends.gpu_of(count) == (gpu_id, name)
    if count > 1:
        assert backends.gpu_of(1)[0] != gpu_id


def test_the_models_gpus_replace_inits_mapping(monkeypatch, caplog):
    """At wrap time the node's ranks compare the GPUs their models are on. Ranks init mapped
    apart whose models share one GPU (moved to ``cuda`` without set_device) are warned about
    and ``auto`` takes MPI; CPU models leave init's mapping as it was."""
    monkeypatch.setattr(backends, "nccl_missing", lambda: None)
    apart = [("GPU-0", "FakeGPU"), ("GPU-1", "FakeGPU")]
    monkeypatch.setattr(backends, "_node_gpus", list(apart))
    backends.use_model_gpus([None, None])
    assert backends._node_gpus == apart and backends.auto_device_backend()[0] == "nccl"
    backends.use_model_gpus([("GPU-0", "FakeGPU"), ("GPU-0", "FakeGPU")])
    assert "local ranks 0-1 on one GPU (FakeGPU, GPU-0)" in caplog.text
    assert "torch.cuda.set_device(bm.local_rank() % torch.cuda.device_count())" in caplog.text
    name, why = backends.auto_device_backend()
    assert name == "mpi" and why.startswith("local ranks 0-1 on one GPU"), why
    caplog.clear()
    backends.use_model_gpus([("GPU-0", "FakeGPU"), ("GPU-0", "FakeGPU")])  # shared before too
    assert not caplog.text


def test_explicit_nccl_with_ranks_on_one_gpu_is_refused_on_every_rank():
    from bagua_mpi.optimizer import _refuse_shared_gpus
    _refuse_shared_gpus([{"gpus_shared": ""}, {"gpus_shared": ""}], "nccl")
    notes = [{"gpus_shared": ""}, {"gpus_shared": "local ranks 0-1 on one GPU (G, u)"}]
    with pytest.raises(backends.BackendUnavailableError,
                       match=r"backend='nccl': on the node of rank 1, local ranks 0-1 on one "
                             r"GPU \(G, u\), and NCCL refuses"):
        _refuse_shared_gpus(notes, "nccl")


def test_a_model_off_the_current_device_is_named_with_the_fix():
    assert backends.off_current_device(set(), None) == ""          # a CPU model
    assert backends.off_current_device({0}, 0) == ""
    assert backends.off_current_device({0, 1}, 1) == ""            # a model over two GPUs
    text = backends.off_current_device({3}, 0)
    assert text.startswith("the model is on cuda:3 but this thread's current CUDA device is "
                           "cuda:0; call torch.cuda.set_device(3) before wrapping"), text
    assert "cuda:1, cuda:2" in backends.off_current_device({2, 1}, 0)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_wrapping_a_model_on_another_gpu_than_the_current_one_warns(caplog):
    """On a machine with two GPUs, one rank: a model moved to cuda:1 while cuda:0 is current
    is named at wrap time, with the set_device line."""
    import bagua_mpi as bm
    bm.init(abort_on_exception=False)  # and shut down after: later files expect no runtime
    previous = torch.cuda.current_device()
    torch.cuda.set_device(0)
    try:
        model = torch.nn.Linear(4, 2).to("cuda:1")
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
        opt.close()
        assert "the model is on cuda:1 but this thread's current CUDA device is cuda:0" \
            in caplog.text
    finally:
        torch.cuda.set_device(previous)
        bm.shutdown()


def test_opt_backend_names_the_nccl_form(monkeypatch):
    """What ``opt.backend`` shows for a CUDA model: the NCCL form (``nccl_hierarchical`` was
    shown as ``nccl``), auto's answer after ``auto:``, MPI's device form, and host models'
    carriers."""
    monkeypatch.setattr(bcuda, "mpi_is_cuda_aware", lambda: False)
    monkeypatch.setattr(backends, "auto_backend", lambda: ("nccl", "stand-in"))
    monkeypatch.setattr(backends, "nccl_missing", lambda: None)  # as on a GPU with NCCL
    assert backends.describe("nccl", "cuda") == "nccl"
    assert backends.describe("nccl_hierarchical", "cuda") == "nccl_hierarchical"
    assert backends.describe("mpi", "cuda") == "mpi (pinned host staging)"
    assert backends.describe("gloo", "cpu") == "gloo"
    assert backends.describe("nccl_hierarchical", "cpu") == "mpi"
