"""ZeRO stages 1 and 2 (``DistributedOptimizer(zero_stage=)``) under a real mpiexec.

The oracle is a single-process run of the same model on the combined batch: each rank trains
on its rows of one global batch of ``GLOBAL_ROWS`` (divisible by 1-4 ranks), so the averaged
gradient is the global batch's at every world size and stage 0, 1 and 2 must all follow the
reference trajectory. The model's parameters (odd sizes, two param groups with their own
hyperparameters) and a small bucket budget give several buckets whose slices are uneven (the
last ranks' slices are short or empty). One line per check (``checks.py``).

Checkpoint phases (``--phase save|resume``, see tests/test_zero_mpi.py) cross world sizes and
stages and compare with the uninterrupted reference to 1e-6 (float64 model).
"""
import argparse
import logging
import sys
import warnings

import numpy as np
import torch

import bagua_mpi as bm
from bagua_mpi.algorithms import UnsupportedOptionError
from checks import run_checks
from short_runs import PerTensorSGD

GLOBAL_ROWS, STEPS = 12, 5
BUCKET_MB = 0.0002  # ~210 bytes: several buckets of a few parameters each


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(7, 13)
        self.mid = torch.nn.Linear(13, 5)
        self.out = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(77 + step)
    x = torch.randn(GLOBAL_ROWS, 7, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL_ROWS, 3, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def rows_of(rank: int, size: int) -> slice:
    per = GLOBAL_ROWS // size
    return slice(rank * per, (rank + 1) * per)


def new_model(dtype=torch.float32) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def new_base(kind: str, model: Net) -> torch.optim.Optimizer:
    """Two groups with their own hyperparameters: sharding must keep each piece in its group."""
    groups = [{"params": list(model.inp.parameters()) + list(model.out.parameters())},
              {"params": list(model.mid.parameters()), "lr": 0.02, "weight_decay": 0.01}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    return torch.optim.AdamW(groups, lr=0.01)


def reference(kind: str, steps: int, dtype=torch.float32, schedule: bool = True) -> Net:
    model = new_model(dtype)
    opt = new_base(kind, model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for step in range(steps):
        x, y = batch(step, dtype)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if schedule:
            scheduler.step()
    return model


def distributed_step(model, opt, step: int, dtype=torch.float32) -> None:
    x, y = batch(step, dtype)
    rows = rows_of(bm.rank(), bm.size())
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    opt.step()


def train(kind: str, stage: int, steps: int = STEPS, **options):
    model = new_model()
    opt = bm.DistributedOptimizer(new_base(kind, model), named_parameters=model.named_parameters(),
                                  bucket_size_mb=BUCKET_MB, zero_stage=stage, **options)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # on the wrapper
    for step in range(steps):
        distributed_step(model, opt, step)
        scheduler.step()
    return model, opt


def assert_close_models(model, expected, rtol: float, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=rtol,
                                   msg=lambda m: f"{what}: {name}: {m}")


def make_trajectory_check(kind: str):
    def check(rank, size):
        """Stages 0, 1 and 2 follow the single-process reference on the combined batch (to
        1e-5), with an LR scheduler stepping the wrapper, and all ranks end identical."""
        expected = reference(kind, STEPS)
        for stage in (0, 1, 2):
            model, opt = train(kind, stage)
            assert len(opt.buckets) >= 3, opt.buckets  # several buckets, so several slices
            assert_close_models(model, expected, 1e-5, f"{kind} zero_stage={stage}")
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            everyone = bm.allgather(flat.unsqueeze(0))
            assert torch.equal(everyone, flat.expand_as(everyone)), f"stage {stage}: ranks differ"
            opt.close()
    return check


def check_users_optimizer_hooks_and_scheduler(rank, size):
    """Step hooks and an LR scheduler on the user's optimizer, both made before wrapping (as
    scripts that build the optimizer and its schedule together do): at stages 1 and 2 its own
    ``step`` is not called, yet the pre-hook runs once a step, the post-hook sees the gathered
    parameters (an EMA of the weights, as the single-process run's own hook keeps it), and the
    scheduler does not warn that the optimizer never stepped."""
    def hooked(model, opt):
        calls, ema = [0], [None]

        def pre(optimizer, args, kwargs):
            calls[0] += 1

        def post(optimizer, args, kwargs):
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            ema[0] = flat.clone() if ema[0] is None else 0.5 * ema[0] + 0.5 * flat
        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
        return calls, ema

    model = new_model()
    opt = new_base("adamw", model)
    _, expected_ema = hooked(model, opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        scheduler.step()
    expected = model
    for stage in (0, 1, 2):
        model = new_model()
        base = new_base("adamw", model)
        calls, ema = hooked(model, base)
        scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=3, gamma=0.5)
        opt = bm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                      bucket_size_mb=BUCKET_MB, zero_stage=stage)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
            for step in range(STEPS):
                distributed_step(model, opt, step)
                scheduler.step()
        assert calls[0] == STEPS, f"stage {stage}: the pre-hook ran {calls[0]} times"
        torch.testing.assert_close(ema[0], expected_ema[0], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"stage {stage}: the post-hook's EMA: {m}")
        assert_close_models(model, expected, 1e-5, f"zero_stage={stage}")
        opt.close()
    return 0


def check_hierarchical(rank, size):
    """Two levels (run with BAGUA_MPI_RANKS_PER_NODE=2): stage 1 and 2 with hierarchical=True
    follow the reference, and the slices are owned node block by node block."""
    topo = bm.runtime.get().topo
    if topo.local_size * topo.cross_size != size or bm.allreduce(
            torch.tensor([float(topo.local_size)]), op=bm.Min).item() != topo.local_size:
        return  # uneven nodes: refused (check_refusals)
    expected = reference("adam", STEPS)
    for stage in (1, 2):
        model, opt = train("adam", stage, hierarchical=True)
        assert_close_models(model, expected, 1e-5, f"hierarchical zero_stage={stage}")
        assert opt._sharded.index == topo.local_rank * topo.cross_size + topo.cross_rank
        opt.close()


def check_uneven_slices(rank, size):
    """The buckets really are cut unevenly (so the checks above cover uneven slices)."""
    model, opt = train("sgd", 1, steps=1)
    uneven = [b for b in opt.buckets if b.numel % size]
    assert size == 1 or uneven, [(b.numel, size) for b in opt.buckets]
    opt.close()


def check_state_is_sharded(rank, size):
    """Optimizer-state bytes per rank are 1/n of stage 0's (within the padding of the slices);
    at stage 2, gradient bytes per rank are the slices only once the step is done."""
    full = {}
    for stage in (0, 1, 2):
        model, opt = train("adam", stage, steps=2)
        stats = opt.memory_stats()
        full[stage] = stats
        numel = sum(b.numel for b in opt.buckets)
        padded = sum(b.part * size for b in opt.buckets)
        if stage:
            mine = sum(min(b.part, max(0, b.numel - rank * b.part)) for b in opt.buckets)
            # exp_avg and exp_avg_sq of this rank's elements (plus Adam's scalar steps)
            assert 8 * mine <= stats["optimizer_state_bytes"] <= 8 * mine + 64 * len(
                opt.buckets) * 4, (stats, mine)
            total = bm.allreduce(torch.tensor([stats["optimizer_state_bytes"]],
                                              dtype=torch.float64), op=bm.Sum)
            assert abs(float(total) - full[0]["optimizer_state_bytes"]) <= 0.05 * full[0][
                "optimizer_state_bytes"] + 64 * 4 * len(opt.buckets) * size, (total, full[0])
        if stage == 2:
            assert stats["gradient_bytes"] == 4 * sum(b.part for b in opt.buckets), stats
            assert all(p.grad is None for p in model.parameters())
        else:
            assert stats["gradient_bytes"] == 4 * (padded if stage else numel), stats
        opt.close()


def check_state_dict_is_logical(rank, size):
    """A sharded optimizer's state_dict is what the unsharded one holds (same keys, shapes and
    values, numbered as torch numbers parameters), on every rank."""
    _, unsharded = train("adam", 0, steps=3)
    expected = unsharded.state_dict()
    unsharded.close()
    for stage in (1, 2):
        _, opt = train("adam", stage, steps=3)
        got = opt.state_dict()
        assert sorted(got["state"]) == sorted(expected["state"]), (stage, sorted(got["state"]))
        for pid, entry in expected["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(got["state"][pid][key], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"stage {stage} {pid}/{key}: {m}")
        assert got["param_groups"] == expected["param_groups"], stage
        opt.close()


def check_state_dict_on_one_rank(rank, size):
    """``opt.state_dict()`` gathers the sharded state, so every rank must call it. DDP's habit,
    ``if rank == 0: torch.save(opt.state_dict(), path)``, hung until the stall abort (rank 0
    in the gather, the others in their next step's exchange); now every rank raises
    ``MismatchError`` naming both calls (rank 0 from ``state_dict``, the others from their
    backward pass), and the optimizer trains on when every rank saves."""
    if size == 1:
        return 0  # nothing sharded to disagree on
    model, opt = train("adam", 1, steps=2)
    try:
        if rank == 0:
            opt.state_dict()
        else:
            distributed_step(model, opt, 2)
    except bm.MismatchError as error:
        for needle in ("opt.state_dict(collective=every rank calls it: with zero_stage=1",
                       "rank 1: bucket("):
            assert needle in str(error), (needle, str(error))
    else:
        raise AssertionError("no MismatchError")
    opt.abandon_iteration()
    opt.zero_grad()
    state = opt.state_dict()  # on every rank: gathered
    assert len(state["state"]) == len(list(model.parameters())), sorted(state["state"])
    distributed_step(model, opt, 2)
    opt.close()
    return 1


def check_clip_grad_norm(rank, size):
    """``opt.clip_grad_norm_`` gives torch's total norm and clipping at every stage."""
    def run(stage):
        model = new_model()
        opt = bm.DistributedOptimizer(new_base("sgd", model), bucket_size_mb=BUCKET_MB,
                                      named_parameters=model.named_parameters(),
                                      zero_stage=stage)
        norms = []
        for step in range(3):
            x, y = batch(step)
            rows = rows_of(rank, size)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            norms.append(float(opt.clip_grad_norm_(0.05)))
            with opt.skip_synchronize():
                opt.step()
        opt.close()
        return model, norms

    ref = new_model()
    ref_opt = new_base("sgd", ref)
    ref_norms = []
    for step in range(3):
        x, y = batch(step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        ref_opt.step()
    for stage in (0, 1, 2):
        model, norms = run(stage)
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-5, err_msg=f"stage {stage}")
        assert_close_models(model, ref, 1e-5, f"clipped, stage {stage}")


def least_squares(rank: int, size: int):
    g = torch.Generator().manual_seed(100 + rank)
    a = torch.randn(48, 64, generator=g)
    w = torch.linspace(-1, 1, 64 * 4).reshape(64, 4) + 0.3 * torch.randn(64, 4, generator=g)
    return a, a @ w


def make_compressed_check(algorithm: str, **config):
    def check(rank, size):
        """Stage 2 with a compressed reduce-scatter trains as far as the algorithm suite asks
        of compressed algorithms (excess loss within 1.5x the dense stage 2's + 2% of the start)
        and sends fewer bytes than the dense reduce-scatter; ranks stay identical."""
        algo = bm.algorithms.create(algorithm) if not config else \
            type(bm.algorithms.create(algorithm))(**config)
        shards = [least_squares(r, size) for r in range(size)]
        a_all = torch.cat([s[0] for s in shards])
        y_all = torch.cat([s[1] for s in shards])

        def loss_of(weight):
            return float(torch.nn.functional.mse_loss(a_all @ weight.T, y_all))

        best = float(torch.nn.functional.mse_loss(
            a_all.double() @ torch.linalg.lstsq(a_all.double(), y_all.double()).solution,
            y_all.double()))
        results = {}
        for name, chosen in (("dense", "gradient_allreduce"), ("compressed", algo)):
            torch.manual_seed(0)
            model = torch.nn.Linear(64, 4, bias=False)
            start = loss_of(model.weight.detach())
            opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          algorithm=chosen, zero_stage=2)
            a, y = shards[rank]
            for _ in range(60):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(a), y).backward()
                opt.step()
            w = model.weight.detach()
            everyone = bm.allgather(w.reshape(1, -1))
            assert torch.equal(everyone, w.reshape(1, -1).expand_as(everyone)), "ranks differ"
            results[name] = (loss_of(w) - best, opt.communication_stats()["bytes_sent"]
                             - allgather_bytes(opt, size, 60))  # the reduce-scatters' bytes
            opt.close()
        (dense_excess, dense_bytes), (excess, sent) = results["dense"], results["compressed"]
        limit = 1.5 * dense_excess + 0.02 * start
        assert excess <= limit, f"excess {excess:.5f} > {limit:.5f} (start {start:.3f})"
        if size > 1:
            assert sent < 0.5 * dense_bytes, (sent, dense_bytes)
    return check


def check_fp16_wire(rank, size):
    """compression=fp16 at stage 2: the reduce-scatter travels as 16-bit words (half the
    bytes) and still follows the reference closely."""
    expected = reference("sgd", STEPS)
    sent = {}
    for name, compression in (("none", bm.Compression.none), ("fp16", bm.Compression.fp16)):
        model, opt = train("sgd", 2, compression=compression)
        # the reduce-scatters' bytes: the rest is the parameter allgathers (float32)
        sent[name] = opt.communication_stats()["bytes_sent"] - allgather_bytes(opt, size, STEPS)
        assert_close_models(model, expected, 2e-3 if name == "fp16" else 1e-5, f"wire {name}")
        opt.close()
    if size > 1:
        assert sent["fp16"] * 2 == sent["none"] > 0, sent


def allgather_bytes(opt, size: int, steps: int) -> int:
    """What the parameter allgathers of ``steps`` steps sent from this rank (float32)."""
    return steps * sum((size - 1) * b.part * 4 for b in opt.buckets)


def expect_refusal(make, *needles) -> None:
    try:
        make()
    except (UnsupportedOptionError, ValueError) as exc:
        for needle in needles:
            assert needle in str(exc), (needle, str(exc))
        return
    raise AssertionError(f"no error; expected one naming {needles}")


def check_refusals(rank, size):
    """Every combination sharding cannot honour is refused at wrap time, by name."""
    def wrap(base=None, **options):
        model = torch.nn.Linear(4, 2)
        base = base(model.parameters()) if base else torch.optim.SGD(model.parameters(), lr=0.1)
        return bm.DistributedOptimizer(base, **options)

    expect_refusal(lambda: wrap(zero_stage=3), "zero_stage", "3")
    expect_refusal(lambda: wrap(zero_stage=True), "zero_stage")
    expect_refusal(lambda: wrap(torch.optim.LBFGS, zero_stage=1), "LBFGS", "line search")
    expect_refusal(lambda: wrap(lambda p: torch.optim.SparseAdam(list(p)), zero_stage=2),
                   "SparseAdam")
    expect_refusal(lambda: wrap(zero_stage=1, flatten=False), "flatten=False")
    expect_refusal(lambda: wrap(zero_stage=2, find_unused_parameters=True),
                   "find_unused_parameters")
    expect_refusal(lambda: wrap(zero_stage=2, hierarchical=True, algorithm="qsgd"),
                   "hierarchical=True", "dense")
    topo = bm.runtime.get().topo
    if topo.local_size * topo.cross_size != size or bm.allreduce(
            torch.tensor([float(topo.local_size)]), op=bm.Max).item() != topo.local_size:
        expect_refusal(lambda: wrap(zero_stage=2, hierarchical=True), "same number of ranks")
    refused = {}
    for name in bm.algorithms.names():
        for stage in (1, 2):
            algorithm = bm.algorithms.create(name)
            reason = algorithm.sharding_refusal_reason(stage)
            if reason is None:
                continue
            refused[(name, stage)] = reason
            expect_refusal(lambda: wrap(algorithm=name, zero_stage=stage), name,
                           f"zero_stage={stage}")
    must = {("decentralized", 1), ("async", 2), ("local_sgd", 1),
            ("low_precision_decentralized", 2), ("onebit_adam", 1), ("powersgd", 2),
            ("topk", 2), ("gtopk", 2)}
    assert must <= set(refused), sorted(must - set(refused))
    for name in ("gradient_allreduce", "qsgd", "bytegrad"):
        assert (name, 2) not in refused, (name, refused.get((name, 2)))


class Lion(torch.optim.Optimizer):
    """An optimizer from outside torch.optim that is elementwise: the sign of an interpolated
    momentum (Lion's update, without weight decay)."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.add_(torch.sign(beta1 * m + (1 - beta1) * p.grad), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class TrustRatioSGD(PerTensorSGD):
    """Not elementwise: each tensor's step is scaled by ||p|| / ||grad|| (LAMB's and LARS's
    layer-wise trust ratio), a norm over the whole tensor."""

    @staticmethod
    def direction(p, grad):
        return grad * (p.norm() / grad.norm().clamp_min(1e-12))


class ScaledSGD(PerTensorSGD):
    """Elementwise, but its constructor needs an argument that its defaults do not hold."""

    def __init__(self, params, scale):
        super().__init__(params)
        self.scale = scale

    def direction(self, p, grad):
        return grad * self.scale


class AdamSubclass(torch.optim.Adam):
    """A subclass that keeps torch's step: accepted as Adam is."""


class AdamWithOwnStep(torch.optim.Adam):
    """A subclass with a step of its own, which might do anything: refused by default."""

    def step(self, closure=None):
        return super().step(closure)


def train_with(make_optimizer, stage: int, steps: int = STEPS, **options) -> Net:
    """``steps`` steps of the batch scheme on this rank's rows (``stage`` None: one process on
    the whole batch, the oracle)."""
    model = new_model()
    opt = make_optimizer(model.parameters())
    if stage is not None:
        opt = bm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      bucket_size_mb=BUCKET_MB, zero_stage=stage, **options)
    for step in range(steps):
        if stage is None:
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        else:
            distributed_step(model, opt, step)
    if stage is not None:
        opt.close()
    return model


def check_optimizers_from_outside_torch(rank, size):
    """ZeRO accepts torch.optim's elementwise optimizers and their subclasses that keep their
    step; a step from elsewhere is refused unless declared elementwise
    (``zero_elementwise=True``): a declared Lion then follows its single-process run at
    stages 1 and 2, while a layer-wise trust ratio declared so would not (shown, at more than
    one rank, as the reason for the refusal). One whose constructor needs more than its
    param groups and defaults cannot be built again over the slices: refused by name at the
    first step."""
    for make, step in ((Lion, "__main__.Lion"), (TrustRatioSGD, "short_runs.PerTensorSGD"),
                       (AdamWithOwnStep, "__main__.AdamWithOwnStep")):
        expect_refusal(lambda: train_with(make, 1), f"zero_stage=1 with {make.__name__}",
                       f"'{step}.step'", "zero_elementwise=True", "LAMB")
    expect_refusal(lambda: train_with(Lion, 0, zero_elementwise=True),
                   "zero_elementwise only applies with zero_stage")
    expect_refusal(lambda: train_with(Lion, 1, zero_elementwise="yes"), "must be a bool")
    expect_refusal(lambda: train_with(lambda p: torch.optim.LBFGS(p), 1, zero_elementwise=True),
                   "LBFGS", "line search")
    expect_refusal(lambda: train_with(lambda p: ScaledSGD(p, 2.0), 1, zero_elementwise=True),
                   "builds a second ScaledSGD", "give the constructor's other arguments")
    expected = train_with(lambda p: torch.optim.Adam(p, lr=0.01), None)
    assert_close_models(train_with(lambda p: AdamSubclass(p, lr=0.01), 2), expected, 1e-5,
                        "a subclass of Adam at stage 2")
    expected = train_with(Lion, None)
    for stage in (1, 2):
        assert_close_models(train_with(Lion, stage, zero_elementwise=True), expected, 1e-5,
                            f"Lion declared elementwise at stage {stage}")
    expected = train_with(TrustRatioSGD, None)
    sharded = train_with(TrustRatioSGD, 1, zero_elementwise=True)
    gap = max((p - q).abs().max().item()
              for p, q in zip(sharded.parameters(), expected.parameters()))
    assert (gap > 1e-3) == (size > 1), f"a trust ratio on slices, {size} ranks: {gap}"


# -- checkpoint phases ---------------------------------------------------------------------------
def checkpoint_phase(args) -> int:
    """Train steps [first, last) at this world size and ``--stage`` (loading ``--load`` first,
    saving to ``--save`` at the end); at the end compare with the uninterrupted reference."""
    logging.basicConfig(level=logging.WARNING)
    dtype = torch.float64
    model = new_model(dtype)
    algorithm = bm.algorithms.create(args.algorithm)
    if args.error_feedback:
        algorithm = type(algorithm)(chunk=64, error_feedback=True)
    opt = bm.DistributedOptimizer(new_base("adam", model), named_parameters=model.named_parameters(),
                                  bucket_size_mb=BUCKET_MB, zero_stage=args.stage,
                                  algorithm=algorithm)
    first = 0
    if args.load:
        first = bm.checkpoint.load(args.load, model=model, optimizer=opt).step
    for step in range(first, args.last):
        distributed_step(model, opt, step, dtype)
    if args.save:
        bm.checkpoint.save(args.save, model=model, optimizer=opt, step=args.last)
    expected = reference("adam", args.last, dtype, schedule=False)
    worst = max(float(((p.detach() - q.detach()).abs() / (q.detach().abs() + 1e-12)).max())
                for p, q in zip(model.parameters(), expected.parameters()))
    if bm.rank() == 0:
        print(f"PHASE ranks={bm.size()} stage={args.stage} steps={first}-{args.last} "
              f"max_rel_diff={worst:.3e}", flush=True)
    opt.close()
    return 0


def suite_checks() -> dict:
    checks = {f"trajectory_{kind}": make_trajectory_check(kind)
              for kind in ("sgd", "adam", "adamw")}
    checks.update({"hierarchical": check_hierarchical,
                   "uneven_slices": check_uneven_slices,
                   "state_is_sharded": check_state_is_sharded,
                   "state_dict_is_logical": check_state_dict_is_logical,
                   "clip_grad_norm": check_clip_grad_norm,
                   "state_dict_on_one_rank": check_state_dict_on_one_rank,
                   "users_optimizer_hooks_and_scheduler":
                       check_users_optimizer_hooks_and_scheduler,
                   "fp16_wire": check_fp16_wire,
                   "compressed_qsgd": make_compressed_check("qsgd", chunk=64),
                   "compressed_bytegrad_error_feedback": make_compressed_check(
                       "bytegrad", chunk=64, error_feedback=True),
                   "refusals": check_refusals,
                   "optimizers_from_outside_torch": check_optimizers_from_outside_torch})
    return checks


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["checks", "checkpoint"], default="checks")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--algorithm", default="gradient_allreduce")
    parser.add_argument("--error-feedback", action="store_true")
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--last", type=int, default=3)
    args, _ = parser.parse_known_args()
    bm.init()
    failures = checkpoint_phase(args) if args.phase == "checkpoint" else run_checks(suite_checks())
    bm.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
