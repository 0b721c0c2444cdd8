"""L-GreCo under mpiexec: decisions identical on every rank, reacting to layer statistics,
training within tolerance of uniform compression, and a state round-trip.

``python lgreco_suite.py [--check NAME]`` on every rank; each check reports its own line."""
import contextlib
import itertools
import sys

import torch

import bagua_mpi as bm
from bagua_mpi.lgreco import LGreCo
from bagua_mpi.primitives import lowprec, sparse
from bagua_mpi.primitives.lowprec import Segment
from bagua_mpi.primitives.sparse import SparseSegment
from checks import run_suite
from dispatch_count import ArraysAsked


class Hetero(torch.nn.Module):
    """Layers of very different sizes and gradient scales."""

    def __init__(self):
        super().__init__()
        self.wide = torch.nn.Linear(256, 64)
        self.mid = torch.nn.Linear(64, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.wide(x)))))


BOOST = 1000.0


def train(algorithm, steps, rank, boost_after=None, lr=0.05, **options):
    torch.manual_seed(0)
    model = Hetero()
    teacher = torch.nn.Linear(256, 1)
    head = model.head.weight
    others = [p for p in model.parameters() if p is not head]
    sgd = torch.optim.SGD([{"params": others}, {"params": [head]}], lr=lr)
    names = [n for n, p in model.named_parameters() if p is not head] + ["head.weight"]
    opt = bm.DistributedOptimizer(sgd, named_parameters=[(n, dict(model.named_parameters())[n])
                                                         for n in names], algorithm=algorithm,
                                  **options)
    boosted = []
    head.register_hook(lambda grad: grad * BOOST if boosted else grad)
    g = torch.Generator().manual_seed(rank)
    history = []
    for step in range(steps):
        x = torch.randn(32, 256, generator=g)
        if boost_after is not None and step == boost_after and not boosted:
            # change the layer statistics: the head weight's gradient becomes 1000x larger
            # (and its learning rate 1000x smaller, so training itself is unchanged)
            boosted.append(True)
            sgd.param_groups[1]["lr"] = lr / BOOST
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), teacher(x).detach())
        loss.backward()
        opt.step()
        history.append(dict(opt.impl.assignment) if hasattr(opt.impl, "assignment") else {})
    xe = torch.randn(256, 256, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        final = float(torch.nn.functional.mse_loss(model(xe), teacher(xe)))
    opt.close()
    return final, history, opt


def check_bfloat16_gradients(rank, size):
    """bfloat16 gradients go through one float32 copy of the bucket and come back reduced: the
    ranks' different gradients end up identical (the average), and each layer agrees. The
    copy's slices are compressed together, with the bytes of compressing them one by one."""
    results = []
    for apart in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 5)).bfloat16()
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                      named_parameters=model.named_parameters(),
                                      algorithm=LGreCo(family="minmax", default=8,
                                                       warmup_steps=1, period_steps=1))
        grads = []
        with together_runs(lowprec, apart) as runs:
            for _ in range(3):
                opt.zero_grad()
                x = torch.randn(8, 40, generator=torch.Generator().manual_seed(rank)).bfloat16()
                model(x).float().square().sum().backward()
                local = [p.grad.float().clone() for p in model.parameters()]
                opt.step()
                grads.append([p.grad.clone() for p in model.parameters()])
                for p, mine in zip(model.parameters(), local):
                    assert p.grad.dtype == torch.bfloat16
                    everyone = bm.allgather_object(p.grad.float())
                    assert all(torch.equal(everyone[0], g) for g in everyone), "ranks differ"
                    mean = torch.stack(bm.allgather_object(mine)).mean(0)
                    # 8-bit min-max of a bfloat16 gradient: within a few quantization steps
                    assert torch.allclose(p.grad.float(), mean,
                                          atol=0.05 * mean.abs().max() + 1e-3)
        assert runs == ([] if apart else [4, 4, 4]), (apart, runs)
        results.append(grads)
        opt.close()
    together, apart = results
    assert all(torch.equal(a, b) for step_a, step_b in zip(together, apart)
               for a, b in zip(step_a, step_b)), "together and one by one differ"


def check_error_memories_end_to_end(opt):
    """The min-max family keeps a bucket's error memories end to end, one memory per kind, so
    its exchange can run all the layers in one launch a step on a GPU (``lowprec._Together``
    takes them when ``_shared_bases`` finds the common memory); so they stay after a state
    round-trip (a checkpoint load), with their values."""
    impl = opt.impl
    for bucket in opt.buckets:
        grads = bucket.grad_views()
        layers = [Segment(g.reshape(-1), impl.family.codec(4), *impl.family.layer_errors(
            impl, name)) for name, g in zip(bucket.names, grads)]
        before = [(seg.worker_error.clone(), seg.server_error.clone()) for seg in layers]
        assert any(w.abs().sum() > 0 for w, _ in before), "error feedback left nothing"
        bases = lowprec._shared_bases(layers)
        assert bases is not None, f"bucket {bucket.index}: no common memory for its layers"
        n = impl.comm.Get_size()
        numels = [g.numel() for g in grads]
        assert bases.worker_offsets == list(itertools.accumulate(
            [lowprec.padded_length(k, n) for k in numels[:-1]], initial=0)), bases
        assert bases.server_offsets == list(itertools.accumulate(
            [lowprec.partition_length(k, n) for k in numels[:-1]], initial=0)), bases
        opt.load_algorithm_state_dict(opt.algorithm_state_dict())
        again = [Segment(seg.flat, seg.codec, *impl.family.layer_errors(impl, name))
                 for seg, name in zip(layers, bucket.names)]
        after = lowprec._shared_bases(again)
        assert after is not None and after.worker_offsets == bases.worker_offsets
        for seg, (w, s) in zip(again, before):
            assert torch.equal(seg.worker_error, w) and torch.equal(seg.server_error, s)


@contextlib.contextmanager
def together_runs(module, apart=False):
    """Yields a list that gets, for every exchange of ``module`` (``lowprec``: C_LP_S,
    ``sparse``: gTop-k) that runs its layers' steps together (its ``_shared_bases`` found
    their common memory), their number; with ``apart``, no exchange may."""
    runs = []
    original = module._shared_bases

    def counted(segments):
        bases = None if apart else original(segments)
        if bases is not None:
            runs.append(len(segments))
        return bases
    module._shared_bases = counted
    try:
        yield runs
    finally:
        module._shared_bases = original


def check_layers_together_as_one_by_one(rank, algo, module, views_per_plan):
    """Training with the bucket's layers' steps run together (one launch a step on a GPU, one
    parallel loop on the host) gives the losses and decisions of running them one by one,
    exactly; and the together route did run, planned once a bucket and assignment (the plan
    kept across the steps between decisions), viewing its base arrays only
    (``views_per_plan`` of them), not every layer's tensors (a view of a CUDA tensor costs
    some 24 us). Returns the optimizer trained together."""
    with ArraysAsked() as asked, together_runs(module) as runs:
        loss, history, opt = train(algo, 12, rank)
    views = asked.views
    impl = opt.impl
    assert impl.decisions == 3 and all(len(obs) == 12 for obs in impl.observations.values())
    assert len(runs) == len(opt.buckets) * (impl.decisions + 1) and min(runs) > 1, runs
    assert len(views) == views_per_plan * len(runs), (len(views), len(runs))
    with together_runs(module, apart=True) as runs:
        assert (loss, history) == train(algo, 12, rank)[:2]
    assert not runs, "the one-by-one run took the together route"
    return opt


def check_topk_residuals_end_to_end(rank):
    """The top-k family keeps a bucket's residuals end to end in one memory, so its gTop-k
    selects and decodes all the layers at once, with the losses and decisions of doing them
    one by one; the memory stays one after a state round-trip (a checkpoint load), with its
    values."""
    opt = check_layers_together_as_one_by_one(
        rank, LGreCo(family="topk", default=0.05, warmup_steps=3, period_steps=4), sparse, 2)
    impl = opt.impl
    for bucket in opt.buckets:
        grads = bucket.grad_views()
        residuals = [impl.family.residual(impl, name) for name in bucket.names]
        assert any(r.abs().sum() > 0 for r in residuals), "error feedback left nothing"
        before = [r.clone() for r in residuals]
        segments = [SparseSegment(g.reshape(-1), 1, r) for g, r in zip(grads, residuals)]
        bases = sparse._shared_bases(segments)
        assert bases is not None, f"bucket {bucket.index}: no common memory for its residuals"
        assert bases.residual_offsets == list(itertools.accumulate(
            [g.numel() for g in grads[:-1]], initial=0)), bases
        opt.load_algorithm_state_dict(opt.algorithm_state_dict())
        again = [impl.family.residual(impl, name) for name in bucket.names]
        assert sparse._shared_bases([SparseSegment(s.flat, 1, r)
                                     for s, r in zip(segments, again)]) is not None
        assert all(torch.equal(r, b) for r, b in zip(again, before))


MINMAX = LGreCo(family="minmax", default=4, warmup_steps=10, period_steps=10)
TIME_AWARE = LGreCo(family="minmax", default=4, warmup_steps=5, period_steps=10,
                    time_aware=True)


def check_decisions_and_training(rank, size):
    """Every decision the same on every rank, one packed exchange per bucket and step
    whatever its layers, and training within 1.25x of uniform 4-bit min-max and of float32."""
    loss, history, opt = train(MINMAX, 60, rank)
    assert bm.allgather_object(history) == [history] * size
    assert opt.impl.decisions == 6, opt.impl.decisions
    buckets = opt.impl.observations
    layers = sum(len(b.params) for b in opt.buckets)
    assert layers > len(buckets) and all(len(obs) == 60 for obs in buckets.values()), \
        {b: len(obs) for b, obs in buckets.items()}
    uniform, _, _ = train(bm.algorithms.ByteGrad(bits=4, error_feedback=True), 60, rank)
    dense, _, _ = train("gradient_allreduce", 60, rank)
    assert loss <= 1.25 * uniform + 0.01 and loss <= 1.25 * dense + 0.01, (loss, uniform, dense)


def check_error_memories(rank, size):
    check_error_memories_end_to_end(train(MINMAX, 20, rank)[2])


def check_minmax_layers_together(rank, size):
    check_layers_together_as_one_by_one(
        rank, LGreCo(family="minmax", default=4, warmup_steps=3, period_steps=4), lowprec, 3)


def check_topk_residuals(rank, size):
    check_topk_residuals_end_to_end(rank)


def check_assignment_follows_statistics(rank, size):
    """Statistics change -> the assignment changes: once the head's gradient is 1000x larger,
    its error dominates the budget, so it keeps the most bits and every other layer can drop
    to the fewest (2 of the 2..8 searched around the default 4). Assignments are keyed by
    parameter name."""
    _, history, _ = train(MINMAX, 60, rank, boost_after=30)
    before, after = history[29], history[-1]
    head = "head.weight"
    assert before != after, (before, after)
    assert after[head] == 8 and all(after[k] == 2 for k in after if k != head), after
    assert any(before[k] > 2 for k in before if k != head), before


def check_families_and_time_aware(rank, size):
    """The PowerSGD and top-k families and the time-aware variant run and agree across ranks,
    each within 1.25x of the uniform setting of its family over the same steps."""
    for variant, uniform_algo in (
            (LGreCo(family="powersgd", default=2, warmup_steps=5, period_steps=10),
             LGreCo(family="powersgd", default=2, warmup_steps=10**9)),
            (LGreCo(family="topk", default=0.05, warmup_steps=5, period_steps=10),
             bm.algorithms.GTopK(density=0.05)),
            (TIME_AWARE, bm.algorithms.ByteGrad(bits=4, error_feedback=True))):
        loss_v, history, _ = train(variant, 30, rank)
        assert bm.allgather_object(history) == [history] * size
        reference, _, _ = train(uniform_algo, 30, rank)
        assert loss_v <= 1.25 * reference + 0.01, (variant, loss_v, reference)


def check_unflattened_buckets(rank, size):
    """Unflattened buckets stage each layer's own gradient: the same exchange, the same
    result."""
    algo = LGreCo(family="minmax", default=3, warmup_steps=5, period_steps=5)
    flat_loss, flat_history, _ = train(algo, 15, rank)
    loose_loss, loose_history, _ = train(algo, 15, rank, flatten=False)
    assert (flat_loss, flat_history) == (loose_loss, loose_history), (flat_loss, loose_loss)


def check_state_round_trip(rank, size):
    """What checkpoints store: the assignment survives a state round-trip."""
    _, history, opt = train(TIME_AWARE, 30, rank)
    opt.load_algorithm_state_dict(opt.algorithm_state_dict())
    assert opt.impl.assignment == history[-1]


def suite_checks() -> dict:
    """Every check by name, each reported on its own (``checks.run_suite``)."""
    return {"decisions_and_training": check_decisions_and_training,
            "error_memories_end_to_end": check_error_memories,
            "minmax_layers_together_as_one_by_one": check_minmax_layers_together,
            "topk_residuals_end_to_end": check_topk_residuals,
            "assignment_follows_statistics": check_assignment_follows_statistics,
            "families_and_time_aware": check_families_and_time_aware,
            "unflattened_buckets": check_unflattened_buckets,
            "bfloat16_gradients": check_bfloat16_gradients,
            "state_round_trip": check_state_round_trip}


if __name__ == "__main__":
    sys.exit(run_suite(suite_checks()))
