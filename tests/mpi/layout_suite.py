"""Parameters in a memory layout other than row-major (``channels_last``, the CNN recipe on GPUs).

``python layout_suite.py`` on every rank. A bucket holds each parameter in its memory order and
gives it a gradient with the parameter's strides (``bagua_mpi/layout.py``).

The oracle is a *twin* model whose convolution weights are row-major tensors of shape
(out, kh, kw, in), seen by the forward pass through ``permute(0, 3, 1, 2)``: that view has the
``channels_last`` strides, so the convolutions compute the same bits, and the twin's buckets
hold the same elements in the same order through the row-major path every other suite checks.
For every algorithm in the registry, the ``channels_last`` model trained with per-rank data must
end with exactly the twin's parameters. Also: the gradients have their parameters' strides,
autograd never warns about the layout, model averaging keeps the parameters ``channels_last``,
ZeRO's logical optimizer state equals the unsharded optimizer's, and ranks that wrap different
layouts, or a checkpoint of another layout, are refused by name; a model converted after its
first step is refused by the algorithms that average flat copies of the parameters.
"""
import shutil
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F

import bagua_mpi as bm
from bagua_mpi.exceptions import MismatchError, MisuseError
from checks import expect, run_suite

STEPS = 4
NOT_REPEATABLE = {"async"}  # averages on a clock of its own, so two runs differ anyway
OVERRIDES = {"onebit_adam": dict(warmup_steps=2), "lgreco": dict(warmup_steps=2),
             "powersgd": dict(warmup_steps=1), "local_sgd": dict(period=2)}


class Net(torch.nn.Module):
    """Two convolutions and a linear head, the weights channels_last (``twin=False``) or stored
    row-major as (out, kh, kw, in) (``twin=True``); the same parameter names and values."""

    def __init__(self, twin: bool):
        super().__init__()
        torch.manual_seed(0)
        self.twin = twin
        for i, (cin, cout) in enumerate(((4, 8), (8, 8)), start=1):
            w = torch.randn(cout, cin, 3, 3) * 0.2
            w = w.permute(0, 2, 3, 1).contiguous() if twin else w.to(
                memory_format=torch.channels_last)
            setattr(self, f"w{i}", torch.nn.Parameter(w))
            setattr(self, f"b{i}", torch.nn.Parameter(torch.randn(cout) * 0.1))
        self.head = torch.nn.Linear(8, 3)

    def weight(self, i: int) -> torch.Tensor:
        w = getattr(self, f"w{i}")
        return w.permute(0, 3, 1, 2) if self.twin else w

    def forward(self, x):
        x = F.relu(F.conv2d(x, self.weight(1), self.b1, padding=1))
        x = F.relu(F.conv2d(x, self.weight(2), self.b2, padding=1))
        return self.head(x.mean(dim=(2, 3)))

    def logical(self) -> list[torch.Tensor]:
        return [self.weight(1), self.b1, self.weight(2), self.b2, self.head.weight,
                self.head.bias]


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 4, 6, 6, generator=g).to(memory_format=torch.channels_last)
    return x, torch.randn(4, 3, generator=g)


def optimizer_for(name: str, params):
    if name in ("onebit_adam",):
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(name: str, twin: bool, rank: int, steps: int = STEPS, **wrap):
    net = Net(twin)
    opt = bm.DistributedOptimizer(
        optimizer_for(name, net.parameters()), named_parameters=net.named_parameters(),
        algorithm=bm.algorithms.create(name, **OVERRIDES.get(name, {})), overlap=True,
        bucket_size_mb=0.001, profile_order=False, **wrap)
    strides = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*gradient layout contract.*")
        for step in range(steps):
            x, y = batch(step, rank)
            opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of resetting the gradients
            F.mse_loss(net(x), y).backward()
            opt.synchronize()
            strides.append([(p.grad.stride(), p.stride()) for p in (net.w1, net.w2)])
            with opt.skip_synchronize():
                opt.step()
    return net, opt, strides


def check_matches_twin(name: str, rank: int, size: int) -> None:
    """(Parameters in registration order, so that both models bucket alike: the profiled order
    of gradient readiness differs, since the twin's graph has the permutes.)"""
    net, opt, strides = train(name, False, rank)
    opt.close()
    if name in NOT_REPEATABLE:  # its exchanges run when a timer says: layouts checked only
        assert all(torch.isfinite(p).all() for p in net.parameters()), "not finite"
    else:
        twin, twin_opt, _ = train(name, True, rank)
        twin_opt.close()
        for i, (a, b) in enumerate(zip(net.logical(), twin.logical())):
            assert torch.equal(a, b), (f"parameter {i}: differs from the row-major twin by "
                                       f"{(a - b).abs().max().item():.3g}")
    want = torch.empty(8, 4, 3, 3).to(memory_format=torch.channels_last).stride()
    assert net.w1.stride() == want, f"w1 is no longer channels_last: {net.w1.stride()}"
    if not bm.algorithms.create(name).averages_models:
        for step, pairs in enumerate(strides):
            for grad_strides, param_strides in pairs:
                assert grad_strides == param_strides, (
                    f"step {step}: gradient strides {grad_strides}, parameter {param_strides}")


def check_gradient_allreduce_matches_one_process(rank: int, size: int) -> None:
    """Against one process with every rank's batch (the average of their losses)."""
    net, opt, _ = train("gradient_allreduce", False, rank)
    opt.close()
    ref = Net(False)
    ref_opt = optimizer_for("gradient_allreduce", ref.parameters())
    for step in range(STEPS):
        ref_opt.zero_grad()
        loss = sum(F.mse_loss(ref(x), y) for x, y in (batch(step, r) for r in range(size)))
        (loss / size).backward()
        ref_opt.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6), f"{(a - b).abs().max().item():.3g} from one process"


def check_zero_state_matches_unsharded(rank: int, size: int) -> None:
    """ZeRO's logical optimizer state (gathered from the slices) equals the unsharded run's,
    element for element, for the channels_last weights too."""
    def run(stage):
        net = Net(False)
        opt = bm.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-2),
                                      named_parameters=net.named_parameters(),
                                      bucket_size_mb=0.001, zero_stage=stage)
        for step in range(STEPS):
            x, y = batch(step, rank)
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            opt.step()
        state = opt.state_dict()["state"]
        opt.close()
        return net, state
    net0, state0 = run(0)
    net1, state1 = run(1)
    for a, b in zip(net0.parameters(), net1.parameters()):
        assert torch.allclose(a, b, atol=1e-6), "ZeRO-1 trained another model"
    for pos in state0:
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = state0[pos][key], state1[pos][key]
            assert torch.allclose(a, b, atol=1e-6), (
                f"parameter {pos} {key}: ZeRO-1's state differs by "
                f"{(a - b).abs().max().item():.3g}")
    # and it loads back into a sharded optimizer as it was
    net = Net(False)
    opt = bm.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-2),
                                  named_parameters=net.named_parameters(), bucket_size_mb=0.001,
                                  zero_stage=1)
    x, y = batch(0, rank)
    F.mse_loss(net(x), y).backward()
    opt.step()
    opt.load_state_dict({"state": state1, "param_groups": opt.state_dict()["param_groups"]})
    again = opt.state_dict()["state"]
    opt.close()
    for pos in state1:
        assert torch.equal(again[pos]["exp_avg"], state1[pos]["exp_avg"]), f"{pos}: reloaded"


def check_ranks_with_other_layouts_are_refused(rank: int, size: int) -> None:
    if size < 2:
        return
    net = Net(False)
    if rank == size - 1:
        net.w1.data = net.w1.data.contiguous()
    expect(MismatchError, lambda: bm.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters()),
        "w1", "channels_last", "contiguous", f"rank {size - 1}")


def check_checkpoint_of_another_layout_is_refused(rank: int, size: int) -> None:
    """The error-feedback state is in the parameters' memory order: the checkpoint (an HDF5
    file) records the layouts, a run whose weight is laid out otherwise is refused with what to
    do, and the same layout resumes."""
    net, opt, _ = train("topk", False, rank, steps=2)
    directory = bm.broadcast_object(tempfile.mkdtemp(prefix="layout_ckpt_") if rank == 0
                                    else None, root_rank=0)
    bm.checkpoint.save(directory, net, opt, step=2)
    assert "w1" in opt.algorithm_state_dict()["state"]["layouts"]
    opt.close()

    def wrapped(relayout: bool):
        fresh = Net(False)
        if relayout:
            fresh.w2.data = fresh.w2.data.contiguous()
        return fresh, bm.DistributedOptimizer(
            torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9),
            named_parameters=fresh.named_parameters(), algorithm="topk", bucket_size_mb=0.001)
    fresh, other = wrapped(relayout=True)
    expect(bm.checkpoint.CheckpointError, lambda: bm.checkpoint.load(directory, fresh, other),
           "w2",
           "with strides (72, 1, 24, 8)", "row-major now", "memory_format")
    other.close()
    fresh, again = wrapped(relayout=False)
    bm.checkpoint.load(directory, fresh, again)  # the same layout loads
    assert "w1" in again.algorithm_state_dict()["state"]["layouts"]
    again.close()
    bm.barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


def check_converted_after_the_first_step(name: str, rank: int, size: int) -> None:
    """``model.to(memory_format=...)`` after the first step gives the weights new storage.
    An algorithm that averages flat buffers holding the parameters would go on averaging those
    while this rank's model trained alone: its next ``step()`` raises ``MisuseError`` naming
    the weights, and nothing changes. The other algorithms copy each gradient into their
    bucket's layout and train on, the centralized ones alike on every rank."""
    net, opt, _ = train(name, False, rank, steps=1)
    net.to(memory_format=torch.contiguous_format)
    x, y = batch(1, rank)
    opt.zero_grad()
    F.mse_loss(net(x), y).backward()
    before = [p.detach().clone() for p in net.parameters()]
    if opt.impl.wants_flat_params:
        expect(MisuseError, opt.step, f"rank {rank}", "w1", "w2", name,
               "convert the model before wrapping")
        assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before)), "stepped"
    else:
        opt.step()
        assert any(not torch.equal(p, b) for p, b in zip(net.parameters(), before)), "no step"
        if not bm.algorithms.create(name).averages_models:
            mine = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            assert all(torch.equal(mine, other) for other in bm.allgather(mine[None])), \
                "the ranks' models differ"
    opt.close()


def suite_checks() -> dict:
    out = {f"matches_twin_{name}": (lambda rank, size, n=name: check_matches_twin(n, rank, size))
           for name in bm.algorithms.names()}
    out.update({f"converted_after_the_first_step_{name}": (
        lambda rank, size, n=name: check_converted_after_the_first_step(n, rank, size))
        for name in bm.algorithms.names()})
    out.update({
        "gradient_allreduce_matches_one_process": check_gradient_allreduce_matches_one_process,
        "zero_state_matches_unsharded": check_zero_state_matches_unsharded,
        "ranks_with_other_layouts_are_refused": check_ranks_with_other_layouts_are_refused,
        "checkpoint_of_another_layout_is_refused": check_checkpoint_of_another_layout_is_refused,
    })
    return out


if __name__ == "__main__":
    sys.exit(run_suite(suite_checks()))
