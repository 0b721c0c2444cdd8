"""Mixed precision's loss scaling (``torch.amp.GradScaler``) with DistributedOptimizer.

``python amp_suite.py`` on every rank. Two recipes:

* **plain**, PyTorch's own: ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``.
  The scaler reads the optimizer's groups to unscale and check the gradients, which finishes
  their exchange first, so it sees the synchronized gradients even while buckets are on the
  wire after backward (overlap on);
* **explicit**, Horovod's: ``opt.synchronize()``, ``scaler.unscale_(opt)``, then
  ``scaler.step(opt)`` inside ``opt.skip_synchronize()``.

At step ``BAD`` the last rank's batch overflows (inf) or is NaN. Every rank must then skip that
step, and only it (the scale backs off once, alike on every rank), and training goes on: the
state the bad gradients reached during the exchange (error feedback, PowerSGD's Q, L-GreCo's
accumulators) is dropped, where it used to keep every later step non-finite too.

The oracle is one process with every rank's batch: for ``gradient_allreduce`` it replays the
run (the bad step skipped) and the parameters must match it; for every other algorithm that
exchanges gradients (from the registry) the loss on the combined data must keep falling after
the skipped step. The algorithms that average models keep their gradients local, so each
rank's scaler decides alone: a rank that skips alone must end the job with a named error
(``--model-averaging-skip``).
"""
import sys
import warnings

import torch

import bagua_mpi as bm
from bagua_mpi.exceptions import MisuseError
from checks import expect, run_suite

STEPS, BAD, ROWS = 12, 5, 8
# short warm-ups, so that the bad step is compressed; onebit_adam's compressed stage refuses a
# GradScaler (check_onebit_adam_refuses_grad_scaler), so its run stays in the warm-up
OVERRIDES = {"onebit_adam": dict(warmup_steps=STEPS + 1), "lgreco": dict(warmup_steps=3),
             "powersgd": dict(warmup_steps=2)}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def wide_model():
    """Large enough that buckets are still on the wire when backward returns."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 512), torch.nn.ReLU()]
    for _ in range(5):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(512, 1))


def batch(step: int, rank: int, size: int, poison: str | None):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True)
    if poison in ("inf", "nan") and step == BAD and rank == size - 1:
        x = x * (1e30 if poison == "inf" else float("nan"))
    return x, y


def base_optimizer(name: str, params):
    if name == "onebit_adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def combined_loss(net, size: int) -> float:
    xs, ys = zip(*(batch(STEPS + 1, r, size, None) for r in range(size)))
    with torch.no_grad():
        return torch.nn.functional.mse_loss(net(torch.cat(xs)), torch.cat(ys)).item()


def train(name: str, recipe: str, poison: str | None, rank: int, size: int, make=model,
          bucket_mb: float = 0.001, clip: float | None = None, **options):
    """(model, scale after each step, loss on every rank's next batch after each step) of a
    run of ``name`` under GradScaler. ``poison``: the last rank's batch at step ``BAD`` is
    ``inf`` or ``nan``, or (``element``) one element of its first layer's gradient is inf, which
    at ``zero_stage=2`` lands in one rank's slice only."""
    net = make()
    algorithm = bm.algorithms.create(name, **OVERRIDES.get(name, {}))
    opt = bm.DistributedOptimizer(base_optimizer(name, net.parameters()),
                                  named_parameters=net.named_parameters(), algorithm=algorithm,
                                  overlap=True, bucket_size_mb=bucket_mb, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    scales, losses = [], []
    now = [0]
    if poison == "element" and rank == size - 1:
        def one_inf(grad):
            if now[0] != BAD:
                return grad
            grad = grad.clone()
            grad.view(-1)[-1] = float("inf")
            return grad
        net[0].weight.register_hook(one_inf)
    for step in range(STEPS):
        now[0] = step
        x, y = batch(step, rank, size, poison)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
        if recipe == "explicit":
            opt.synchronize()
            scaler.unscale_(opt)
            if clip is not None:  # the averaged, unscaled gradients (at stage 2, the slices)
                if opt.zero_stage == 2:
                    opt.clip_grad_norm_(clip)
                else:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(combined_loss(net, size))
    opt.close()
    return net, scales, losses


def reference(size: int, skipped: set[int], make=model, clip: float | None = None):
    """One process, every rank's batch, plain SGD on the mean loss (its gradient norm clipped
    to ``clip``); the ``skipped`` steps skipped (their batches drawn all the same)."""
    net = make()
    opt = base_optimizer("gradient_allreduce", net.parameters())
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r, size, None) for r in range(size)))
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(torch.cat(xs)), torch.cat(ys)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        if step not in skipped:
            opt.step()
    return net


def flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def check_skip(name: str, recipe: str, poison: str, rank: int, size: int, **options) -> None:
    with warnings.catch_warnings():  # a scaler's skip is routine: zero_grad() must not warn
        warnings.simplefilter("error", bm.DiscardedExchangeWarning)
        net, scales, losses = train(name, recipe, poison, rank, size, **options)
    everyone = bm.allgather_object(scales)
    assert all(s == everyone[0] for s in everyone), f"the ranks' scales differ: {everyone}"
    backoffs = [step for step in range(STEPS)
                if scales[step] < (scales[step - 1] if step else 256.0)]
    assert backoffs == [BAD], f"steps skipped: {backoffs}, expected [{BAD}] (scales {scales})"
    params = flat(net)
    assert bool(params.isfinite().all()), "parameters are not finite"
    gathered = bm.allgather(params[None])  # every algorithm here is centralized
    assert bool((gathered == gathered[0]).all()), "the ranks' parameters differ"
    if name == "gradient_allreduce":
        expected = flat(reference(size, {BAD}))
        assert torch.allclose(params, expected, rtol=1e-4, atol=1e-6), (
            f"parameters differ from the single-process replay by "
            f"{(params - expected).abs().max().item():.3g}")
    else:
        assert losses[-1] < 0.95 * losses[BAD], (
            f"training stalled after the skipped step: combined loss {losses[BAD]:.4g} after "
            f"it, {losses[-1]:.4g} at the end")


def check_plain_recipe_overlapped(rank: int, size: int) -> None:
    """No overflow: the plain recipe with buckets still on the wire after backward gives the
    single-process result (it gave other parameters on each rank while the scaler unscaled a
    bucket in flight)."""
    net, scales, _ = train("gradient_allreduce", "plain", None, rank, size, wide_model, 1.0)
    assert scales == [256.0] * STEPS, scales
    expected = flat(reference(size, set(), wide_model))
    assert torch.allclose(flat(net), expected, rtol=1e-4, atol=1e-6), (
        f"off the single-process run by {(flat(net) - expected).abs().max().item():.3g}")


def check_explicit_recipe_clipped(rank: int, size: int) -> None:
    """Horovod's recipe with clipping between ``unscale_`` and the step, with an overflow at
    step ``BAD``: at stages 0 and 1 torch's ``clip_grad_norm_`` clips the averaged, unscaled
    gradients, at stage 2 ``opt.clip_grad_norm_`` clips the slices; every stage follows the
    single-process replay that clips the combined batch's gradient (and skips that step)."""
    clip = 0.5
    expected = flat(reference(size, {BAD}, clip=clip))
    assert not torch.allclose(expected, flat(reference(size, {BAD}))), "nothing was clipped"
    for stage in (0, 1, 2):
        net, scales, _ = train("gradient_allreduce", "explicit", "inf", rank, size, clip=clip,
                               zero_stage=stage)
        assert scales[BAD] < scales[BAD - 1], f"stage {stage}: the overflow was not seen"
        assert torch.allclose(flat(net), expected, rtol=1e-4, atol=1e-6), (
            f"stage {stage}: off the clipped single-process replay by "
            f"{(flat(net) - expected).abs().max().item():.3g}")


def onebit_adam_run(rank: int, size: int, iteration, needle: str) -> None:
    """onebit_adam with a 2-step warm-up; ``iteration(opt, net, x, y)`` is each step's body;
    it must raise MisuseError naming the compressed stage's first step and ``needle``."""
    net = model()
    opt = bm.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-2),
                                  named_parameters=net.named_parameters(),
                                  algorithm=bm.algorithms.OneBitAdam(warmup_steps=2))

    def steps():
        for step in range(4):
            iteration(opt, net, *batch(step, rank, size, None))
    try:
        expect(MisuseError, steps, f"rank {rank}: onebit_adam, compressed stage (step 2)",
               needle)
    finally:
        opt.close()


def check_onebit_adam_refuses_grad_scaler(rank: int, size: int) -> None:
    """Its compressed stage forms the momentum from the gradients during backward, still
    scaled: GradScaler's unscaling could not reach the update, so the scaler is refused there
    (it trains in the warm-up, a dense exchange)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)

    def iteration(opt, net, x, y):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    onebit_adam_run(rank, size, iteration, "GradScaler unscales the gradients")


def check_onebit_adam_refuses_clipping(rank: int, size: int) -> None:
    """Clipping after the exchange cannot reach the compressed stage's update either."""
    def iteration(opt, net, x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
        with opt.skip_synchronize():
            opt.step()
    onebit_adam_run(rank, size, iteration, "clipped")


def check_onebit_adam_refuses_skipped_step(rank: int, size: int) -> None:
    """Nor can its momentum forget a step skipped after the exchange (a loss scaler of one's
    own): the next backward pass raises."""
    def iteration(opt, net, x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.synchronize()
        if opt.steps < 2:
            opt.step()
    onebit_adam_run(rank, size, iteration, "a step was skipped")


def check_step_in_skip_synchronize_without_synchronize(rank: int, size: int) -> None:
    """``step()`` inside ``skip_synchronize()`` while gradients wait to be communicated (the
    first of ``backward_passes_per_step=2`` passes) would apply this rank's own gradients:
    refused, and nothing is stepped. After the step's last pass it is Horovod's recipe without
    the ``synchronize()``, which ``backward()`` made needless: accepted."""
    net = model()
    opt = bm.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                  named_parameters=net.named_parameters(),
                                  backward_passes_per_step=2)
    before = flat(net).clone()
    x, y = batch(0, rank, size, None)
    torch.nn.functional.mse_loss(net(x), y).backward()
    with opt.skip_synchronize():
        expect(MisuseError, opt.step, f"rank {rank}: step() inside skip_synchronize()",
               "call synchronize()")
    assert torch.equal(flat(net), before), "the refused step changed the parameters"
    torch.nn.functional.mse_loss(net(x), y).backward()
    with opt.skip_synchronize():
        opt.step()  # the exchange happened as the second pass ended
    stepped = flat(net)
    assert not torch.equal(stepped, before), "nothing was stepped"
    assert all(torch.equal(stepped, other) for other in bm.allgather(stepped[None])), \
        "the ranks stepped on different gradients"
    opt.close()


def skip_checks() -> dict:
    """One check per algorithm that exchanges gradients (from the registry), recipe and
    poison."""
    out = {}
    for name in bm.algorithms.names():
        if bm.algorithms.create(name).averages_models:
            continue  # their gradients stay local: each rank's scaler decides alone
        for recipe in ("plain", "explicit"):
            for poison in ("inf", "nan"):
                out[f"skip_{name}_{recipe}_{poison}"] = (
                    lambda rank, size, n=name, r=recipe, p=poison: check_skip(n, r, p, rank,
                                                                               size))
    return out


def zero_checks() -> dict:
    """ZeRO: at stage 2 ``p.grad`` is None and each rank holds its slice of the gradient; the
    scaler unscales and checks the slices, and skips a step wherever any rank's slice overflowed
    (``element``: one rank's slice only). Stage 1 keeps whole gradients. The replay oracle for
    gradient averaging, the loss for QSGD's compressed reduce-scatter."""
    out = {}
    for stage, name in ((1, "gradient_allreduce"), (2, "gradient_allreduce"), (2, "qsgd")):
        for recipe in ("plain", "explicit"):
            for poison in ("inf", "element"):
                out[f"zero{stage}_{name}_{recipe}_{poison}"] = (
                    lambda rank, size, n=name, r=recipe, p=poison, z=stage: check_skip(
                        n, r, p, rank, size, zero_stage=z))
    return out


def suite_checks() -> dict:
    return {"plain_recipe_overlapped": check_plain_recipe_overlapped, **skip_checks(),
            **zero_checks(),
            "explicit_recipe_clipped": check_explicit_recipe_clipped,
            "onebit_adam_refuses_grad_scaler": check_onebit_adam_refuses_grad_scaler,
            "onebit_adam_refuses_clipping": check_onebit_adam_refuses_clipping,
            "onebit_adam_refuses_skipped_step": check_onebit_adam_refuses_skipped_step,
            "step_in_skip_synchronize_without_synchronize":
                check_step_in_skip_synchronize_without_synchronize}


def model_averaging_skip(name: str) -> int:
    """Run alone (``--model-averaging-skip NAME``): an algorithm that averages models keeps the
    gradients local, so only the last rank's scaler skips the bad step; its next backward
    pass raises MisuseError naming it, and the job ends (the others wait in the exchange)."""
    bm.init()
    train(name, "plain", "inf", bm.rank(), bm.size())
    bm.shutdown()
    return 0


if __name__ == "__main__":
    if "--model-averaging-skip" in sys.argv:
        sys.exit(model_averaging_skip(sys.argv[sys.argv.index("--model-averaging-skip") + 1]))
    sys.exit(run_suite(suite_checks()))
