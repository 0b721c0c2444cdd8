"""Backend selection (MPI / NCCL) and its errors, and the payload staging's reuse and counting,
on a machine without a GPU. The NCCL collectives themselves run in ``tests/gpu/run.sh``."""
import numpy as np
import pytest
import torch

from bagua_mpi import backends
from bagua_mpi import cuda as bcuda
from bagua_mpi.accounting import staging
from bagua_mpi.exceptions import BaguaMPIError


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(backends.ENV, raising=False)
    backends.reset()
    yield
    backends.reset()
    bcuda.set_cuda_aware(None)


def test_default_is_mpi_and_env_and_init_choose(monkeypatch):
    assert backends.resolve() == "mpi"
    monkeypatch.setenv(backends.ENV, "NCCL")
    assert backends.resolve() == "nccl"
    assert backends.resolve("mpi") == "mpi"  # an explicit choice (per optimizer) wins


@pytest.mark.parametrize("bad", ["gloo", "", 3])
def test_unknown_backend_names_what_is_valid(bad, monkeypatch):
    if bad == "":
        monkeypatch.setenv(backends.ENV, "ncl")
        from bagua_mpi.exceptions import ConfigError
        with pytest.raises(ConfigError, match="BAGUA_MPI_BACKEND='ncl'.*nccl"):
            backends.resolve()
        return
    with pytest.raises(backends.BackendError, match="valid: mpi, nccl, nccl_hierarchical"):
        backends.resolve(bad)
    assert issubclass(backends.BackendError, BaguaMPIError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no GPU is present")
@pytest.mark.parametrize("name", ["nccl", "nccl_hierarchical"])
def test_nccl_without_gpu_is_a_clear_error_not_a_fallback(name):
    with pytest.raises(backends.BackendUnavailableError, match="needs a CUDA GPU"):
        backends.set_default(name)
    assert backends.resolve() == "mpi"  # the failed choice left nothing behind
    assert issubclass(backends.BackendUnavailableError, BaguaMPIError)


def test_nccl_missing_from_torch_is_named(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(backends.BackendUnavailableError, match="needs NCCL.*is_nccl_available"):
        backends.check_available("nccl")


def test_nccl_allreduce_refuses_ops_it_cannot_reduce():
    with pytest.raises(backends.BackendError, match="op 'bitwise_or' has no NCCL reduction"):
        backends.allreduce_(torch.zeros(1), None, "nccl", op="bitwise_or")


def test_cpu_tensors_always_go_through_mpi(monkeypatch):
    monkeypatch.setenv(backends.ENV, "nccl")
    assert not backends.uses_nccl(torch.zeros(3))  # NCCL cannot read host memory


def test_device_tensor_with_nccl_chosen_but_unavailable_raises(monkeypatch):
    class FakeCuda:
        is_cuda = True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(backends.ENV, "nccl")
    with pytest.raises(backends.BackendUnavailableError):
        backends.uses_nccl(FakeCuda())
    monkeypatch.setenv(backends.ENV, "mpi")
    assert not backends.uses_nccl(FakeCuda())


class FakeComm:
    """An allreduce of one rank that doubles the data (so the copy back is visible)."""

    def __init__(self):
        self.seen = []

    def Allreduce(self, send, recv, op=None):
        from mpi4py import MPI
        self.seen.append(type(recv))
        if send is MPI.IN_PLACE:
            recv *= 2
        else:
            recv[...] = send * 2


def test_payload_staging_reuses_pool_buffers_and_counts_payload_bytes():
    bcuda.set_cuda_aware(False)
    comm = FakeComm()
    allocations = None
    for step in range(4):
        payload = torch.arange(100 - step, dtype=torch.float32)  # same or smaller each step
        staging.reset()
        bcuda.payload_collective(lambda s, r: comm.Allreduce(s, r), payload, payload,
                                 ("test", "p"))
        assert torch.equal(payload, 2 * torch.arange(100 - step, dtype=torch.float32))
        snap = staging.snapshot()
        assert snap["d2h_bytes"] == payload.nbytes and snap["h2d_bytes"] == payload.nbytes
        assert snap["dense_d2h_bytes"] == 0  # a payload, not a dense tensor
        assert comm.seen[-1] is np.ndarray  # MPI got the host (pool) buffer
        if allocations is None:
            allocations = bcuda.pinned_pool.allocations
        assert bcuda.pinned_pool.allocations == allocations, "a buffer allocated per step"
    bigger = torch.ones(1000)
    bcuda.payload_collective(lambda s, r: comm.Allreduce(s, r), bigger, bigger, ("test", "p"))
    assert bcuda.pinned_pool.allocations == allocations + 1  # grown once, then reused
    assert torch.equal(bigger, torch.full((1000,), 2.0))


def test_pool_views_are_independent_per_key():
    a = bcuda.pinned_pool.get(("k", 1), 16)
    b = bcuda.pinned_pool.get(("k", 2), 16)
    a[:] = 1
    b[:] = 2
    assert (a == 1).all() and bcuda.pinned_pool.get(("k", 1), 8).base is not None


def test_dense_staging_is_counted_as_dense():
    staging.reset()
    staging.d2h(4096, dense=True)
    staging.d2h(100)
    snap = staging.snapshot()
    assert snap == {"d2h_bytes": 4196, "h2d_bytes": 0, "d2h_copies": 2, "largest_d2h": 4096,
                    "dense_d2h_bytes": 4096}


@pytest.mark.parametrize("nprocs", [1, 3])
def test_nccl_bootstrap_over_mpi_meets_in_one_store(nprocs):
    from mpi_harness import assert_mpi_ok, run_mpi
    assert_mpi_ok(run_mpi("gpu_backend_suite.py", nprocs, env={"BAGUA_MPI_RANKS_PER_NODE": "2"},
                          timeout=120), f"NCCL bootstrap over MPI OK on {nprocs} ranks")


def test_async_exchange_buffers_follow_the_model_only_when_mpi_reads_the_device(monkeypatch):
    """async keeps its snapshot/allreduce/delta on the model's GPU with a CUDA-aware MPI, and in
    host memory otherwise (a CPU model always on the host)."""
    from bagua_mpi import cuda as cuda_support
    from bagua_mpi.algorithms.async_average import exchange_device

    gpu = torch.device("cuda", 1)
    monkeypatch.setattr(cuda_support, "mpi_is_cuda_aware", lambda: True)
    assert exchange_device(gpu) == gpu
    assert exchange_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(cuda_support, "mpi_is_cuda_aware", lambda: False)
    assert exchange_device(gpu) == torch.device("cpu")
