"""Single-process tests of the algorithm configs' field validation and of random-stream seeds.

The registry walk covers every algorithm the library registers: a field added without a
declared validator, or a config that does not run ``validate_fields``, fails here.
"""
import dataclasses
import math
import types

import numpy as np
import pytest
import torch
from mpi4py import MPI

import bagua_mpi  # noqa: F401 - registers the built-in algorithms
import bagua_mpi.lgreco  # noqa: F401 - registers lgreco
import numba_kernels as nk
from bagua_mpi.algorithms import (AlgorithmContext, ByteGrad, LowPrecisionDecentralized,
                                  OneBitAdam, QSGD, create)
from bagua_mpi.algorithms import compressed
from bagua_mpi.algorithms.registry import _REGISTRY
from bagua_mpi.algorithms.validation import (MAX_SEED, declared_validators, int_in_range,
                                             validate_fields)
from bagua_mpi.compression import Compression
from bagua_mpi.engine import Bucket
from bagua_mpi.primitives.codecs import call_seed
from mpi_harness import library_algorithms
from numba_kernels.errors import KernelParameterError

# Values every field of a type must refuse, whatever its range. Every int field of the built-in
# algorithms is a count, a size or a seed, so -1 is out of range for all of them.
BAD_VALUES_BY_TYPE = {
    "int": ("4", 2.5, 4.0, True, None, -1),
    "float": ("0.5", True, None, math.nan, math.inf, -1.0),
    "bool": (1, 0, "True", None),
    "str": (1, None, "", "no-such-choice"),
    "int | None": ("4", 2.5, True, -1),
    "float | None": ("0.5", True, math.nan, math.inf),
}

# the library's own (other unit tests register algorithms of theirs in the pytest process)
ALGORITHMS = sorted((name, _REGISTRY[name]) for name in library_algorithms())


def fields_of(cls):
    return [(cls, f) for f in dataclasses.fields(cls)]


ALL_FIELDS = [pair for _, cls in ALGORITHMS for pair in fields_of(cls)]


def field_id(pair):
    cls, f = pair
    return f"{cls.name}.{f.name}"


def test_the_walk_sees_every_registered_algorithm():
    assert {name for name, _ in ALGORITHMS} == library_algorithms()
    assert {"qsgd", "bytegrad", "low_precision_decentralized", "lgreco"} <= library_algorithms()


@pytest.mark.parametrize("name,cls", ALGORITHMS, ids=[n for n, _ in ALGORITHMS])
def test_every_field_has_exactly_one_declared_validator_and_defaults_construct(name, cls):
    declared = set(declared_validators(cls))
    fields = {f.name for f in dataclasses.fields(cls)}
    assert declared == fields, (f"{cls.__name__}.validators must name exactly its fields: "
                                f"missing {fields - declared}, extra {declared - fields}")
    default = create(name)
    assert isinstance(default, cls)
    for f in dataclasses.fields(cls):  # validation keeps the defaults as they are
        assert getattr(default, f.name) == f.default, f.name


@pytest.mark.parametrize("pair", ALL_FIELDS, ids=[field_id(p) for p in ALL_FIELDS])
def test_bad_values_raise_value_error_naming_algorithm_field_and_value(pair):
    cls, f = pair
    assert f.type in BAD_VALUES_BY_TYPE, (f"{cls.__name__}.{f.name}: add bad values for fields "
                                          f"of type {f.type!r} to BAD_VALUES_BY_TYPE")
    rule = declared_validators(cls)[f.name].for_config(cls())
    bad = BAD_VALUES_BY_TYPE[f.type] + rule.outside
    assert rule.outside, f"{cls.__name__}.{f.name}: its validator names no out-of-range value"
    for value in bad:
        with pytest.raises(ValueError) as caught:
            cls(**{f.name: value})
        message = str(caught.value)
        assert f"{f.name}={value!r}" in message, message
        assert repr(cls.name) in message and "must be" in message, message


@pytest.mark.parametrize("pair", ALL_FIELDS, ids=[field_id(p) for p in ALL_FIELDS])
def test_the_edges_of_each_range_are_accepted(pair):
    cls, f = pair
    rule = declared_validators(cls)[f.name].for_config(cls())
    for value in rule.edges:
        assert getattr(cls(**{f.name: value}), f.name) == value


def test_named_regressions_fail_at_construction():
    with pytest.raises(ValueError, match=r"levels=500 .* \[1, 127\]"):
        QSGD(levels=500)
    with pytest.raises(ValueError, match=r"communication_interval=0 .*>= 1"):
        LowPrecisionDecentralized(communication_interval=0)
    with pytest.raises(ValueError, match=r"bits=9 .*\[1, 8\]"):
        ByteGrad(bits=9)
    with pytest.raises(ValueError, match=r"chunk=100 .*multiple of 32"):
        ByteGrad(chunk=100)
    with pytest.raises(ValueError, match=r"chunk=1000 .*multiple of 32"):
        OneBitAdam(chunk=1000)
    with pytest.raises(ValueError, match="seed=-1"):
        QSGD(seed=-1)
    with pytest.raises(ValueError, match=r"communication_interval=0"):
        create("decentralized", communication_interval=0)
    with pytest.raises(ValueError, match="the minmax family's default"):
        create("lgreco", family="minmax", default=9)


def test_canonical_values_are_stored():
    assert type(QSGD(levels=np.int64(16)).levels) is int  # JSON-serialisable config
    assert QSGD(seed=MAX_SEED).seed == MAX_SEED
    with pytest.raises(ValueError):
        QSGD(seed=MAX_SEED + 1)
    lgreco = create("lgreco", family="powersgd", default=2.0)
    assert lgreco.default == 2 and type(lgreco.default) is int
    assert create("lgreco", family="topk", default=0.05).default == 0.05
    assert create("lgreco", family="topk", default=None).default is None
    assert create("async", sync_interval_ms=0).sync_interval_ms == 0  # ints for reals


def kernel_accepts(make) -> bool:
    try:
        make()
    except KernelParameterError:
        return False
    return True


@pytest.mark.parametrize("cls,field,fmt", [
    (QSGD, "levels", lambda v: nk.QSGDFormat(64, levels=v)),
    (QSGD, "chunk", lambda v: nk.QSGDFormat(64, chunk=v)),
    (ByteGrad, "bits", lambda v: nk.MinMaxFormat(64, bits=v)),
    (ByteGrad, "chunk", lambda v: nk.MinMaxFormat(64, chunk=v)),
    (LowPrecisionDecentralized, "bits", lambda v: nk.MinMaxFormat(64, bits=v)),
    (LowPrecisionDecentralized, "chunk", lambda v: nk.MinMaxFormat(64, chunk=v)),
    (OneBitAdam, "chunk", lambda v: nk.OneBitFormat(64, chunk=v)),
])
def test_codec_limits_agree_with_the_wire_formats(cls, field, fmt):
    """What the config accepts at its edges, the kernels' formats accept; what it refuses just
    outside, they refuse too: a config that constructs never fails on the comm thread."""
    rule = declared_validators(cls)[field]
    for value in rule.edges:
        assert kernel_accepts(lambda: fmt(value)), (field, value)
    for value in rule.outside:
        assert not kernel_accepts(lambda: fmt(value)), (field, value)


def test_a_field_without_validator_is_a_programming_error():
    @dataclasses.dataclass(frozen=True)
    class Forgetful:
        name = "forgetful"
        known: int = 1
        forgotten: int = 2
        validators = {"known": int_in_range(0, 3)}

        def __post_init__(self):
            validate_fields(self)

    with pytest.raises(TypeError, match=r"no validator for \['forgotten'\]"):
        Forgetful()


# -- seeds follow the parameters, not the bucket ---------------------------------------------------
def make_impl(algorithm):
    topo = types.SimpleNamespace(comm=MPI.COMM_SELF, leaders=None, size=1, rank=0)
    ctx = AlgorithmContext(topo=topo, average=True, prescale=1.0, postscale=1.0,
                           hierarchical=False, compression=Compression.none,
                           param_numels={})
    return algorithm.reify(ctx)


def make_params():
    gen = torch.Generator().manual_seed(0)
    shapes = {"layer1.weight": (8, 5), "layer1.bias": (8,), "layer2.weight": (3, 8)}
    params = []
    for shape in shapes.values():
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=gen)
        params.append(p)
    return list(shapes), params


def seeds_by_tensor(monkeypatch, plan, flatten):
    """{names a communicated tensor covers: its seed} of one QSGD step with buckets ``plan``."""
    recorded = []

    class Recorder:
        """Stands in for a flattened bucket's exchange plan: records the seeds of its run."""

        def __init__(self, segments, n):
            pass

        def run(self, comm, *, seeds, **kwargs):
            recorded.extend(seeds)

    # an unflattened bucket's gradients go one by one, a flattened bucket through its plan
    monkeypatch.setattr(compressed, "compressed_allreduce_",
                        lambda grad, comm, codec, *, seed, **kwargs: recorded.append(seed))
    monkeypatch.setattr(compressed, "CompressedExchange", Recorder)
    names, params = make_params()
    impl = make_impl(QSGD(seed=3))
    covered = []
    for i, indices in enumerate(plan):
        bucket = Bucket(i, indices, params, names, flatten)
        impl.reduce_bucket(bucket, step=5)
        covered += [tuple(name for name, _ in segments)
                    for segments in bucket.communication_segments()]
    assert len(covered) == len(recorded)
    return dict(zip(covered, recorded))


def test_rebucketing_keeps_each_tensors_seed(monkeypatch):
    # per-parameter tensors (no flattening) in two different bucketings
    a = seeds_by_tensor(monkeypatch, [[0, 1], [2]], flatten=False)
    b = seeds_by_tensor(monkeypatch, [[2], [0], [1]], flatten=False)
    assert a == b and len(a) == 3
    # the same flattened bucket at another bucket position
    c = seeds_by_tensor(monkeypatch, [[2], [0, 1]], flatten=True)
    d = seeds_by_tensor(monkeypatch, [[0, 1], [2]], flatten=True)
    assert c == d
    assert c[("layer2.weight",)] == a[("layer2.weight",)]
    assert len(set(a.values())) == 3  # different parameters, different streams


def test_rebucketed_qsgd_gives_the_same_bits_on_one_rank():
    """End to end on COMM_SELF: QSGD's stochastic rounding of each parameter is the same in two
    bucketings whose communicated tensors are the same."""
    results = []
    for plan in ([[0, 1], [2]], [[2], [1], [0]]):
        names, params = make_params()
        impl = make_impl(QSGD(seed=3, chunk=16))
        for i, indices in enumerate(plan):
            impl.reduce_bucket(Bucket(i, indices, params, names, flatten=False), step=7)
        results.append([p.grad.clone() for p in params])
    for first, second in zip(*results):
        assert torch.equal(first, second)
    names, params = make_params()
    assert not torch.equal(results[0][0], params[0].grad)  # quantization did happen


def test_call_seed_counts_strings_stably():
    # CRC-32 of the UTF-8 name, not hash(): the same number in every process (fixed here)
    assert call_seed(0, 5, "layer1.weight") == call_seed(0, 5, "layer1.weight")
    assert call_seed(0, 5, "layer1.weight") != call_seed(0, 5, "layer1.bias")
    assert call_seed(0, 5, "a") == call_seed(0, 5, 0xE8B7BE43)  # crc32(b"a")
    assert call_seed(1, 2, 3) == call_seed(1, 2, 3)  # integer parts as before
