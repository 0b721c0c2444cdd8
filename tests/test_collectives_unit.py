"""Single-process checks of the collectives package's plumbing (MPI as a singleton): the
per-call agreement-check switch and the NCCL-or-MPI choice of the allreduces, which the
multi-rank suites cannot see from outside."""
import numpy as np
import pytest
import torch

from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi import backends, consistency
from bagua_mpi.collectives import _allreduce, _allreduce_backends, _core, _group_movement


@pytest.fixture
def initialized():
    bm.init(abort_on_exception=False)
    switch = consistency.enabled()
    yield
    consistency.set_enabled(switch)
    bm.shutdown()


@pytest.fixture
def verify_calls(monkeypatch):
    """The signatures the agreement check was run for."""
    seen = []
    real = consistency.verify

    def counting(comm, signature, join=None):
        seen.append(signature[0])
        return real(comm, signature, join)

    monkeypatch.setattr(consistency, "verify", counting)
    return seen


@pytest.mark.parametrize("switch", [True, False])
@pytest.mark.parametrize("check", [None, True, False])
def test_check_overrides_the_switch_for_one_call(initialized, verify_calls, switch, check):
    bm.set_consistency_check(switch)
    wanted = switch if check is None else check
    assert _core.check_wanted(check) is wanted
    x = [torch.ones(3), torch.ones(2, dtype=torch.float64)]
    calls = [
        lambda: bm.grouped_allreduce(x, op=bm.Sum, check=check),
        lambda: bm.grouped_allreduce_([t.clone() for t in x], op=bm.Sum, check=check),
        lambda: bm.synchronize(bm.grouped_allreduce_async(x, op=bm.Sum, check=check)),
        lambda: bm.synchronize(bm.grouped_allreduce_async_([t.clone() for t in x], op=bm.Sum,
                                                           check=check)),
        lambda: bm.allreduce(x[0], bm.Sum, check=check),  # the fast path
        lambda: bm.allreduce(x[0], bm.Sum, postscale_factor=2.0, check=check),  # the general
        # differentiable (a tensor that requires grad): the forward's allreduce, then the
        # backward's, each under this call's check
        lambda: bm.allreduce(x[0].clone().requires_grad_(), bm.Sum, check=check),
        lambda: bm.grouped_allreduce([t.clone().requires_grad_() for t in x], op=bm.Sum,
                                     check=check),
    ]
    for call in calls:
        verify_calls.clear()
        out = call()
        assert len(verify_calls) == (1 if wanted else 0), verify_calls
        assert out is not None
        outs = out if isinstance(out, list) else [out]
        if outs[0].requires_grad:
            verify_calls.clear()
            sum(t.sum() for t in outs).backward()
            assert len(verify_calls) == (1 if wanted else 0), ("backward", verify_calls)
    got = bm.grouped_allreduce(x, op=bm.Sum, compression=bm.Compression.fp16, check=check)
    assert [t.dtype for t in got] == [torch.float32, torch.float64]


class FakeCudaTensor:
    is_cuda = True


def test_nccl_is_chosen_for_cuda_tensors_on_the_library_communicator(initialized,
                                                                      monkeypatch):
    asked = []
    monkeypatch.setattr(_allreduce_backends.transport, "uses_nccl",
                        lambda tensor, backend=None: asked.append(backend) or True)
    topo = bm.runtime.get().topo
    assert _allreduce_backends.uses_nccl_allreduce(FakeCudaTensor(), topo, "nccl")
    assert asked == ["nccl"]
    assert _allreduce_backends.reducer_for(FakeCudaTensor(), topo, [("float32", MPI.SUM)]) \
        is _allreduce_backends.nccl_allreduce_
    # a process set's topology asks the same question; host tensors stay on MPI unasked
    assert _allreduce_backends.uses_nccl_allreduce(FakeCudaTensor(), object())
    asked.clear()
    assert _allreduce_backends.reducer_for(torch.ones(1), topo, [("float32", MPI.SUM)]) \
        is _allreduce_backends.mpi_allreduce_
    assert asked == []


@pytest.mark.parametrize("dtype,op", [(torch.int16, bm.Sum), (torch.bool, bm.Max),
                                      (torch.bool, bm.Min)])
@pytest.mark.parametrize("grouped", [False, True])
def test_an_allreduce_nccl_cannot_reduce_takes_mpi_on_the_nccl_backend(initialized, monkeypatch,
                                                                       dtype, op, grouped):
    """NCCL has no int16 and no logical reduction (torch raises ``TypeError`` and the library
    ``BackendError``), where MPI reduces both: such an allreduce, or a group holding one such
    tensor beside float32 ones, stays on MPI under the NCCL backend and gives MPI's result;
    a float32 group still takes NCCL."""
    monkeypatch.setattr(_allreduce_backends.transport, "uses_nccl",
                        lambda tensor, backend=None: True)
    picked = []
    real = _allreduce.reducer_for

    def recording(tensor, topo, reductions):
        picked.append(real(tensor.as_subclass(CudaLooking), topo, reductions))
        return _allreduce_backends.mpi_allreduce_   # the host tensors below take MPI to run

    monkeypatch.setattr(_allreduce, "reducer_for", recording)
    x = (torch.arange(6) % 3 == 0) if dtype is torch.bool else torch.arange(6, dtype=dtype)
    if grouped:
        got = bm.grouped_allreduce([torch.ones(3), x], op=op)[1]
        bm.grouped_allreduce([torch.ones(3), torch.ones(2)], op=op)
        assert picked == [_allreduce_backends.mpi_allreduce_,
                          _allreduce_backends.nccl_allreduce_]
    else:
        got = bm.allreduce(x, op=op, name="not the fast path")
        assert picked == [_allreduce_backends.mpi_allreduce_]
    want = x if dtype is torch.bool else x * bm.size()
    assert torch.equal(got, want)


class CudaLooking(torch.Tensor):
    """A host tensor that says it is on a GPU, for the route choice only."""
    is_cuda = True


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_data_movement_takes_a_process_group_where_the_transport_would(initialized,
                                                                        monkeypatch, backend):
    """``group_wire`` follows the transport's carrier: a CUDA tensor where the device carrier
    is NCCL (not where it is MPI), a host torch tensor under gloo; never a NumPy array. The
    signature names the library only off MPI."""
    monkeypatch.setattr(backends, "_default", backend)
    topo = bm.runtime.get().topo
    host = torch.ones(2)
    wire = _group_movement.group_wire(host, topo)
    assert (wire is not None) == (backend == "gloo")
    assert _group_movement.wire_field(wire, host) == ((("wire", "gloo"),) if wire else ())
    assert _group_movement.group_wire(host.numpy(), topo) is None
    device = torch.ones(2).as_subclass(CudaLooking)
    for carrier, routed in (("nccl", True), ("mpi_device", False), ("mpi_staged", False)):
        monkeypatch.setattr(backends, "device_carrier", lambda name, c=carrier: c)
        wire = _group_movement.group_wire(device, topo)
        assert (wire is not None) == routed, carrier
        assert _group_movement.wire_field(wire, device) == ((("wire", "nccl"),) if routed
                                                            else ())


def test_a_reducescatter_the_libraries_cannot_reduce_stays_on_mpi():
    assert _group_movement.reduction_name("float32", MPI.SUM) == "sum"
    assert _group_movement.reduction_name("int8", MPI.PROD) == "product"
    assert _group_movement.reduction_name("int16", MPI.SUM) is None  # no int16 in NCCL
    assert _group_movement.reduction_name("bool", MPI.LAND) is None
    assert _group_movement.reduction_name("int32", MPI.BAND) is None


@pytest.mark.parametrize("grouped", [False, True])
def test_allreduce_and_grouped_allreduce_share_the_chooser(initialized, monkeypatch, grouped):
    """Both reduce through whatever ``reducer_for`` picks (NCCL itself needs a GPU:
    tests/gpu)."""
    used = []

    def recording(topo, buf, mop, hierarchical):
        used.append(tuple(buf.shape))
        _allreduce_backends.mpi_allreduce_(topo, buf, mop, hierarchical)

    monkeypatch.setattr(_allreduce, "reducer_for", lambda tensor, topo, reductions: recording)
    x = torch.arange(4.0)
    if grouped:
        got = bm.grouped_allreduce([x, x[:2]], op=bm.Sum)
        assert used == [(6,)]  # one fused message
        torch.testing.assert_close(got[1], x[:2])
    else:
        got = bm.allreduce(x, bm.Sum, postscale_factor=2.0)  # not the fast path
        assert used == [(4,)]
        torch.testing.assert_close(got, 2 * x)


def test_backward_under_create_graph_stays_differentiable(initialized):
    """A backward's own collectives take the differentiable version when the gradient requires
    grad, so second derivatives flow through them (here: d2/dx2 of sum(op(x*x)^2) = 12 x^2 on
    one rank)."""
    collectives = [lambda v: bm.allreduce(v, bm.Sum), bm.allgather, bm.broadcast, bm.alltoall,
                   lambda v: bm.reducescatter(v, bm.Sum),
                   lambda v: bm.grouped_allreduce([v], op=bm.Sum)[0],
                   lambda v: bm.grouped_allgather([v])[0],
                   lambda v: bm.grouped_reducescatter([v], bm.Sum)[0]]
    for op in collectives:
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        grad, = torch.autograd.grad((op(x * x) ** 2).sum(), x, create_graph=True)
        second, = torch.autograd.grad(grad.sum(), x)
        torch.testing.assert_close(grad.detach(), 4 * x.detach() ** 3)
        torch.testing.assert_close(second, 12 * x.detach() ** 2)


GROUPS = {  # dtypes of a grouped call's tensors, cycled: one wire dtype, or several mixed
    "float32": ["float32"],
    "float16": ["float16"],
    "mixed": ["float32", "float16", "bfloat16", "int64"],
}


@pytest.mark.parametrize("op", ["Sum", "Average", "Adasum"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_grouped_allreduce_launches_do_not_grow_with_its_tensors(initialized, op, group):
    """A grouped allreduce dispatches as many operations that compute or copy (each a kernel
    launch or more on a GPU) for 64 tensors as for 4 of each dtype: one cat and at most one cast
    per wire dtype to fuse them, one cast and one foreach copy per dtype to hand back the
    results. (Counted at world size 1, where the reduction itself moves nothing: what is
    counted is the fusing around it. Adasum takes floating tensors only.)"""
    from dispatch_count import DispatchCount

    dtypes = [d for d in GROUPS[group] if op != "Adasum" or d != "int64"]
    counted = {}
    for per_dtype in (4, 64):
        tensors = [torch.arange(i, i + 2048 // per_dtype).to(getattr(torch, dt))
                   for i in range(per_dtype) for dt in dtypes]
        with DispatchCount() as count:
            got = bm.grouped_allreduce(tensors, op=getattr(bm, op))
        counted[per_dtype] = count.launches
        for t, g in zip(tensors, got):
            assert g.dtype == t.dtype and torch.equal(g, t), f"{op} of one rank changed {t}"
    assert counted[64] == counted[4], f"operations by tensors per dtype: {counted}"


def test_received_splits_are_int32_unless_a_split_passes_its_range():
    """alltoall's received splits: int32 as Horovod's, int64 (not a wrapped negative count,
    which the backward pass would refuse on one rank alone) from 2^31 rows."""
    from bagua_mpi.collectives._movement import splits_tensor
    small = splits_tensor(np.array([3, 0, 2**31 - 1], np.int64))
    assert small.dtype == torch.int32 and small.tolist() == [3, 0, 2**31 - 1]
    large = splits_tensor(np.array([2**31 + 16, 0], np.int64))
    assert large.dtype == torch.int64 and large.tolist() == [2**31 + 16, 0]
