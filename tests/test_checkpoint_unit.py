"""Single-process tests of bagua_mpi.checkpoint (MPI as a singleton; crash tests in
subprocesses that SIGKILL themselves inside a save)."""
import os
import random
import re
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

import bagua_mpi as bm
import bagua_mpi.checkpoint as ckpt
from bagua_mpi.checkpoint import format as fmt
from bagua_mpi.checkpoint import rng as rng_state
from bagua_mpi.checkpoint import rotation, trees
from bagua_mpi import preemption
from bagua_mpi.checkpoint.writer import PHASES, SCHEME_ENV
from mpi_harness import run_mpi_side_by_side


@pytest.fixture(scope="module", autouse=True)
def initialized():
    bm.init(abort_on_exception=False)
    yield
    bm.shutdown()


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_identical(a, b, where="root"):
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert bits(a) == bits(b), where
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert a == b, where


def tree_round_trip(tmp_path, obj):
    skeleton, leaves = trees.encode_tree(obj, "t")
    path = str(tmp_path / "tree.h5")
    with h5py.File(path, "w") as f:
        trees.write_tree(f, "t", skeleton, leaves)
    with h5py.File(path, "r") as f:
        for name, dset in f["t"].items():
            assert dset.fletcher32 and dset.chunks is not None, name
        return trees.read_tree(f["t"], path)


# -- format ------------------------------------------------------------------------------------

def every_dtype():
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                  torch.complex128):
        out[str(dtype)] = torch.randn(3, 5, generator=g).to(dtype)
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        out[str(dtype)] = torch.randint(-100 if dtype != torch.uint8 else 0, 100, (7,),
                                        generator=g, dtype=dtype)
    out["bool"] = torch.rand(9, generator=g) > 0.5
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32"):
        if hasattr(torch, name):
            out[name] = torch.arange(6, dtype=torch.uint8).view(getattr(torch, name)
                                                                ) if "float8" in name else \
                torch.arange(6, dtype=torch.int64).to(getattr(torch, name))
    return out


def test_tensors_round_trip_bit_exactly(tmp_path):
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, 3.0])
    special_bits = special.view(torch.int32)
    special_bits[5] = 0x7FC0_1234  # a NaN with a payload
    obj = {
        **every_dtype(),
        "special": special,
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    back = tree_round_trip(tmp_path, obj)
    obj["transposed"] = obj["transposed"].contiguous()
    obj["param"] = obj["param"].detach()
    assert_identical(obj, back)


def test_nested_structures_round_trip(tmp_path):
    obj = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)},
                  7: {"momentum_buffer": None}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 7], "foreach": None,
                          "name": "x", "nan": float("nan")}],
        (1, "a"): "tuple key", "__dunder": b"\x00\xff", "dtype": torch.float16,
        "np": np.arange(5, dtype=np.uint32), "np0": np.zeros((0, 2)),
        "scalars": [np.float32(1.5), np.int64(-3), True, 2 ** 70, -0.0],
    }
    assert_identical(obj, tree_round_trip(tmp_path, obj))


@pytest.mark.parametrize("bad, where", [
    ({"a": [1, object()]}, "t.a[1]"),
    ({"m": torch.nn.Linear(2, 2)}, "t.m"),
    ({"s": torch.eye(3).to_sparse()}, "t.s"),
    ({"o": np.array(["x"], dtype=object)}, "t.o"),
    ({frozenset(): 1}, "t"),
])
def test_unstorable_values_are_refused_with_their_path(bad, where):
    with pytest.raises(ckpt.CheckpointError, match=re.escape(where)):
        trees.encode_tree(bad, "t")


def test_rng_states_round_trip(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in the legacy state
    random.gauss(0, 1)
    state = tree_round_trip(tmp_path, rng_state.capture())
    want = (torch.rand(5), np.random.standard_normal(5), random.gauss(0, 1), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    rng_state.restore(state)
    got = (torch.rand(5), np.random.standard_normal(5), random.gauss(0, 1), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1])
    assert want[2:] == got[2:]


class FakeCudaGenerators:
    """torch.cuda's generator functions for a machine without a GPU: ``count`` devices, each
    with a state (a uint8 tensor) kept by index, and ``current`` the current one."""

    def __init__(self, monkeypatch, count, current):
        self.states = {i: torch.full((8,), i, dtype=torch.uint8) for i in range(count)}
        self.current = current

        def set_one(state, device):
            self.states[device] = state.clone()

        def set_all(states):
            assert len(states) == len(self.states)
            for i, state in enumerate(states):
                set_one(state, i)
        for name, fn in {"is_available": lambda: True, "is_initialized": lambda: True,
                         "device_count": lambda: len(self.states),
                         "current_device": lambda: self.current,
                         "get_rng_state_all": lambda: [self.states[i].clone()
                                                       for i in sorted(self.states)],
                         "get_rng_state": lambda device: self.states[device].clone(),
                         "set_rng_state_all": set_all, "set_rng_state": set_one}.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def values(self):
        return {i: int(state[0]) for i, state in self.states.items()}


@pytest.mark.parametrize("count,current,want,restored", [
    (4, 2, {0: 0, 1: 1, 2: 92, 3: 3}, True),    # the same GPUs: every generator by its index
    (1, 0, {0: 92}, True),                       # one visible now (bind_gpu.sh): the rank's own
    (4, 1, {0: 50, 1: 92, 2: 52, 3: 53}, True),  # another GPU current: it continues cuda:2's
])
def test_the_current_gpus_generator_continues_where_the_gpus_changed(tmp_path, monkeypatch,
                                                                     count, current, want,
                                                                     restored):
    """Saved on 4 visible GPUs with cuda:2 current (its generator advanced to 92): resumed on
    the same GPUs every state goes back by index; on other GPUs the current device's generator
    continues cuda:2's, where restoring by index would hand it a state never advanced (or skip
    them all, reporting a restore)."""
    saving = FakeCudaGenerators(monkeypatch, 4, 2)
    saving.states[2].fill_(92)
    state = tree_round_trip(tmp_path, rng_state.capture())
    resuming = FakeCudaGenerators(monkeypatch, count, current)
    for i in resuming.states:
        resuming.states[i].fill_(50 + i)
    assert rng_state.restore(state) is restored
    assert resuming.values() == want


def test_cuda_generators_that_cannot_continue_are_reported_not_restored(tmp_path, monkeypatch):
    """A tree from before ``cuda_current`` resumed on other GPUs, or any CUDA state where CUDA
    is missing: nothing is set and ``restore`` says so (``info.rng_restored`` False)."""
    FakeCudaGenerators(monkeypatch, 4, 2)
    state = rng_state.capture()
    del state["cuda_current"]
    resuming = FakeCudaGenerators(monkeypatch, 2, 0)
    assert rng_state.restore(state) is False and resuming.values() == {0: 0, 1: 1}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rng_state.restore(state) is False


# -- save / load in one process ----------------------------------------------------------------

def make(seed=0, algorithm="gradient_allreduce"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3),
                                torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = bm.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), algorithm=algorithm)
    return model, opt


def train(model, opt, steps):
    for _ in range(steps):
        x = torch.randn(10, 6) + torch.from_numpy(np.random.rand(10, 6).astype(np.float32))
        opt.zero_grad()
        (model(x).square().mean() * random.uniform(0.5, 1.5)).backward()
        opt.step()


def params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_save_load_restores_everything(tmp_path):
    model, opt = make()
    train(model, opt, 3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt.optimizer, T_max=10)
    train(model, opt, 1)
    sched.step()
    path = ckpt.save(str(tmp_path), model=model, optimizer=opt, step=4, epoch=0,
                     extras={"scheduler": sched.state_dict(), "note": "hi"},
                     rank_extras={"samples": torch.tensor([30])})
    assert path == str(tmp_path / "ckpt-0000000004.h5") and ckpt.latest(str(tmp_path)) == path
    want_model, want_opt = params(model), opt.state_dict()
    model2, opt2 = make(seed=1)
    info = ckpt.load(str(tmp_path), model=model2, optimizer=opt2)
    assert (info.step, info.epoch, info.world_size, info.write_scheme) == (4, 0, 1, "token")
    assert info.extras["note"] == "hi" and info.rng_restored and info.skipped == []
    assert_identical(info.rank_extras, {"samples": torch.tensor([30])})
    assert_identical(want_model, params(model2))
    assert_identical(want_opt, opt2.state_dict())
    assert opt2.steps == 4 and info.algorithm_state == "loaded"
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2.optimizer, T_max=10)
    sched2.load_state_dict(info.extras["scheduler"])
    assert sched2.state_dict() == sched.state_dict()
    opt.close()
    opt2.close()


@pytest.mark.parametrize("restore_rng", [True, False])
def test_exact_resume_in_one_process(tmp_path, restore_rng):
    """N+M steps == N steps, save, fresh objects, load, M steps (bitwise; RNGs matter)."""
    def seed():
        torch.manual_seed(11)
        np.random.seed(12)
        random.seed(13)

    seed()
    model, opt = make()
    train(model, opt, 7)
    reference = params(model)
    opt.close()
    seed()
    model, opt = make()
    train(model, opt, 4)
    ckpt.save(str(tmp_path), model=model, optimizer=opt, step=4)
    opt.close()
    torch.manual_seed(99)
    model, opt = make(seed=5)
    ckpt.load(str(tmp_path), model=model, optimizer=opt, restore_rng=restore_rng)
    train(model, opt, 3)
    same = all(torch.equal(reference[k], v) for k, v in params(model).items())
    assert same == restore_rng
    opt.close()


def channels_last_run(seed: int = 0):
    """A channels_last conv with a plain (unwrapped) fused AdamW, and its steps."""
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(conv.parameters(), lr=0.05, weight_decay=0.1, fused=True)

    def steps(start: int, stop: int) -> None:
        for step in range(start, stop):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(2, 3, 5, 5, generator=g).to(memory_format=torch.channels_last)
            opt.zero_grad()
            conv(x).square().mean().backward()
            opt.step()
    return conv, opt, steps


def assert_state_laid_out_as_params(opt) -> None:
    for p in opt.param_groups[0]["params"]:
        for key, value in opt.state[p].items():
            if value.shape == p.shape:
                assert value.stride() == p.stride(), (key, value.stride(), p.stride())


def test_plain_optimizer_state_gets_its_parameters_strides_back(tmp_path):
    """The file holds tensors row-major; fused AdamW on the CPU pairs a parameter with its
    moments by memory position, so a load that left them row-major resumed elsewhere."""
    conv, opt, steps = channels_last_run()
    steps(0, 5)
    reference = conv.weight.detach().clone()
    conv, opt, steps = channels_last_run()
    steps(0, 3)
    ckpt.save(str(tmp_path), model=conv, optimizer=opt, step=3)
    conv, opt, steps = channels_last_run(seed=1)
    ckpt.load(str(tmp_path), model=conv, optimizer=opt)
    assert not conv.weight.is_contiguous()
    assert_state_laid_out_as_params(opt)
    steps(3, 5)
    assert torch.equal(conv.weight, reference)


def test_wrapper_load_state_dict_lays_row_major_state_out_as_params():
    """``DistributedOptimizer.load_state_dict`` of a state dict held row-major (another tool's
    checkpoint, or one of the run before it turned channels_last on)."""
    conv, opt, steps = channels_last_run()
    steps(0, 2)
    saved = opt.state_dict()
    for entry in saved["state"].values():
        for key, value in entry.items():
            entry[key] = value.contiguous()
    conv2, inner, _ = channels_last_run(seed=1)
    wrapped = bm.DistributedOptimizer(inner, named_parameters=conv2.named_parameters())
    wrapped.load_state_dict(saved)
    assert_state_laid_out_as_params(inner)
    for p, q in zip(opt.param_groups[0]["params"], inner.param_groups[0]["params"]):
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], inner.state[q][key]), key
    wrapped.close()


def test_file_layout(tmp_path):
    model, opt = make()
    train(model, opt, 1)
    path = ckpt.save(str(tmp_path), model=model, optimizer=opt, step=1, extras={"a": 1})
    with open(path, "rb") as f:
        head = f.read(fmt.USERBLOCK_SIZE)
    assert head.startswith(b"BAGUA_MPI_CHECKPOINT\nformat_version 1\nsha256 ")
    with h5py.File(path, "r") as f:
        assert f.userblock_size == fmt.USERBLOCK_SIZE
        assert {k: f.attrs[k] for k in ("format", "format_version", "step", "world_size",
                                        "write_scheme")} == {
            "format": "bagua_mpi.checkpoint", "format_version": 1, "step": 1,
            "world_size": 1, "write_scheme": "token"}
        assert sorted(f) == ["extras", "meta", "model", "optimizer", "ranks"]
        assert sorted(f["ranks/0"]) == ["algorithm", "meta", "rng"]
        datasets = []
        f.visititems(lambda n, o: datasets.append(o) if isinstance(o, h5py.Dataset) else None)
        assert datasets and all(d.fletcher32 and d.chunks for d in datasets)
        weight = f["model/000000"]
        assert weight.attrs["path"] == "model.0.weight" and weight.shape == (8, 6)
    meta = ckpt.read_meta(path)
    assert meta["trees"] == {"model": "replicated", "optimizer": "replicated",
                             "extras": "replicated", "algorithm": "per_rank", "rng": "per_rank"}
    assert meta["algorithm"]["config"]["name"] == "gradient_allreduce"
    assert not meta["per_rank_algorithm_state"]
    opt.close()


def test_keep_last_n_latest_pointer_and_stale_temporaries(tmp_path):
    d = str(tmp_path)
    model = torch.nn.Linear(2, 2)
    stale = tmp_path / ".ckpt-0000000009.h5.tmp-0123abcd"
    stale.write_bytes(b"junk of a killed save")
    for step in (10, 20, 30, 40):
        ckpt.save(d, model=model, step=step, keep=2)
    assert not stale.exists()
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(d)] == [
        "ckpt-0000000040.h5", "ckpt-0000000030.h5"]
    assert (tmp_path / "latest").read_text() == "ckpt-0000000040.h5\n"
    # Resuming from 30 and saving 35 abandons the 40 of the old timeline.
    ckpt.save(d, model=model, step=35, keep=2)
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(d)] == [
        "ckpt-0000000035.h5", "ckpt-0000000030.h5"]
    assert not [n for n in os.listdir(d) if ".tmp-" in n]


def test_bad_arguments_raise_before_any_communication(tmp_path):
    with pytest.raises(ValueError, match="step"):
        ckpt.save(str(tmp_path), step=-1)
    with pytest.raises(ValueError, match="keep"):
        ckpt.save(str(tmp_path), step=1, keep=0)
    with pytest.raises(ckpt.CheckpointError, match=r"t\.x: cannot store"):
        ckpt.save(str(tmp_path), step=1, extras={"t": {"x": object()}})
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load(str(tmp_path / "nothing"))
    assert ckpt.latest(str(tmp_path)) is None


def test_load_refuses_another_model_and_another_algorithm(tmp_path):
    from bagua_mpi.algorithms import Algorithm, register
    from bagua_mpi.algorithms.base import AlgorithmImpl
    from dataclasses import dataclass

    @register
    @dataclass(frozen=True)
    class Other(Algorithm):
        name = "ckpt_unit_other"
        impl_class = AlgorithmImpl

    model, opt = make()
    train(model, opt, 1)
    ckpt.save(str(tmp_path), model=model, optimizer=opt, step=1)
    wider = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Dropout(0.3),
                                torch.nn.BatchNorm1d(9), torch.nn.Linear(9, 2))
    with pytest.raises(ckpt.CheckpointError, match="size mismatch for 0.weight"):
        ckpt.load(str(tmp_path), model=wider)
    _, other = make(algorithm="ckpt_unit_other")
    with pytest.raises(ckpt.CheckpointError, match="'gradient_allreduce', the optimizer runs "
                                                   "'ckpt_unit_other'"):
        ckpt.load(str(tmp_path), optimizer=other)
    opt.close()
    other.close()


def test_several_optimizers_by_name_round_trip(tmp_path):
    """A DistributedOptimizer and a plain torch optimizer (on another part of the model) saved
    by name come back into fresh ones, each with its own state; the file says which is which."""
    def build(seed):
        model, opt_a = make(seed=seed)
        head = torch.nn.Linear(2, 3)
        opt_b = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
        return torch.nn.ModuleDict({"body": model, "head": head}), opt_a, opt_b

    def run(models, opt_a, opt_b, steps):
        for _ in range(steps):
            opt_a.zero_grad()
            opt_b.zero_grad()
            models["head"](models["body"](torch.randn(10, 6))).square().mean().backward()
            opt_a.step()
            opt_b.step()

    models, opt_a, opt_b = build(0)
    run(models, opt_a, opt_b, 3)
    path = ckpt.save(str(tmp_path), model=models, optimizer={"b": opt_b, "a": opt_a}, step=3)
    meta = ckpt.read_meta(path)
    assert meta["algorithm"] is None and sorted(meta["optimizers"]) == ["a", "b"]
    assert meta["optimizers"]["a"]["algorithm"]["config"]["name"] == "gradient_allreduce"
    assert meta["optimizers"]["b"]["algorithm"] is None
    want = (params(models), opt_a.state_dict(), opt_b.state_dict())
    models2, opt_a2, opt_b2 = build(1)
    info = ckpt.load(path, model=models2, optimizer={"a": opt_a2, "b": opt_b2})
    assert info.algorithm_state == {"a": "loaded", "b": "none"}
    assert_identical(want, (params(models2), opt_a2.state_dict(), opt_b2.state_dict()))
    assert opt_a2.steps == 3
    with pytest.raises(ckpt.CheckpointError, match=r"holds the state of optimizers 'a', 'b' "
                                                   r"\(optimizer=\{...\}\); load\(\) was given "
                                                   r"one optimizer"):
        ckpt.load(path, optimizer=opt_a2)
    single = ckpt.save(str(tmp_path / "one"), model=models, optimizer=opt_a, step=3)
    with pytest.raises(ckpt.CheckpointError, match=r"holds the state of one optimizer"):
        ckpt.load(single, optimizer={"a": opt_a2})
    for opt in (opt_a, opt_a2):
        opt.close()


def test_bad_optimizer_arguments(tmp_path):
    model, opt = make()
    plain = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    cases = [({}, ValueError, "names no optimizer"),
             ({"m": model}, TypeError, r"optimizer\['m'\] must be a torch.optim.Optimizer"),
             ({"x": opt, "y": opt}, ValueError, r"optimizer\['x'\] and optimizer\['y'\] are "
                                                "the same optimizer"),
             ({1: plain}, TypeError, "non-empty strings"),
             (model, TypeError, "optimizer must be a torch.optim.Optimizer")]
    for bad, kind, pattern in cases:
        with pytest.raises(kind, match=pattern):
            ckpt.load(str(tmp_path), optimizer=bad)
        with pytest.raises(ckpt.CheckpointError, match="not saved: rank 0: .*" + pattern):
            ckpt.save(str(tmp_path), optimizer=bad, step=1)
    assert ckpt.latest(str(tmp_path)) is None
    opt.close()


# -- corruption --------------------------------------------------------------------------------

@pytest.fixture
def three_checkpoints(tmp_path):
    model, opt = make()
    paths = []
    for step in (1, 2, 3):
        train(model, opt, 1)
        paths.append(ckpt.save(str(tmp_path), model=model, optimizer=opt, step=step))
    yield str(tmp_path), paths
    opt.close()


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_byte_anywhere_is_detected(three_checkpoints, tmp_path):
    _, paths = three_checkpoints
    original = open(paths[2], "rb").read()
    size = len(original)
    offsets = sorted({0, 30, 100, 200, 511, 512, 600, size - 1}
                     | set(range(700, size - 1, max(1, size // 60))))
    victim = str(tmp_path / "victim.h5")
    for offset in offsets:
        with open(victim, "wb") as f:
            f.write(original)
        flip(victim, offset)
        with pytest.raises(ckpt.CheckpointCorruptError, match=re.escape(victim)):
            ckpt.verify(victim)


def test_fletcher32_locates_damage_without_the_seal(three_checkpoints):
    _, paths = three_checkpoints
    with h5py.File(paths[2], "r") as f:
        chunk = f["model/000000"].id.get_chunk_info(0)
    flip(paths[2], chunk.byte_offset + 3)
    with pytest.raises(ckpt.CheckpointCorruptError, match="/model"):
        ckpt.load(paths[2], model=make()[0], fallback=False, verify=False)


def test_sha256_placeholders_catch_damage_in_unfiltered_datasets(tmp_path):
    """The layout of the mpio scheme: contiguous datasets, digests in the tree's JSON."""
    skeleton, leaves = trees.encode_tree({"w": torch.arange(1000.0)}, "t")
    arrays = [leaf.array() for leaf in leaves]
    path = str(tmp_path / "unfiltered.h5")
    with h5py.File(path, "w") as f:
        group = f.create_group("t")
        for i, arr in enumerate(arrays):
            group.create_dataset(fmt.leaf_name(i), data=arr)
        fmt.write_json(group, "tree", fmt.with_digests(skeleton, arrays))
        offset = group["000000"].id.get_offset()
    with h5py.File(path, "r") as f:
        assert torch.equal(trees.read_tree(f["t"], path)["w"], torch.arange(1000.0))
    flip(path, offset + 10)
    with h5py.File(path, "r") as f:
        with pytest.raises(ckpt.CheckpointCorruptError, match="SHA-256 mismatch in /t/000000"):
            trees.read_tree(f["t"], path)


@pytest.mark.parametrize("keep_bytes", [0, 100, 512, 4000, -1])
def test_truncated_files_are_detected(three_checkpoints, keep_bytes):
    _, paths = three_checkpoints
    size = os.path.getsize(paths[2])
    os.truncate(paths[2], keep_bytes if keep_bytes >= 0 else size - 1)
    with pytest.raises(ckpt.CheckpointCorruptError, match=re.escape(paths[2])):
        ckpt.verify(paths[2])


def test_load_falls_back_to_the_previous_checkpoint(three_checkpoints, caplog):
    directory, paths = three_checkpoints
    model, _ = make()
    os.truncate(paths[2], os.path.getsize(paths[2]) // 2)
    flip(paths[1], os.path.getsize(paths[1]) - 10)
    with pytest.raises(ckpt.CheckpointCorruptError, match=re.escape(paths[2]) + ".*truncated"):
        ckpt.load(directory, model=model, fallback=False)
    info = ckpt.load(directory, model=model)
    assert info.step == 1 and [p for p, _ in info.skipped] == paths[:0:-1]
    assert "SHA-256 mismatch" in info.skipped[1][1]
    assert "skipping" in caplog.text
    flip(paths[0], 700)
    with pytest.raises(ckpt.CheckpointCorruptError, match="no loadable checkpoint"):
        ckpt.load(directory, model=model)


def test_unfinished_and_newer_files(three_checkpoints, tmp_path):
    _, paths = three_checkpoints
    raw = open(paths[2], "rb").read()
    unfinished = tmp_path / "unfinished.h5"
    unfinished.write_bytes(b"\0" * fmt.USERBLOCK_SIZE + raw[fmt.USERBLOCK_SIZE:])
    with pytest.raises(ckpt.CheckpointCorruptError, match="never finished"):
        ckpt.verify(str(unfinished))
    newer = tmp_path / "newer.h5"
    header = raw[:fmt.USERBLOCK_SIZE].replace(b"format_version 1", b"format_version 2")
    newer.write_bytes(header + raw[fmt.USERBLOCK_SIZE:])
    with pytest.raises(ckpt.CheckpointFormatError, match="format version 2"):
        ckpt.verify(str(newer))


def test_cli(three_checkpoints, capsys):
    from bagua_mpi.checkpoint.__main__ import main
    directory, paths = three_checkpoints
    assert main(["verify", directory]) == 0
    assert "OK " + paths[2] in capsys.readouterr().out
    flip(paths[2], 1000)
    assert main(["verify", paths[2]]) == 1
    assert "CheckpointCorruptError" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["info", "list", "verify"])
def test_cli_imports_no_mpi(three_checkpoints, command):
    """The command line inspects files on a login node: it must not initialize MPI (importing
    mpi4py.MPI does), and only ``verify``, which decodes the trees, may import torch."""
    directory, _ = three_checkpoints
    probe = ("import runpy, sys\n"
             f"sys.argv = ['bagua_mpi.checkpoint', {command!r}, {directory!r}]\n"
             "try:\n"
             "    runpy.run_module('bagua_mpi.checkpoint', run_name='__main__')\n"
             "except SystemExit as exc:\n"
             "    assert exc.code in (0, None), exc.code\n"
             "print('LOADED', *[m for m in ('mpi4py.MPI', 'torch', 'numba') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split("LOADED")[-1].split())
    assert loaded == ({"torch"} if command == "verify" else set()), done.stdout


# -- kill -9 inside a save ---------------------------------------------------------------------

EXPECTED_LATEST = {"before_prune": 2}  # every earlier phase leaves `latest` at step 1


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    """A 1-rank job per phase, each killed there in a directory of its own, run side by side
    (each is mostly its interpreter's start): ``{phase: (directory, result)}``."""
    dirs = {phase: str(tmp_path_factory.mktemp(f"killed_{phase}")) for phase in PHASES}
    results = run_mpi_side_by_side(
        {phase: ("checkpoint_suite.py", "crash", d, phase) for phase, d in dirs.items()}, 1,
        timeout=120)
    return {phase: (dirs[phase], results[phase]) for phase in PHASES}


@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_at_each_phase_leaves_a_loadable_checkpoint(killed_saves, phase):
    d, result = killed_saves[phase]
    assert result.returncode != 0 and "NOT KILLED" not in result.output, result.describe()
    assert f"SIGKILL at {phase.split('@')[0]} on rank 0" in result.output, result.describe()
    want = EXPECTED_LATEST.get(phase, 1)
    assert rotation.step_of(ckpt.latest(d)) == want
    for path in ckpt.list_checkpoints(d):
        ckpt.verify(path)  # every published file is complete
    published = {rotation.step_of(p) for p in ckpt.list_checkpoints(d)}
    assert published == ({1} if phase not in ("before_latest", "before_prune") else {1, 2})
    info = ckpt.load(d)  # the state itself is the suite's; integrity is what counts here
    assert info.step == want and not info.skipped


# -- write scheme, pre-emption ---------------------------------------------------------------------

def test_write_scheme_choice(monkeypatch):
    parallel = h5py.get_config().mpi
    assert ckpt.scheme() == ("mpio" if parallel else "token")
    monkeypatch.setenv(SCHEME_ENV, "token")
    assert ckpt.scheme() == "token"
    monkeypatch.setenv(SCHEME_ENV, "mpio")
    if not parallel:
        with pytest.raises(ckpt.CheckpointError, match="no MPI support"):
            ckpt.scheme()
    monkeypatch.setenv(SCHEME_ENV, "fast")
    with pytest.raises(ckpt.CheckpointError, match="auto, mpio or token"):
        ckpt.scheme()


def test_preemption_guard(monkeypatch):
    before = signal.getsignal(signal.SIGUSR1)
    guard = preemption.install(check_every=2)
    try:
        assert not guard.should_stop() and not guard.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)  # would terminate the process without the guard
        assert guard.requested_here and guard.received == signal.SIGUSR1
        assert not guard.should_stop()  # not a checking call
        assert guard.should_stop() and guard.should_stop()  # agreed, and it stays so
        monkeypatch.setattr(bm.runtime, "shutdown", lambda: None)
        with pytest.raises(SystemExit) as exited:
            guard.exit()
        assert exited.value.code == preemption.REQUEUE_EXIT_CODE == 75
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before
    with pytest.raises(ValueError, match="check_every"):
        preemption.install(check_every=0)
    with pytest.raises(ValueError, match="unknown signal"):
        preemption.install(signals=("SIGNOPE",))


def test_one_step_clock_shared_and_both_step_fields_kept():
    """The optimizer owns the step clock; the engine and the algorithm read the same object.
    The algorithm state keeps both step fields (``steps`` and ``state.step``) for old readers,
    and loading sets the one clock from ``steps``."""
    model, opt = make()
    clock = opt._step_clock()
    assert opt._engine.clock is clock and opt.impl.clock is clock
    train(model, opt, 3)
    assert opt.steps == opt.impl.step == opt._engine.iteration == 3
    state = opt.algorithm_state_dict()
    assert state["steps"] == 3 and state["state"]["step"] == 3
    _, fresh = make()
    fresh.load_algorithm_state_dict(state)
    assert fresh.steps == fresh.impl.step == fresh._engine.iteration == 3
    assert fresh._engine.clock is fresh.impl.clock is fresh._step_clock()
    old = dict(state, state={k: v for k, v in state["state"].items() if k != "step"})
    fresh.load_algorithm_state_dict(old)  # an impl state without its own step: "steps" counts
    assert fresh.steps == fresh.impl.step == 3
