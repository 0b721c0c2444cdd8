"""Elastic restores (``hvd.elastic.run`` with ``TorchState``) against uninterrupted training.

An error that every rank sees (here a collective whose shapes differ across the ranks: a
``MismatchError``) makes ``elastic.run`` restore the last ``commit()`` and call the training
function again. The oracle is the same training, with the same per-rank data, that never failed:
after the restore the run must end bit for bit where it ends, for

* every registered algorithm (from the registry), with the error raised after ``step()`` before
  the commit, between ``backward()`` (whose exchange fed the algorithm's state) and ``step()``,
  inside the exchange (the hyperparameter check, where the algorithm exchanges gradients),
  before the first commit, and twice in a row before one commit;
* an error between the backward passes of one step (``backward_passes_per_step=2``);
* ZeRO stages 1 and 2 (a commit copies this rank's slices of the state, not the whole);
* the state's values, one of them a list appended to in place;
* an LR scheduler stepped before the error;
* a GAN whose second model and optimizer and a scheduler are keyword arguments
  (``TorchState(G, opt_g, discriminator=D, opt_d=opt_d, scheduler=s)``, as Horovod's), restored
  in place and resumed from the checkpoint directory by a second training with new objects;
* a model assigned to ``state.model`` after construction (handed over, as Horovod's).

``async`` averages on a timer, so two of its runs differ anyway: it must restore and go on.
Each check prints ``CHECK <name> PASS|FAIL`` (``checks.run_checks``).
"""
from __future__ import annotations

import sys
import tempfile
import warnings

import torch

import bagua_mpi as bm
from checks import expect, run_checks
from short_runs import HYPERPARAMETERS, gan_models

EPOCHS = 7
# where the error is raised: (epoch, point[, times]), point one of "after_step", "before_step"
# or "in_exchange" (the last rank doubles its learning rate, and the hyperparameter check of
# the next gradient exchange raises MismatchError on every rank while buckets are on the wire);
# twice in a row: the second restore must find the commit as the first did (torch.optim's
# load_state_dict keeps the tensors it is given, and the steps after it change them in place)
FAILURES = {"after_step": (3, "after_step"), "before_step": (4, "before_step"),
            "before_first_commit": (0, "after_step"), "twice": (2, "after_step", 2),
            "in_exchange": (3, "in_exchange")}


def batch(epoch: int, pass_: int = 0):
    """This rank's batch: different on every rank and every epoch, the same in every run."""
    g = torch.Generator().manual_seed(1000 * epoch + 10 * pass_ + bm.rank())
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def everyone_fails() -> None:
    """A collective whose shapes differ across the ranks: MismatchError on every rank."""
    bm.allreduce(torch.zeros(1 + bm.rank()))


def train(algorithm: str, fail_at=None, passes: int = 1, hyper=None, **options) -> torch.Tensor:
    """EPOCHS steps under ``elastic.run`` (one commit each), failing at ``fail_at`` ((epoch,
    point) once, (epoch, point, times), or (epoch, "between_passes") with ``passes`` 2); this
    rank's parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    base = (torch.optim.Adam(model.parameters(), lr=0.01)
            if algorithm == "onebit_adam" or options.get("zero_stage")
            else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    chosen = bm.algorithms.create(algorithm, **(hyper or HYPERPARAMETERS.get(algorithm, {})))
    opt = bm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                  algorithm=chosen, backward_passes_per_step=passes, **options)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state = bm.elastic.TorchState(model, opt, scheduler=scheduler, epoch=0, history=[])
    failed = []
    times = 1 if fail_at is None or len(fail_at) == 2 else fail_at[2]

    def fails_here(point: str) -> bool:
        return (fail_at is not None and len(failed) < times
                and tuple(fail_at[:2]) == (state.epoch, point) and not failed.append(1))

    @bm.elastic.run
    def loop(state):
        while state.epoch < EPOCHS:
            state.history.append(state.epoch)  # a value changed in place, before the error
            opt.zero_grad()
            if fails_here("in_exchange") and bm.rank() == bm.size() - 1:
                for group in opt.param_groups:  # the next exchange's agreement check refuses
                    group["lr"] *= 2.0
            for p in range(passes):
                x, y = batch(state.epoch, p)
                torch.nn.functional.mse_loss(model(x), y).backward()
                if p + 1 < passes and fails_here("between_passes"):
                    everyone_fails()
            if fails_here("before_step"):
                everyone_fails()
            opt.step()
            scheduler.step()
            if fails_here("after_step"):
                everyone_fails()
            state.epoch += 1
            state.commit()

    loop(state)
    assert fail_at is None or len(failed) == times, f"the error at {fail_at} was not raised"
    assert state.history == list(range(EPOCHS)), f"{fail_at}: history {state.history}"
    opt.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_matches_on_every_rank(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Each rank compares its own parameters (they differ across ranks where the algorithm
    averages models); every rank raises if any rank's differ."""
    diff = (got - want).abs().max().item()
    worst = max(bm.allgather_object(diff))
    assert worst == 0.0, f"{label}: the restored run ends {worst:.3g} away from the " \
                         f"uninterrupted one (largest over the ranks)"


def restore_check(algorithm: str):
    def check(rank: int, size: int) -> None:
        if algorithm == "async":
            # by default its timer decides what is averaged, so no two runs agree: they must
            # restore and go on; every step's exchange applied one step later is the same on
            # every run, and must restore exactly
            for fail_at in FAILURES.values():
                assert torch.isfinite(train(algorithm, fail_at)).all(), "async: not finite"
            steady = {"sync_interval_ms": 0, "max_staleness": 1}
            want = train(algorithm, hyper=steady)
            for label, fail_at in FAILURES.items():
                if label != "in_exchange":
                    assert_matches_on_every_rank(f"async {steady}, error {label}",
                                                 train(algorithm, fail_at, hyper=steady), want)
            return
        want = train(algorithm)
        averages_models = bm.algorithms.create(algorithm).averages_models
        for label, fail_at in FAILURES.items():
            if label == "in_exchange" and averages_models:
                continue  # no gradient exchange, so no hyperparameter check to raise it
            assert_matches_on_every_rank(f"{algorithm}, error {label}",
                                         train(algorithm, fail_at), want)
    return check


def check_between_passes(rank: int, size: int) -> None:
    """An error after the first of two accumulated backward passes: the counted gradients
    are abandoned (``zero_grad()`` would refuse them otherwise) and the restored run goes on."""
    for algorithm in ("gradient_allreduce", "topk"):
        want = train(algorithm, passes=2)
        assert_matches_on_every_rank(f"{algorithm}, error between passes",
                                     train(algorithm, (2, "between_passes"), passes=2), want)


def zero_check(stage: int):
    def check(rank: int, size: int) -> None:
        want = train("gradient_allreduce", zero_stage=stage)
        for label, fail_at in FAILURES.items():
            assert_matches_on_every_rank(f"zero_stage={stage}, error {label}",
                                         train("gradient_allreduce", fail_at,
                                               zero_stage=stage), want)
    return check


def tensor_bytes(tree) -> int:
    """Bytes of every tensor in a tree of dicts, lists and tuples."""
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    items = tree.values() if isinstance(tree, dict) else tree
    return sum(map(tensor_bytes, items)) if isinstance(tree, (dict, list, tuple)) else 0


def check_sharded_commit_keeps_this_ranks_slices(rank: int, size: int) -> None:
    """At ZeRO stage 2 a commit copies this rank's slices of Adam's state, not the gathered
    whole (which would undo the sharding's memory saving at every commit)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), zero_stage=2)
    for epoch in range(2):
        x, y = batch(epoch)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    state = bm.elastic.TorchState(model, opt, epoch=0)
    state.commit()
    kept = tensor_bytes(state._snapshots["optimizers"])
    whole = tensor_bytes(opt.state_dict()["state"])  # the logical state, gathered
    held = opt.memory_stats()["optimizer_state_bytes"]
    assert kept <= held + 64 and kept <= whole // size + 64 * size, (kept, held, whole)
    opt.close()


def gan(directory=None, fail_at_epoch=None, stop_at=None):
    """A GAN under ``elastic.run``: the discriminator and its optimizer (top-k, per-rank error
    feedback) are keyword arguments of ``TorchState``. Returns (state, G, D, parameters)."""
    G, D = gan_models()
    opt_g = bm.DistributedOptimizer(torch.optim.Adam(G.parameters(), lr=0.01),
                                    named_parameters=G.named_parameters())
    opt_d = bm.DistributedOptimizer(torch.optim.Adam(D.parameters(), lr=0.01),
                                    named_parameters=D.named_parameters(),
                                    algorithm=bm.algorithms.create("topk", density=0.2))
    scheduler = torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.5)
    state = bm.elastic.TorchState(G, opt_g, checkpoint_dir=directory, discriminator=D,
                                  opt_d=opt_d, scheduler=scheduler, epoch=0)
    bce = torch.nn.BCEWithLogitsLoss()
    failed = []

    @bm.elastic.run
    def loop(state):
        while state.epoch < EPOCHS:
            g = torch.Generator().manual_seed(1000 * state.epoch + bm.rank())
            z, real = torch.randn(8, 4, generator=g), torch.randn(8, 6, generator=g) + 1.0
            opt_d.zero_grad()
            (bce(D(real), torch.ones(8, 1)) + bce(D(G(z).detach()), torch.zeros(8, 1))).backward()
            opt_d.step()
            if state.epoch == fail_at_epoch and not failed:
                failed.append(1)
                everyone_fails()
            opt_g.zero_grad()
            with opt_d.no_sync():  # the generator's pass goes through D: not D's exchange
                bce(D(G(z)), torch.ones(8, 1)).backward()
            opt_g.step()
            scheduler.step()
            state.epoch += 1
            state.commit()
            if state.epoch == stop_at:
                return

    loop(state)
    for opt in (opt_g, opt_d):
        opt.close()
    params = torch.cat([p.detach().reshape(-1) for p in [*G.parameters(), *D.parameters()]])
    return state, G, D, params


def check_several_models(rank: int, size: int) -> None:
    """Horovod's ``TorchState(model, optimizer, **kwargs)``: a second model and optimizer among
    the keyword arguments are restored in place (the objects the loop holds), not kept as
    values; and a restart resumes both from the checkpoint directory."""
    *_, want = gan()
    state, G, D, got = gan(fail_at_epoch=3)
    assert state.discriminator is D and state.model is G, "TorchState replaced the models"
    assert "discriminator" not in state._saved_state, "a model was kept as a value"
    assert_matches_on_every_rank("GAN, error after D's step", got, want)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = bm.broadcast_object(tmp if rank == 0 else None)
        state, *_ = gan(directory=tmp, stop_at=4)
        assert state.commits == 4, state.commits
        info = bm.checkpoint.read_meta(bm.checkpoint.latest(tmp))
        assert sorted(info["optimizers"]) == ["opt_d", "optimizer"], info["optimizers"]
        state, _, _, resumed = gan(directory=tmp)  # new objects: the job restarted
        G, D = gan_models(init_seed=7)  # a restart without the scheduler: refused, untouched
        before = [p.detach().clone() for p in G.parameters()]
        without = bm.elastic.TorchState(G, checkpoint_dir=tmp, discriminator=D, epoch=0)
        expect(bm.checkpoint.CheckpointError, without.resume,
               "holds LR schedulers ['scheduler'], this TorchState has []")
        assert all(torch.equal(a, b) for a, b in zip(before, G.parameters())), "G was touched"
        bm.barrier()  # rank 0's directory outlives every rank's reads
    assert state.commits == EPOCHS, state.commits
    assert_matches_on_every_rank("GAN resumed from the checkpoint directory", resumed, want)


def check_async_commits_wait_for_no_rank(rank: int, size: int) -> None:
    """``async`` on its timer, one rank slower, a commit to a checkpoint directory every third
    step and a logged loss averaged after each: a commit must not wait for an exchange this
    rank started (the slower rank may not have started it, and is already in the next
    collective). It did, in the checkpoint's algorithm state, and the job hung."""
    import time
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(),
                                  algorithm=bm.algorithms.create("async", sync_interval_ms=2))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = bm.broadcast_object(tmp if rank == 0 else None)
        state = bm.elastic.TorchState(model, opt, checkpoint_dir=tmp, epoch=0)
        for epoch in range(30):
            x, y = batch(epoch)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            time.sleep(0.004 * (rank == size - 1))
            if epoch % 3 == 2:
                state.epoch = epoch
                state.commit()
                bm.allreduce(loss.detach())
        bm.barrier()  # rank 0's directory outlives every rank's writes
    assert state.commits == 10, state.commits
    opt.close()


def check_handover_and_bad_arguments(rank: int, size: int) -> None:
    """Assigning another model to ``state.model`` hands it over (as Horovod's): the restore
    brings back the new one, as it was when assigned; a value of another kind is refused."""
    model, other = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    state = bm.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), epoch=0)
    state.model = other
    assigned = other.weight.detach().clone()
    with torch.no_grad():
        other.weight.add_(1.0)
        model.weight.add_(1.0)
    state.restore()
    assert torch.equal(other.weight, assigned), "the assigned model was not restored"
    assert not torch.equal(model.weight.detach(), assigned), "the old model was restored"
    expect(TypeError, lambda: setattr(state, "model", 3),
           "state.model holds a model; a int is not one")
    expect(TypeError, lambda: bm.elastic.TorchState(model.state_dict()),
           "TorchState(model=...) takes a torch.nn.Module, an optimizer or an LR scheduler, "
           "got OrderedDict")
    expect(TypeError, lambda: bm.elastic.TorchState(model, optimizer=0.1),
           "TorchState(optimizer=...) takes a torch.nn.Module, an optimizer or an LR scheduler, "
           "got float")


def suite_checks(algorithms=None) -> dict:
    """The checks by name: one restore check per algorithm of ``algorithms`` (default: every
    registered one), then the others."""
    checks = {f"restore_{name}": restore_check(name)
              for name in (bm.algorithms.names() if algorithms is None else algorithms)}
    checks.update({"restore_between_passes": check_between_passes,
                   "restore_zero_stage_1": zero_check(1), "restore_zero_stage_2": zero_check(2),
                   "sharded_commit_keeps_this_ranks_slices":
                       check_sharded_commit_keeps_this_ranks_slices,
                   "async_commits_wait_for_no_rank": check_async_commits_wait_for_no_rank,
                   "several_models": check_several_models,
                   "handover_and_bad_arguments": check_handover_and_bad_arguments})
    return checks


def main() -> int:
    warnings.simplefilter("ignore")  # the restores' retries are the point, not their notes
    bm.init()
    failures = run_checks(suite_checks())
    bm.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
