"""Single-process tests of bucketing, flattening and the algorithm registry."""
import pytest
import torch

import bagua_mpi as bm
from bagua_mpi.algorithms import create, names
from bagua_mpi.compression import Compression
from bagua_mpi.engine import Bucket, plan_buckets


@pytest.fixture
def initialized():
    bm.init(abort_on_exception=False)
    yield
    bm.shutdown()


def test_plan_buckets_follows_order_and_budget():
    params = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64),
              torch.zeros(1)]
    # 40-byte float32 tensors, budget 100 bytes: [1,0] fit (80), 2 (120 bytes) alone, dtype splits
    assert plan_buckets(params, [1, 0, 2, 3, 4], 100) == [[1, 0], [2], [3], [4]]
    assert plan_buckets(params, [4, 0, 1], 10_000) == [[4, 0, 1]]
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(params, [0], 0)


def test_plan_buckets_joins_a_tiny_bucket_to_the_next_parameter():
    # an MLP's reversed order: small last layer, one tensor over the budget, then the rest
    small, huge, bias, weight = (torch.zeros(40_970), torch.zeros(16_781_312), torch.zeros(4096),
                                 torch.zeros(4_194_304))
    budget = 25 * 1024 * 1024
    # 160 KiB alone would be a bucket of its own; under 1 MiB it takes the 64 MiB tensor along
    assert plan_buckets([small, huge, bias, weight], [0, 1, 2, 3], budget) == [[0, 1], [2, 3]]
    # from 1 MiB on, the budget decides again
    assert plan_buckets([torch.zeros(300_000), huge], [0, 1], budget) == [[0], [1]]
    # small budgets scale the floor down to 1/16: 100 bytes of a 1600-byte budget
    assert plan_buckets([torch.zeros(5), torch.zeros(400)], [0, 1], 1600) == [[0, 1]]
    assert plan_buckets([torch.zeros(30), torch.zeros(400)], [0, 1], 1600) == [[0], [1]]


def test_plan_buckets_puts_what_may_be_viewed_as_complex_first():
    """Complex parameters, and real ones whose last dimension is 2 (a model may call
    torch.view_as_complex on them), lead their bucket in the given order, so each starts at an
    even offset: after flatten_params the views still work."""
    params = [torch.zeros(3), torch.zeros(4, 2), torch.zeros(5), torch.zeros(2, dtype=torch.cfloat),
              torch.zeros(2, 3)]
    assert plan_buckets(params, [0, 1, 2, 3, 4], 10_000) == [[1, 3, 0, 2, 4]]
    bucket = Bucket(0, [1, 3, 0, 2, 4], params, [f"p{i}" for i in range(5)], flatten=True)
    bucket.flatten_params()
    assert bucket.offsets[:2] == [0, 8]
    torch.view_as_complex(params[1])  # raised for an odd storage offset
    assert params[3].is_complex() and params[3].data_ptr() == bucket.flat_param[8:].data_ptr()


def test_bucket_flattening_makes_grads_views_and_reabsorbs():
    a = torch.nn.Parameter(torch.ones(2, 3))
    b = torch.nn.Parameter(torch.ones(4))
    a.grad = torch.full((2, 3), 2.0)
    bucket = Bucket(0, [0, 1], [a, b], ["a", "b"], flatten=True)
    assert bucket.flat_grad.tolist()[:6] == [2.0] * 6  # existing gradient copied in
    assert a.grad.data_ptr() == bucket.flat_grad.data_ptr()
    assert b.grad.data_ptr() == bucket.flat_grad.data_ptr() + 6 * 4  # every grad is a view
    b.grad = None  # as after zero_grad(set_to_none=True) when b then gets no gradient
    assert bucket.fill_missing_grads() == [1]  # b: zero gradient, a view again
    assert b.grad.data_ptr() == bucket.flat_grad.data_ptr() + 6 * 4
    a.grad = torch.full((2, 3), 5.0)  # what autograd does after zero_grad(set_to_none=True)
    bucket.absorb_grad(0)
    assert a.grad.data_ptr() == bucket.flat_grad.data_ptr()
    assert bucket.flat_grad[:6].tolist() == [5.0] * 6
    flat = bucket.flatten_params()
    a.data.mul_(3)
    assert flat[:6].tolist() == [3.0] * 6 and flat.numel() == 10


def test_registry_lists_valid_names_on_typo():
    assert "gradient_allreduce" in names()
    with pytest.raises(ValueError, match="valid names: .*gradient_allreduce"):
        create("gradient_allreduc")
    with pytest.raises(TypeError):
        create(42)
    algo = create("gradient_allreduce")
    assert create(algo) is algo and algo.config() == {"name": "gradient_allreduce"}


def test_compression_parsing():
    assert Compression.parse(None) is Compression.none
    assert Compression.parse("fp16").wire_dtype == torch.float16

    class FP16Compressor:  # Horovod's class, by name
        pass
    assert Compression.parse(FP16Compressor) is Compression.fp16
    with pytest.raises(ValueError, match="fp16, bf16"):
        Compression.parse("int8")
    t, ctx = Compression.bf16.compress(torch.ones(2))
    assert t.dtype == torch.bfloat16 and Compression.bf16.decompress(t, ctx).dtype == torch.float32


def test_wrapper_validates_arguments(initialized):
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        bm.DistributedOptimizer(model)
    with pytest.raises(ValueError, match="backward_passes_per_step .* got 0"):
        bm.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="Average or Sum"):
        bm.DistributedOptimizer(sgd, op=bm.Max)
    with pytest.raises(ValueError, match="only applies with op=Average"):
        bm.DistributedOptimizer(sgd, op=bm.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="parameters were not named"):
        bm.DistributedOptimizer(sgd, named_parameters=[("w", model.weight)])
    with pytest.raises(ValueError, match="valid names"):
        bm.DistributedOptimizer(sgd, algorithm="nope")


def test_wrapper_forwards_and_works_with_lr_scheduler(initialized):
    model = torch.nn.Linear(3, 2)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5),
                                  named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is opt.optimizer.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.125
    assert set(opt.state_dict()) == {"state", "param_groups"}
    state = opt.algorithm_state_dict()
    assert state["steps"] == 3 and state["config"]["name"] == "gradient_allreduce"
    opt.load_algorithm_state_dict(state)
    opt.close()


def test_overlap_policy_needs_a_spare_core_on_cpu(monkeypatch):
    """overlap=None: on for CUDA models; for CPU models only with a core beyond torch's threads."""
    from types import SimpleNamespace

    from bagua_mpi.engine import policy

    topo = SimpleNamespace(local_size=2)
    cpu = [torch.zeros(3)]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(policy, "cores_per_rank", lambda local_size: 1.0)
    assert policy.auto_overlap(cpu, topo) is False  # 2 ranks on 2 cores: no spare core
    monkeypatch.setattr(policy, "cores_per_rank", lambda local_size: 2.0)
    assert policy.auto_overlap(cpu, topo) is True
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert policy.auto_overlap(cpu, topo) is False  # torch's two threads use both
    cuda_like = [SimpleNamespace(is_cuda=True)]
    assert policy.auto_overlap(cuda_like, topo) is True


def test_cores_per_rank_uses_the_binding_when_the_launcher_bound_the_rank(monkeypatch):
    from bagua_mpi.engine import policy

    monkeypatch.setattr(policy.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(policy.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert policy.cores_per_rank(4) == 4.0  # unbound: the node's cores shared by its ranks
    monkeypatch.setattr(policy.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert policy.cores_per_rank(4) == 3.0  # bound to three cores: those are its own


def test_plan_buckets_keeps_one_open_bucket_per_dtype():
    """A bfloat16 model with float32 norms alternates dtypes at every layer: each dtype fills
    its own bucket (two here, where closing at every change made one per layer), closed
    against its own budget, and the buckets come in the order they complete."""
    params = []
    for _ in range(12):
        params += [torch.zeros(256, 256, dtype=torch.bfloat16), torch.zeros(256)]
    order = list(range(len(params)))[::-1]   # readiness: the last layer's norm first
    sixteen = [i for i in order if params[i].dtype == torch.bfloat16]
    norms = [i for i in order if params[i].dtype == torch.float32]
    # the first layer's matrix is ready last, after the first layer's norm
    assert plan_buckets(params, order, 25 * 1024 * 1024) == [norms, sixteen]
    # a budget of five bfloat16 matrices: the bfloat16 buckets close in turn, the norms'
    # when the first layer's norm is ready
    five = 5 * 256 * 256 * 2
    assert plan_buckets(params, order, five) == [sixteen[:5], sixteen[5:10], norms,
                                                 sixteen[10:]]
