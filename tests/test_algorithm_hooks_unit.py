"""Single-process tests of the algorithm framework's hooks (``algorithms/base.py``).

What the framework owns so that algorithm files do not: which ranks allocate exchange state
(``setup_buckets``/``init_exchange``), the per-tensor loops (``init_tensor``, ``reduce_tensor``),
state keyed by the names of a tensor's parameters (``tensor_state``), the parameter and bucket
slices of flat vectors, config validation (``Algorithm.__post_init__``), and what counts as the
dense exchange for the agreement check and ZeRO stage 2 (``exchanges_dense_gradients``).
"""
import dataclasses
import types

import pytest
import torch
from mpi4py import MPI

import bagua_mpi  # noqa: F401 - registers the built-in algorithms
import bagua_mpi.lgreco  # noqa: F401 - registers lgreco
from bagua_mpi.algorithms import (Algorithm, AlgorithmContext, AlgorithmImpl, GTopK, PowerSGD,
                                  QSGD, LowPrecisionDecentralized, OneBitAdam, create)
from bagua_mpi.algorithms.compressed import CompressedAllReduceImpl
from bagua_mpi.algorithms.state import names_key
from bagua_mpi.algorithms.validation import int_in_range
from bagua_mpi.compression import Compression
from bagua_mpi.engine import Bucket
from bagua_mpi.lgreco import LGreCo

SHAPES = {"layer1.weight": (8, 5), "layer1.bias": (8,), "layer2.weight": (3, 8)}


def make_impl(algorithm, *, leader=True, rank=0):
    """An impl on one process: every rank exchanges over COMM_SELF, or (``leader=False``) a
    hierarchical rank that is not its node's leader (``self.comm`` is None)."""
    topo = types.SimpleNamespace(comm=MPI.COMM_SELF, leaders=MPI.COMM_SELF if leader else None,
                                 size=1, rank=rank, local_size=1)
    ctx = AlgorithmContext(topo=topo, average=True, prescale=1.0, postscale=1.0,
                           hierarchical=not leader, compression=Compression.none,
                           param_numels={name: torch.Size(s).numel()
                                         for name, s in SHAPES.items()})
    return create(algorithm).reify(ctx)


def make_params():
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in SHAPES.values():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p.grad = torch.randn(shape, generator=gen)
        params.append(p)
    return list(SHAPES), params


def make_buckets(plan, flatten):
    names, params = make_params()
    return [Bucket(i, indices, params, names, flatten) for i, indices in enumerate(plan)]


# -- who allocates exchange state ------------------------------------------------------------------
class Recording(AlgorithmImpl):
    def __init__(self, algorithm, ctx):
        super().__init__(algorithm, ctx)
        self.calls = []

    def init_buckets(self, buckets):
        self.calls.append(("init_buckets", len(buckets)))

    def init_tensor(self, segments, device):
        self.calls.append(("init_tensor", tuple(name for name, _ in segments)))


@dataclasses.dataclass(frozen=True)
class RecordingAlgorithm(Algorithm):
    name = "hooks_unit_recording"
    impl_class = Recording


@pytest.mark.parametrize("flatten", [True, False])
def test_init_tensor_runs_per_communicated_tensor_on_exchanging_ranks_only(flatten):
    buckets = make_buckets([[0, 1], [2]], flatten)
    leader = make_impl(RecordingAlgorithm())
    leader.setup_buckets(buckets)
    expected = [("init_buckets", 2)] + [
        ("init_tensor", tuple(name for name, _ in segments))
        for bucket in buckets for segments in bucket.communication_segments()]
    assert leader.calls == expected
    assert len(expected) == (3 if flatten else 4)
    other = make_impl(RecordingAlgorithm(), leader=False)
    other.setup_buckets(buckets)
    assert other.calls == [("init_buckets", 2)]  # a node's other ranks never exchange


@pytest.mark.parametrize("algorithm", [
    QSGD(error_feedback=True), GTopK(density=0.5), PowerSGD(rank=1),
    LowPrecisionDecentralized(chunk=32), LGreCo(family="minmax"),
    LGreCo(family="topk", default=0.1), LGreCo(family="powersgd", default=1)],
    ids=lambda a: f"{a.name}-{getattr(a, 'family', '')}")
def test_exchange_state_lives_on_exchanging_ranks_only(algorithm):
    for leader in (True, False):
        impl = make_impl(algorithm, leader=leader, rank=0 if leader else 1)
        buckets = make_buckets([[0, 1], [2]], flatten=True)
        if impl.wants_flat_params:
            for bucket in buckets:
                bucket.flatten_params()
        impl.setup_buckets(buckets)
        allocated = impl.state.state_dict()
        assert bool(allocated) == leader, (leader, sorted(allocated))


def test_onebit_adam_allocates_its_momentum_errors_at_the_switch():
    impl = make_impl(OneBitAdam(warmup_steps=2, chunk=32))
    model = torch.nn.Linear(5, 3)
    names = ["weight", "bias"]
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 5)).sum().backward()
    optimizer.step()
    buckets = [Bucket(0, [0, 1], list(model.parameters()), names, True)]
    impl.setup_buckets(buckets)
    assert impl.state.state_dict() == {}  # warm-up: Adam's own state
    impl.step = 1
    impl.after_step(optimizer)  # the switch
    kinds = list(impl.state.state_dict())
    assert kinds == ["exp_avg", "exp_avg_sq", "worker_error", "server_error"]
    m, _ = impl.moments(buckets[0])
    assert torch.equal(m[:15], optimizer.state[model.weight]["exp_avg"].reshape(-1))
    assert torch.equal(m[15:], optimizer.state[model.bias]["exp_avg"].reshape(-1))


def test_onebit_adam_leaves_elements_unseen_in_the_warm_up_as_they_are(caplog):
    """An element with no gradient in the whole warm-up (variance 0) gets no compressed-stage
    step: the 1-bit momentum gives it its chunk's scale, which eps alone would divide (it took
    a 21.5M-parameter MLP to NaN within two steps); the others step as Adam's formula says."""
    impl = make_impl(OneBitAdam(warmup_steps=1, chunk=32))
    model = torch.nn.Linear(5, 3)
    names = ["weight", "bias"]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.ones(2, 5)
    x[:, 2] = 0            # column 2 of the weight gets no gradient in the warm-up
    model(x).sum().backward()
    optimizer.step()
    buckets = [Bucket(0, [0, 1], list(model.parameters()), names, True)]
    impl.setup_buckets(buckets)
    impl.step = 0
    with caplog.at_level("WARNING", logger="bagua_mpi.algorithms.onebit_adam"):
        impl.after_step(optimizer)  # the switch
    assert "3 parameter elements had no gradient in the 1 warm-up steps" in caplog.text
    m, v = impl.moments(buckets[0])
    m.fill_(0.5)           # what the 1-bit exchange gives every element of a chunk
    before = model.weight.detach().clone()
    impl.step = 1
    impl.optimizer_step(optimizer)
    after = model.weight.detach()
    assert torch.equal(after[:, 2], before[:, 2])
    seen = [0, 1, 3, 4]
    expected = before[:, seen] - 0.1 * 0.5 / (v[:15].view(3, 5)[:, seen].sqrt() + 1e-8)
    assert torch.equal(after[:, seen], expected)


def test_onebit_adam_resumed_from_a_checkpoint_with_zero_variance_freezes_it_too():
    """A checkpoint written before the rule above holds v = 0: resuming in the compressed stage
    applies the rule to it (the switch, where it is otherwise applied, does not run again)."""
    names, params = make_params()
    first = make_impl(OneBitAdam(warmup_steps=1, chunk=32))
    first.step = 5
    first.setup_buckets([Bucket(0, [0, 1, 2], params, names, True)])
    m, v = first.moments(first.buckets[0])
    m.fill_(0.5)
    v.fill_(4.0)
    v[2] = 0.0             # as an older version froze it
    saved = first.state.state_dict()
    resumed = make_impl(OneBitAdam(warmup_steps=1, chunk=32))
    resumed.state.load_state_dict(saved)
    resumed.step = 5       # in the compressed stage
    resumed.setup_buckets([Bucket(0, [0, 1, 2], params, names, True)])
    v = resumed.moments(resumed.buckets[0])[1]
    assert v[2] == float("inf") and torch.all(v[:2] == 4.0) and torch.all(v[3:] == 4.0)


# -- state keyed by the tensor's parameter names ---------------------------------------------------
def test_tensor_state_follows_the_parameters_not_the_bucket():
    impl = make_impl(GTopK(density=0.5))
    first = make_buckets([[0, 1], [2]], flatten=False)
    second = make_buckets([[2], [1], [0]], flatten=False)
    impl.setup_buckets(first)
    by_names = {names_key(s): impl.residual(s, "cpu")
                for b in first for s in b.communication_segments()}
    for bucket in second:
        for segments in bucket.communication_segments():
            assert impl.residual(segments, "cpu") is by_names[names_key(segments)]
    assert len(impl.state.vectors) == 3


def test_loading_state_replaces_what_the_run_had():
    """Loading into an impl that has stepped (an elastic restore, a roll-back to an earlier
    checkpoint) leaves nothing of its own: a vector the loaded state lacks is zeroed in place
    (its holder keeps it), a per-parameter tensor it lacks is made afresh at its next use, and
    one it has takes the loaded values. A state that does not fit is refused before anything
    changes."""
    impl = make_impl(GTopK(density=0.5))
    buckets = make_buckets([[0, 1], [2]], flatten=False)
    impl.setup_buckets(buckets)
    segments = buckets[0].communication_segments()[0]
    residual = impl.residual(segments, "cpu")
    residual.fill_(3.0)
    made = []
    q = impl.state.tensor("q", "layer2.weight", lambda: made.append(1) or torch.ones(3, 2))
    q.fill_(5.0)
    saved = torch.full((3, 2), 7.0)
    impl.load_state_dict({"step": 4, "tensors": {"q": {"layer2.weight": saved}}, "extra": {}})
    assert impl.residual(segments, "cpu") is residual and not residual.any()
    again = impl.state.tensor("q", "layer2.weight", lambda: made.append(1) or torch.ones(3, 2))
    assert again is not q and torch.equal(again, saved) and made == [1, 1]
    impl.load_state_dict({"step": 0, "tensors": {}, "extra": {}})
    fresh = impl.state.tensor("q", "layer2.weight", lambda: torch.ones(3, 2))
    assert torch.equal(fresh, torch.ones(3, 2)) and impl.step == 0
    # a state that does not fit (another PowerSGD rank: Q of another width) changes nothing
    residual.fill_(3.0)
    with pytest.raises(ValueError, match="has shape"):
        impl.load_state_dict({"step": 9, "tensors": {"residual": {}, "q": {
            "layer2.weight": torch.zeros(3, 5)}}, "extra": {}})
    assert bool((residual == 3.0).all()) and impl.state.tensors["q"]["layer2.weight"] is fresh
    assert impl.step == 0


def test_stage_two_reduce_scatter_keys_the_worker_error_as_the_stage_zero_exchange():
    impl = make_impl(QSGD(error_feedback=True))
    bucket = make_buckets([[0, 1, 2]], flatten=True)[0]
    impl.setup_buckets([bucket])
    [segments] = bucket.communication_segments()
    worker, server = impl.error_state(segments)
    assert server is not None
    impl.zero_stage = 2
    again, none = impl.error_state(bucket.segments(), bucket.device)
    assert again is worker and none is None


# -- slices of flat vectors ------------------------------------------------------------------------
def test_param_and_bucket_slices_follow_the_flat_layout():
    impl = make_impl("gradient_allreduce")
    buckets = make_buckets([[0, 1], [2]], flatten=True)
    impl.setup_buckets(buckets)
    whole = torch.arange(sum(b.numel for b in buckets), dtype=torch.float32)
    pieces = list(impl.bucket_slices(whole))
    assert [b for b, _ in pieces] == buckets
    assert torch.equal(torch.cat([piece for _, piece in pieces]), whole)
    bucket, vector = pieces[0]
    doubled = vector * 2
    seen = list(impl.param_slices(bucket, vector, doubled))
    assert [p for p, *_ in seen] == bucket.params
    start = 0
    for p, one, two in seen:  # shaped as the parameter, over its range of the vector
        assert one.shape == p.shape and one.stride() == p.stride()
        assert torch.equal(one.reshape(-1), vector[start:start + p.numel()])
        assert torch.equal(two, 2 * one)
        start += p.numel()
    assert start == bucket.numel


# -- the default per-tensor exchange ---------------------------------------------------------------
def test_default_reduce_bucket_reduces_each_communicated_tensor():
    seen = []

    class PerTensor(AlgorithmImpl):
        def reduce_tensor(self, grad, segments, step):
            seen.append((grad.data_ptr(), tuple(name for name, _ in segments), step))

    impl = PerTensor(None, make_impl("gradient_allreduce").ctx)
    for flatten in (True, False):
        seen.clear()
        bucket = make_buckets([[0, 1, 2]], flatten)[0]
        impl.reduce_bucket(bucket, step=3)
        assert seen == [(g.data_ptr(), tuple(n for n, _ in s), 3) for g, s in
                        zip(bucket.communication_tensors(), bucket.communication_segments())]


# -- what counts as the dense exchange --------------------------------------------------------------
class TensorOnly(AlgorithmImpl):
    def reduce_tensor(self, grad, segments, step):
        grad.mul_(1.0)


class TensorAndScatter(TensorOnly):
    def reduce_scatter_bucket(self, bucket, step, out):
        self.dense_reduce_scatter_(bucket, out)


@dataclasses.dataclass(frozen=True)
class TensorOnlyAlgorithm(Algorithm):
    name = "hooks_unit_tensor_only"
    impl_class = TensorOnly


@dataclasses.dataclass(frozen=True)
class TensorAndScatterAlgorithm(Algorithm):
    name = "hooks_unit_tensor_and_scatter"
    impl_class = TensorAndScatter


def test_overriding_reduce_tensor_is_not_the_dense_exchange():
    assert AlgorithmImpl.exchanges_dense_gradients()
    assert not TensorOnly.exchanges_dense_gradients()
    assert not CompressedAllReduceImpl.exchanges_dense_gradients()
    assert not PowerSGD.impl_class.exchanges_dense_gradients()


def test_zero_stage_two_needs_a_reduce_scatter_from_a_reduce_tensor_override():
    assert "no reduce-scatter form" in TensorOnlyAlgorithm().sharding_refusal_reason(2)
    assert TensorOnlyAlgorithm().sharding_refusal_reason(1) is None
    assert TensorAndScatterAlgorithm().sharding_refusal_reason(2) is None
    assert "no reduce-scatter form" in GTopK().sharding_refusal_reason(2)
    assert QSGD().sharding_refusal_reason(2) is None


# -- configs validate in the base --------------------------------------------------------------------
def test_configs_validate_through_the_base_post_init():
    @dataclasses.dataclass(frozen=True)
    class Small(Algorithm):
        name = "hooks_unit_small"
        width: int = 2
        validators = {"width": int_in_range(1, 4)}

    assert Small(width=4).width == 4
    with pytest.raises(ValueError, match=r"width=5 .*\[1, 4\]"):
        Small(width=5)

    @dataclasses.dataclass(frozen=True)
    class Forgetful(Algorithm):
        name = "hooks_unit_forgetful"
        width: int = 2

    with pytest.raises(TypeError, match=r"no validator for \['width'\]"):
        Forgetful()

    @dataclasses.dataclass(frozen=True)
    class Fieldless(Algorithm):  # the tests' own algorithms: no fields, no table
        name = "hooks_unit_fieldless"

    assert Fieldless().config() == {"name": "hooks_unit_fieldless"}


def test_no_builtin_config_repeats_the_base_post_init():
    from bagua_mpi.algorithms.registry import _REGISTRY
    for cls in _REGISTRY.values():
        if cls.__module__.startswith("bagua_mpi."):
            assert cls.__post_init__ is Algorithm.__post_init__, cls.__name__


def test_hyperparameter_digest_summary_and_differences():
    """What the first bucket's agreement check carries (``algorithms/hyperparameters.py``): a
    digest that changes with any hyperparameter and not with the parameters; on a mismatch,
    summaries with plain values as they are, a CPU scalar tensor as its float, a device tensor
    by name only (reading it would wait for the device), anything else by its type; and
    ``differences`` naming each value that differs, with the ranks holding it."""
    from bagua_mpi.algorithms import hyperparameters as hp
    p = torch.nn.Parameter(torch.zeros(2))
    groups = [{"params": [p], "lr": torch.tensor(0.5), "betas": [0.9, 0.99], "foreach": None,
               "weights": torch.zeros(3), "hook": len},
              {"params": [], "lr": 0.25, "nesterov": True}]
    assert hp.summary(groups) == (
        (0, (("lr", 0.5), ("betas", (0.9, 0.99)), ("foreach", None),
             ("weights", "tensor(3,) on cpu"), ("hook", "builtin_function_or_method"))),
        (1, (("lr", 0.25), ("nesterov", True))))

    def adam(**changes):
        group = {"params": [p], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False,
                 "foreach": None, "capturable": torch.tensor(1.0)}
        return [{**group, **changes}]
    base = hp.digest(adam())
    assert 0 <= base < 2 ** 62 and hp.digest(adam(params=[])) == base
    assert hp.digest(adam(param_names=["weight"])) == base  # torch's names: not compared here
    for change in ({"lr": 1e-3 + 1e-18}, {"lr": 2e-3}, {"betas": (0.9, 0.99)}, {"eps": None},
                   {"amsgrad": True}, {"foreach": False}, {"capturable": torch.tensor(2.0)},
                   {"extra": 0}):
        assert hp.digest(adam(**change)) != base, change
    assert hp.digest(adam() * 2) != base
    assert hp.digest(adam(seed=10 ** 400)) != hp.digest(adam(seed=10 ** 400 + 1))

    def signature(digest):
        return ("bucket", ("index", 0), (hp.FIELD, digest))
    assert not hp.digests_differ([signature(1), signature(1)])
    assert hp.digests_differ([signature(1), signature(2)])
    assert not hp.digests_differ([signature(1), ("bucket", ("index", 1), ("frozen", ()))])
    assert not hp.digests_differ([])

    def summary(lr, momentum=0.9, groups=1):
        return hp.summary([{"params": [], "lr": lr, "momentum": momentum}] * groups)
    assert hp.differences([summary(0.1), summary(0.1), summary(0.1)]) == []
    assert hp.differences([summary(0.1), summary(0.05), summary(0.1, 0.5)]) == [
        "param group 0 'lr': 0.1 on ranks 0,2; 0.05 on rank 1",
        "param group 0 'momentum': 0.9 on ranks 0-1; 0.5 on rank 2"]
    assert hp.differences([summary(0.1), summary(0.1, groups=2), summary(0.1)]) == [
        "param group 1: on rank 1 only"]
    assert hp.differences([summary(0.1), ((0, (("lr", 0.1),)),)]) == [
        "param group 0 'momentum': 0.9 on rank 0; (no such key) on rank 1"]


def test_async_average_adds_its_float32_delta_to_a_16_bit_model_rounding_once():
    """Asynchronous averaging applies the exchange's float32 delta (average - snapshot) to a
    bfloat16 model rounded once, as one float32 sum: the delta cast to bfloat16 first rounded
    twice, and ~1% of elements missed the average (the ranks then disagreed)."""
    from types import SimpleNamespace

    from bagua_mpi.algorithms.async_average import AsyncAverageImpl
    gen = torch.Generator().manual_seed(5)
    model = torch.randn(20000, generator=gen).to(torch.bfloat16)
    average = model.float() + torch.randn(20000, generator=gen) * 0.01
    delta = average - model.float()
    flat = model.clone()
    bucket = SimpleNamespace(flat_param=flat)
    stand_in = SimpleNamespace(bucket_slices=lambda d: [(bucket, d)],
                               _crosses_to_host=lambda: False, exchanges=0)
    AsyncAverageImpl._apply_delta(stand_in, delta)
    assert torch.equal(flat, (model.float() + delta).to(torch.bfloat16))
    assert stand_in.exchanges == 1
