"""Exchange plans kept across steps (``AlgorithmImpl.kept_plan``): PowerSGD's, QSGD's and
ByteGrad's (C_LP_S), Top-k's and gTop-k's, 1-bit Adam's, and those of L-GreCo's three families
(PowerSGD, min-max C_LP_S, gTop-k).

``python kept_plans_suite.py`` on every rank. A kept plan holds views of a bucket's gradients
and of the algorithm's state tensors, made at the first compressed step; it must be made again
whenever those move. The oracle is a twin optimizer, with the same model and per-rank data,
that plans every step (its kept plans are dropped before each step). Through steps with the
plan kept, a skipped step (gradients exchanged, then discarded: PowerSGD's Q restarts, so its
plans are made again; error memories and residuals are zeroed where they are, so the others'
plans are kept; 1-bit Adam refuses the skip, so it takes a step there), a roll-back to an
earlier state loaded into the stepped optimizer, and, for L-GreCo, decisions that replace the
assignment, both must hold the same parameters bit for bit after each phase, the kept plans
must be the same objects while nothing moved and new ones after, and a step with kept plans
must view no tensor and ask for no new array, its exchanges receiving into the memory they
received into a step before (its payload buffers are kept too). A bfloat16 model's buckets (a
float32 copy of the gradients each step) keep no plan, unless the plan views only the
algorithm's float32 state (1-bit Adam's momentum), and match their twin too.
"""
import contextlib
import sys
import warnings

import torch

import bagua_mpi as bm
from bagua_mpi.algorithms import QSGD, ByteGrad, GTopK, OneBitAdam, PowerSGD, TopK
from bagua_mpi.lgreco import LGreCo
from checks import run_suite
from dispatch_count import ArraysAsked, shares_memory

# decisions after steps 2, 5, 8 and 11
ALGORITHMS = {
    "powersgd": lambda: PowerSGD(rank=2, seed=3),
    # a bucket's flat gradient in one exchange, with error memories or a residual
    "qsgd": lambda: QSGD(levels=15, seed=5, error_feedback=True),
    "bytegrad": lambda: ByteGrad(bits=4, error_feedback=True),
    "topk": lambda: TopK(density=0.1),
    "gtopk": lambda: GTopK(density=0.1),
    # its momentum's exchange, from the third step on (Adam, below)
    "onebit_adam": lambda: OneBitAdam(warmup_steps=2),
    **{f"lgreco_{family}": (lambda family=family, default=default: LGreCo(
        family=family, default=default, warmup_steps=3, period_steps=3))
       for family, default in (("powersgd", 2), ("minmax", 4), ("topk", 0.05))},
}
# those whose plans view state that a skipped step makes anew (PowerSGD's Q)
SKIP_REPLANS = {"powersgd", "lgreco_powersgd"}
REFUSES_SKIPS = {"onebit_adam"}
# those whose plans view the algorithm's state only, not the gradients (1-bit Adam's momentum)
PLANS_STATE_ONLY = {"onebit_adam"}


def twins(make_algorithm, dtype=torch.float32):
    """[(model, optimizer)] x 2, alike: three layers in at least two buckets."""
    pair = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 24), torch.nn.Tanh(),
                                    torch.nn.Linear(24, 8)).to(dtype)
        algorithm = make_algorithm()
        inner = (torch.optim.Adam(model.parameters(), lr=1e-3)
                 if isinstance(algorithm, OneBitAdam) else
                 torch.optim.SGD(model.parameters(), lr=0.05))
        opt = bm.DistributedOptimizer(inner,
                                      named_parameters=model.named_parameters(),
                                      algorithm=algorithm, bucket_size_mb=0.004)
        pair.append((model, opt))
    return pair


def step_both(pair, x, take=True):
    """One step of each twin on ``x`` (the second plans afresh); ``take=False``: the
    gradients are exchanged, then discarded (the next backward pass skips the step). Returns
    what the first twin's exchanges asked for (``dispatch_count.ArraysAsked``)."""
    asked = ArraysAsked()
    for (model, opt), replan in zip(pair, (False, True)):
        if replan:
            opt.impl._plans.clear()
        with contextlib.nullcontext() if replan else asked:
            opt.zero_grad()
            model(x.to(next(model.parameters()).dtype)).square().mean().backward()
            if take:
                opt.step()
            else:
                opt.synchronize()
    return asked


def assert_same(pair, phase):
    (a, _), (b, _) = pair
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), \
        f"{phase}: the model with kept plans differs from its twin"


def check_kept_plans(name, rank, size):
    make = ALGORITHMS[name]
    gen = torch.Generator().manual_seed(77 + rank)
    batches = [torch.randn(8, 16, generator=gen) for _ in range(16)]
    pair = twins(make)
    (model, opt), _ = pair
    impl = opt.impl
    for x in batches[:4]:
        before = step_both(pair, x)
    buckets = len(impl.buckets)
    assert buckets >= 2 and len(impl._plans) == buckets, (buckets, impl._plans)
    plans = dict(impl._plans)
    saved = ([p.detach().clone() for p in model.parameters()], opt.algorithm_state_dict())
    asked = step_both(pair, batches[4])
    assert all(impl._plans[k] is plans[k] for k in plans), "a kept plan was made again"
    # nothing viewed in a step with kept plans (a view of a CUDA tensor costs some 24 us), and
    # no new payload buffer (the exchanges' buffers are kept: device_arrays.kept): each
    # exchange receives into the memory it received into a step before, which is still held
    # here, so a new array could not be there
    received, received_before = asked.received, before.received
    apart = [i for i, (a, b) in enumerate(zip(received, received_before))
             if not shares_memory(a, b)]
    # agreed first: a gTop-k tree receives on some ranks only, and a rank failing alone here
    # would leave the others in the next step's collectives
    for r, (v, n, counts, gone) in enumerate(bm.allgather_object(
            (len(asked.views), len(asked.new), (len(received), len(received_before)), apart))):
        assert v == 0, f"rank {r}: {v} tensors viewed in a step with kept plans"
        assert n == 0, f"rank {r}: {n} new arrays in a step with kept plans"
        assert counts[0] == counts[1], f"rank {r}: {counts} exchanges received into"
        assert not gone, f"rank {r}: exchanges {gone} of {counts[0]} received into new memory"
    assert_same(pair, "steps with kept plans")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the discarded exchange is warned about
        # 1-bit Adam refuses a skipped step in its compressed stage (a named MisuseError)
        step_both(pair, batches[5], take=name in REFUSES_SKIPS)
        step_both(pair, batches[6])
    if name in SKIP_REPLANS:
        assert all(impl._plans[k] is not plans[k] for k in plans), "no new plan after a skip"
    else:
        assert all(impl._plans[k] is plans[k] for k in plans), "made again after a skip"
    assert_same(pair, "a skipped step")

    for m, o in pair:   # back to the state after step 4, into the stepped optimizers
        with torch.no_grad():
            for p, value in zip(m.parameters(), saved[0]):
                p.copy_(value)
        o.load_algorithm_state_dict(saved[1])
    decided = hasattr(impl, "decisions")   # L-GreCo
    planned_anew = 0
    for x in batches[7:13]:
        plans, decisions = dict(impl._plans), getattr(impl, "decisions", 0)
        step_both(pair, x)
        if decided and impl.decisions != decisions:   # a new assignment: new plans
            step_both(pair, batches[13])
            assert all(impl._plans[k] is not plans[k] for k in plans), "kept past a decision"
            planned_anew += 1
    assert planned_anew >= 2 or not decided, planned_anew
    assert_same(pair, "a roll-back" + (", then decisions" if decided else ""))
    for _, o in pair:
        o.close()

    pair = twins(make, torch.bfloat16)
    for x in batches[:6]:
        step_both(pair, x)
    if name in PLANS_STATE_ONLY:   # the momentum is float32 whatever the gradients
        assert pair[0][1].impl._plans, "no plan kept of the algorithm's own state"
    else:
        assert not pair[0][1].impl._plans, "a plan kept for a float32 copy made each step"
    assert_same(pair, "bfloat16 buckets")
    for _, o in pair:
        o.close()


def suite_checks() -> dict:
    return {f"kept_plans_{name}": (lambda rank, size, n=name: check_kept_plans(n, rank, size))
            for name in ALGORITHMS}


if __name__ == "__main__":
    sys.exit(run_suite(suite_checks()))
