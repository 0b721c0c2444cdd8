"""DistributedOptimizer: n ranks must equal single-process training on the combined batch.

``python optimizer_suite.py`` on every rank. The reference (one process, the concatenated
batch of all ranks) is computed on every rank, so each compares with it directly.
"""
import copy
import itertools
import json
import os
import sys
import tempfile
import warnings

import torch
import torch.utils.checkpoint

import bagua_mpi as bm
from bagua_mpi.algorithms.model_averaging import ModelAveragingImpl
from bagua_mpi.exceptions import MisuseError
from checks import expect, run_suite
from short_runs import HYPERPARAMETERS, PerTensorSGD

STEPS = 10
BATCH = 6  # rows per rank per backward pass


class Net(torch.nn.Module):
    """Declaration order differs from execution order; one frozen weight; one branch that is
    only used on even steps."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 4)
        self.frozen = torch.nn.Linear(8, 16)
        self.frozen.weight.requires_grad_(False)
        self.body = torch.nn.Linear(12, 8)
        self.embed = torch.nn.Linear(10, 12)
        self.branch = torch.nn.Linear(12, 8)

    def forward(self, x, step):
        h = torch.tanh(self.embed(x))
        b = self.body(h)
        if step % 2 == 0:
            b = b + self.branch(h)
        return self.head(torch.tanh(self.frozen(torch.tanh(b))))


def data(step: int, rank: int, rows: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 10, generator=g), torch.randn(rows, 4, generator=g)


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def reference(kind: str, size: int, passes: int, clip: float | None = None) -> dict:
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(kind, [p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        batches = [data(step * passes + k, r, BATCH) for k in range(passes) for r in range(size)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x, step), y).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > clip, f"step {step}: norm {norm} under {clip}: nothing is clipped"
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def distributed(kind: str, passes: int = 1, clip: float | None = None, **options):
    torch.manual_seed(0)
    model = Net()
    opt = bm.DistributedOptimizer(
        make_optimizer(kind, [p for p in model.parameters() if p.requires_grad]),
        named_parameters=model.named_parameters(), backward_passes_per_step=passes,
        find_unused_parameters=True, **options)
    bm.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(passes):
            x, y = data(step * passes + k, bm.rank(), BATCH)
            loss = torch.nn.functional.mse_loss(model(x, step), y) / passes
            loss.backward()
        if clip is not None:  # right after backward, as with DDP: no synchronize() first
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    opt.close()
    return model, opt


def assert_params_equal(model, expected: dict, what: str) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{what}: parameter {name}: {m}")


def check_equivalence(size: int) -> int:
    configs = {
        "default": {},
        "overlap off": {"overlap": False},
        "flatten off": {"flatten": False},
        "hierarchical": {"hierarchical": True},
        "hierarchical off": {"hierarchical": False},
        "one bucket per tensor": {"bucket_size_mb": 1e-6},
        "declaration order": {"profile_order": False, "bucket_size_mb": 1e-6},
        "predivide": {"gradient_predivide_factor": 2.0},
    }
    checks = 0
    for kind in ("sgd", "adam"):
        expected = reference(kind, size, passes=1)
        for label, options in configs.items():
            model, _ = distributed(kind, **options)
            assert_params_equal(model, expected, f"{kind} {label}")
            checks += 1
        model, _ = distributed(kind, passes=4)
        assert_params_equal(model, reference(kind, size, passes=4), f"{kind} 4 passes")
        checks += 1
    return checks


CLIP = 0.05  # under every step's gradient norm here (the reference asserts it)


def check_clip_right_after_backward(size: int) -> int:
    """``backward()`` returns with the gradients synchronized, as DDP's does, so clipping right
    after it (no ``synchronize()``) clips the averaged gradients, alike on every rank: the
    single-process run on the combined batch, clipped. With overlap on, clipping used to scale
    buckets still on the wire and the ranks drifted apart; with it off, each rank clipped its
    own gradients before they were averaged."""
    checks = 0
    for label, passes, options in (("overlap on", 1, {"overlap": True}),
                                   ("overlap off", 1, {"overlap": False}),
                                   ("overlap on, 2 passes", 2, {"overlap": True})):
        model, _ = distributed("sgd", passes=passes, clip=CLIP, bucket_size_mb=1e-6, **options)
        assert_params_equal(model, reference("sgd", size, passes, clip=CLIP),
                            f"clipped after backward, {label}")
        checks += 1
    return checks


class CheckpointedNet(torch.nn.Module):
    """Activation checkpointing of the middle blocks (``whole``: of everything), reentrant or
    not (``reentrant`` None: no checkpointing)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(10, 12)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.Tanh(),
                                          torch.nn.Linear(12, 12), torch.nn.Tanh())
        self.head = torch.nn.Linear(12, 4)

    def forward(self, x, reentrant: bool | None, whole: bool):
        if reentrant is None:
            return self.head(self.blocks(torch.tanh(self.embed(x))))
        run = torch.utils.checkpoint.checkpoint
        if whole:
            return run(lambda z: self.head(self.blocks(torch.tanh(self.embed(z)))),
                       x.requires_grad_(), use_reentrant=reentrant)
        return self.head(run(self.blocks, torch.tanh(self.embed(x)), use_reentrant=reentrant))


def check_activation_checkpointing(size: int) -> int:
    """Reentrant checkpointing runs a backward pass inside another: the inner one's end must not
    finish the exchange while the outer one still has gradients to add (the embedding's; the
    buckets would go out twice). With parameters outside the checkpointed blocks, clipping
    right after backward still clips the averaged gradients; with everything checkpointed,
    ``step()`` finishes the exchange. Each against one process on the combined batch, and
    sending the bytes of the same training without checkpointing."""
    def train(reentrant: bool | None, whole: bool, clip: bool, ranks) -> tuple[dict, int]:
        torch.manual_seed(0)
        model = CheckpointedNet()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = sgd if ranks is None else bm.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(), overlap=True, bucket_size_mb=1e-6)
        for step in range(STEPS):
            batches = [data(step, r, BATCH) for r in (range(size) if ranks is None else ranks)]
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x, reentrant, whole), y).backward()
            if clip:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                assert ranks is not None or norm > CLIP, f"step {step}: nothing is clipped"
            opt.step()
        sent = 0
        if ranks is not None:
            sent = opt.communication_stats()["bytes_sent"]
            opt.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, sent

    _, plain_bytes = train(None, False, False, [bm.rank()])
    checks = 0
    for reentrant, whole, clip in ((True, False, True), (False, False, True),
                                   (True, True, False)):
        label = (f"{'reentrant' if reentrant else 'non-reentrant'} checkpointing of "
                 f"{'everything' if whole else 'the blocks'}{', clipped' if clip else ''}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reentrant checkpointing's deprecation notes
            got, sent = train(reentrant, whole, clip, [bm.rank()])
            expected, _ = train(reentrant, whole, clip, None)
        for name, value in got.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{label}: parameter {name}: {m}")
        assert sent == plain_bytes, f"{label}: {sent} bytes sent, {plain_bytes} without it"
        checks += 1
    return checks


def check_shared_block_under_reentrant_checkpointing(rank: int, size: int) -> int:
    """A block applied twice, each application under reentrant checkpointing (ALBERT's shared
    layers): its parameters get one gradient per application within one backward pass, which
    the engine refuses; the error names the cause and use_reentrant=False (its advice was
    about backward_passes_per_step alone), with which training matches one process."""
    import torch.utils.checkpoint as checkpoint

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.block, self.out = (torch.nn.Linear(10, 8), torch.nn.Linear(8, 8),
                                              torch.nn.Linear(8, 4))

        def forward(self, x, reentrant):
            h = torch.tanh(self.inp(x))
            for _ in range(2):
                h = checkpoint.checkpoint(lambda z: torch.tanh(self.block(z)), h,
                                          use_reentrant=reentrant)
            return self.out(h)

    def train(reentrant, ranks):
        torch.manual_seed(0)
        net = Shared()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        if ranks is not None:
            opt = bm.DistributedOptimizer(opt, named_parameters=net.named_parameters())
        try:
            for step in range(3):
                opt.zero_grad()
                x, y = (torch.cat(t) for t in zip(*[data(step, r, BATCH)
                                                    for r in (ranks or range(size))]))
                torch.nn.functional.mse_loss(net(x, reentrant), y).backward()
                opt.step()
        finally:
            if ranks is not None:
                opt.close()
        return {n: p.detach() for n, p in net.named_parameters()}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect(MisuseError, lambda: train(True, [rank]), "use use_reentrant=False")
        got, expected = train(False, [rank]), train(False, None)
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-5, msg=name)
    return 2


def check_no_sync_and_skip_synchronize(size: int) -> int:
    """no_sync() accumulates locally; the next communicating backward sends the sum."""
    expected = reference("sgd", size, passes=2)
    torch.manual_seed(0)
    model = Net()
    opt = bm.DistributedOptimizer(make_optimizer("sgd", [p for p in model.parameters()
                                                          if p.requires_grad]),
                                  named_parameters=model.named_parameters(),
                                  find_unused_parameters=True)
    for step in range(STEPS):
        opt.zero_grad()
        with opt.no_sync():
            x, y = data(step * 2, bm.rank(), BATCH)
            (torch.nn.functional.mse_loss(model(x, step), y) / 2).backward()
        x, y = data(step * 2 + 1, bm.rank(), BATCH)
        (torch.nn.functional.mse_loss(model(x, step), y) / 2).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    opt.close()
    assert_params_equal(model, expected, "no_sync + skip_synchronize")
    return 1


class UnevenNet(Net):
    """``branch`` is used by a rank only on some steps, and on some steps by no rank at all."""

    def forward(self, x, use_branch):
        h = torch.tanh(self.embed(x))
        b = self.body(h)
        if use_branch:
            b = b + self.branch(h)
        return self.head(torch.tanh(self.frozen(torch.tanh(b))))


def uses_branch(step: int, rank: int) -> bool:
    return (step + rank) % 3 == 0  # at 2 ranks, every third step no rank uses it


def check_unused_default(size: int) -> int:
    """The default path (find_unused_parameters=False): a rank that did not use a parameter
    contributes a zero gradient, so the average is over all ranks, zeros included. Reference:
    one process minimising the mean of the ranks' losses, each with its own branch use, with
    gradients kept as zero tensors (never None), as the distributed default leaves them."""
    for kind in ("sgd", "adam"):
        torch.manual_seed(0)
        ref = UnevenNet()
        params = [p for p in ref.parameters() if p.requires_grad]
        ref_opt = make_optimizer(kind, params)
        for p in params:
            p.grad = torch.zeros_like(p)
        for step in range(STEPS):
            ref_opt.zero_grad(set_to_none=False)
            loss = sum(torch.nn.functional.mse_loss(
                ref(data(step, r, BATCH)[0], uses_branch(step, r)), data(step, r, BATCH)[1])
                for r in range(size)) / size
            loss.backward()
            ref_opt.step()

        torch.manual_seed(0)
        model = UnevenNet()
        opt = bm.DistributedOptimizer(
            make_optimizer(kind, [p for p in model.parameters() if p.requires_grad]),
            named_parameters=model.named_parameters())
        for step in range(STEPS):
            opt.zero_grad()
            x, y = data(step, bm.rank(), BATCH)
            torch.nn.functional.mse_loss(model(x, uses_branch(step, bm.rank())), y).backward()
            opt.step()
        opt.close()
        assert_params_equal(model, {n: p.detach() for n, p in ref.named_parameters()},
                            f"{kind} default unused-parameter path")
    return 2


class SparseNet(torch.nn.Module):
    """A sparse embedding (its gradient stays sparse) feeding a dense layer (bucketed)."""

    def __init__(self, rows: int = 10):
        super().__init__()
        self.emb = torch.nn.Embedding(rows, 4, sparse=True)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, idx):
        return self.head(self.emb(idx))


def sparse_indices(step, r, rows=10):
    return torch.tensor([(step + r) % rows, (3 * r + 1) % rows, 7])


def check_sparse_gradients(size: int) -> int:
    """nn.Embedding(sparse=True) beside a dense layer, with SGD and with SparseAdam (which
    only takes sparse gradients): by default the embedding's gradient is exchanged sparse and
    stays sparse; with sparse_as_dense=True it is averaged dense. Either way the model equals
    one process stepping on the mean of the ranks' losses over their own indices."""
    def make_opt(kind, model):
        if kind == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1)
        return torch.optim.SparseAdam([model.emb.weight], lr=0.05)

    checks = 0
    for kind, sparse_as_dense in (("sgd", False), ("sgd", True), ("sparse_adam", False)):
        torch.manual_seed(0)
        ref = SparseNet()
        ref_opt = make_opt(kind, ref)
        torch.manual_seed(0)
        model = SparseNet()
        opt = bm.DistributedOptimizer(make_opt(kind, model),
                                      named_parameters=model.named_parameters(),
                                      sparse_as_dense=sparse_as_dense)
        for step in range(4):
            ref_opt.zero_grad()
            (sum(ref(sparse_indices(step, r)).square().sum() for r in range(size))
             / size).backward()
            ref_opt.step()
            opt.zero_grad()
            with warnings.catch_warnings(record=True) as caught:  # the exchange and the step
                warnings.simplefilter("always")
                model(sparse_indices(step, bm.rank())).square().sum().backward()
                opt.step()
            # torch warns about sparse tensors built without saying whether to check them
            assert not caught, [str(w.message)[:120] for w in caught]
            what = f"{kind} sparse_as_dense={sparse_as_dense} step {step}"
            assert model.emb.weight.grad.is_sparse != sparse_as_dense, what
            if not sparse_as_dense:  # the exchanged gradient: every rank's rows, averaged
                expected = ref.emb.weight.grad.coalesce()
                got = model.emb.weight.grad
                assert got.is_coalesced(), what
                torch.testing.assert_close(got.to_dense(), expected.to_dense(), msg=what)
        opt.close()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), dict(ref.named_parameters())[name].detach(),
                                       msg=f"{kind} sparse_as_dense={sparse_as_dense}: {name}")
        checks += 1
    return checks


def check_sparse_embedding_frozen_after_wrapping(rank: int, size: int) -> int:
    """A sparse embedding frozen after two steps, with SGD momentum: from then on its
    gradient is None on every rank and it stays where it is, as in one process (an empty
    sparse gradient kept momentum moving it); the dense head trains on."""
    torch.manual_seed(0)
    model = SparseNet()
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters())
    frozen_at = None
    for step in range(5):
        if step == 2:
            model.emb.weight.requires_grad_(False)
            frozen_at = model.emb.weight.detach().clone()
        head = model.head.weight.detach().clone()
        opt.zero_grad()
        model(sparse_indices(step, rank)).square().sum().backward()
        opt.step()
        if frozen_at is not None:
            assert model.emb.weight.grad is None, step
            assert torch.equal(model.emb.weight.detach(), frozen_at), step
            assert not torch.equal(model.head.weight.detach(), head), step
    opt.close()
    return 1


class MultiHeadNet(torch.nn.Module):
    """A shared body and three heads, one per micro-batch (multi-task accumulation)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(5, 8)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(8, 2) for _ in range(3))

    def forward(self, x, k):
        return self.heads[k](torch.tanh(self.body(x)))


def check_find_unused_counts_no_sync_passes(rank: int, size: int) -> int:
    """find_unused_parameters=True with gradient accumulation: micro-batch k uses head k, the
    first two inside no_sync(), the last one outside. Heads 0 and 1 got their gradients only
    in no_sync() passes: they are used, their accumulated gradients exchanged and stepped, so
    the model equals one process on every rank's micro-batches (they were set to None and
    never moved)."""
    def batch(step, k, r):
        g = torch.Generator().manual_seed(100 * step + 10 * k + r)
        return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)

    def train(distributed):
        torch.manual_seed(0)
        net = MultiHeadNet()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        if distributed:
            opt = bm.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                          find_unused_parameters=True)
        for step in range(3):
            opt.zero_grad()
            for k in range(3):
                ranks = [rank] if distributed else range(size)
                loss = sum(torch.nn.functional.mse_loss(net(batch(step, k, r)[0], k),
                                                        batch(step, k, r)[1])
                           for r in ranks) / (3 * len(ranks))
                if distributed and k < 2:
                    with opt.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
        if distributed:
            opt.close()
        return net

    ref = train(False)
    assert_params_equal(train(True), {n: p.detach() for n, p in ref.named_parameters()},
                        "find_unused_parameters with no_sync passes")
    return 1


def check_sparse_gradients_send_rows(rank: int, size: int) -> int:
    """A large embedding's sparse exchange sends the rows touched, not the table: far fewer
    bytes than sparse_as_dense=True."""
    sent = {}
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        model = SparseNet(rows=20000)
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      sparse_as_dense=sparse_as_dense)
        for step in range(2):
            opt.zero_grad()
            model(sparse_indices(step, rank, 20000)).square().sum().backward()
            opt.step()
        sent[sparse_as_dense] = opt.communication_stats()["bytes_sent"]
        opt.close()
    if size > 1:
        assert sent[False] * 20 < sent[True], sent
    return 1


def check_join(rank: int, size: int) -> int:
    """Uneven data (Horovod's join): the last rank runs out after 2 of 4 steps and joins; the
    others' gradient allreduces go on with its zeros, averaged over all ranks. A compressed
    algorithm cannot take zeros from a joined rank, nor can the two-level exchange
    (``hierarchical=True``) or the first step's set-up: the training ranks get
    JoinedRankError, never a hang."""
    if size == 1:
        return 0
    last = size - 1

    def grad_of(r, step):  # d/dW of sum(W x + b) over 3 rows of value r + 1 + step
        return 3.0 * (r + 1 + step)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    seen = []
    for step in range(2 if rank == last else 4):
        opt.zero_grad()
        model(torch.full((3, 4), float(rank + 1 + step))).sum().backward()
        opt.step()
        seen.append(model.weight.grad[0, 0].item())
    joined_last = bm.join()
    assert joined_last != last and len(set(bm.allgather_object(joined_last))) == 1, joined_last
    for step, got in enumerate(seen):
        active = range(size) if step < 2 else range(last)
        expected = sum(grad_of(r, step) for r in active) / size
        assert abs(got - expected) < 1e-5, (step, got, expected)
    opt.close()

    for options in (dict(algorithm="qsgd"), dict(hierarchical=True)):  # hierarchical hung
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 8)
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), **options)
        raised = False
        for step in range(1 if rank == last else 2):
            opt.zero_grad()
            try:  # backward() finishes the exchange: the error comes from there
                model(torch.ones(2, 64)).sum().backward()
                opt.step()
            except bm.JoinedRankError as exc:
                raised = True
                name = options.get("algorithm", "gradient_allreduce")
                assert (f"a DistributedOptimizer's exchange (bucket 0, algorithm {name}) met a "
                        f"rank inside bagua_mpi.join()") in str(exc), str(exc)
        bm.join()
        assert raised == (rank != last), (options, rank, raised)
        opt.close()

    # a rank that joins before its first step: the others' first step builds the buckets,
    # which it cannot take part in; they get JoinedRankError saying so, not a hang
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    raised = False
    if rank != last:
        try:
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
        except bm.JoinedRankError as exc:
            raised = "join() only after the first step" in str(exc)
    bm.join()
    assert raised == (rank != last), (rank, raised)
    opt.close()
    return 3


def check_same_start(rank: int, size: int) -> int:
    """Ranks whose parameters differ at the first step (each seeded its own way, no
    broadcast_parameters) get MismatchError on every rank from that step, naming the remedy,
    before anything is stepped, where each used to train a model of its own; after
    broadcast_parameters they train. The algorithms that average models, and a job with the
    agreement check off, are not compared."""
    if size == 1:
        return 0
    checks = 0
    for algorithm in ("gradient_allreduce", "qsgd"):
        torch.manual_seed(rank)
        model = torch.nn.Linear(4, 2)
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      algorithm=algorithm)
        model(torch.ones(3, 4)).sum().backward()
        before = model.weight.detach().clone()
        expect(bm.MismatchError, opt.step, f"rank {rank}: the parameters differ from rank to "
               "rank at the first step (2 of 2 tensors: weight, bias)", algorithm,
               "bm.broadcast_parameters(model.state_dict(), root_rank=0)")
        assert torch.equal(model.weight, before), "stepped"
        bm.broadcast_parameters(model.state_dict(), root_rank=0)
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        weights = bm.allgather(model.weight.detach()[None])
        assert all(torch.equal(w, weights[0]) for w in weights), "the ranks differ"
        opt.close()
        checks += 1
    for options, seed in ((dict(algorithm="local_sgd"), rank), (dict(), rank)):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 2)
        if not options:
            bm.set_consistency_check(False)
        try:
            opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(), **options)
            model(torch.ones(3, 4)).sum().backward()
            opt.step()  # not compared: no error
            opt.close()
        finally:
            bm.set_consistency_check(True)
        checks += 1
    return checks


def _checks_ring_neighbours(name: str) -> bool:
    impl = bm.algorithms.create(name).impl_class
    return (issubclass(impl, ModelAveragingImpl)
            and impl.check_hyperparameters is ModelAveragingImpl.check_hyperparameters)


# the registered algorithms that compare hyperparameters with ring neighbours only: their
# MismatchError is raised next to the difference and ends the job through the abort, so they
# run in jobs of their own (test_optimizer_mpi.py, faults_suite.py lr)
RING_CHECKED = [name for name in bm.algorithms.names() if _checks_ring_neighbours(name)]


def model_averaging_with_differing_lr(name: str, rank: int, size: int, x, others: str) -> int:
    """The last rank's learning rate halves after step 1, as in the check below. ``local_sgd``
    (period 2) raises MismatchError on every rank as it is about to average at step 3, naming
    the values; ``async`` trains on (its averaging runs on a timer, not in step with the
    optimizer: ranks at different steps may rightly hold different scheduled rates)."""
    if name in RING_CHECKED:
        return 0
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    algorithm = bm.algorithms.create(name, **({"period": 2} if name == "local_sgd" else {}))
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), algorithm=algorithm)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    raised = None
    for step in range(4):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        try:
            opt.step()
        except bm.MismatchError as error:
            raised = (step, str(error))
            break
        if step < 2:
            scheduler.step(1.0 if rank == size - 1 else -float(step))
    opt.close()
    if name != "local_sgd":
        assert raised is None, f"{name}: {raised}"
        return 0
    assert raised is not None and raised[0] == 3, f"{name}: raised {raised}"
    for needle in (f"rank {rank}: the wrapped optimizer's hyperparameters differ across the "
                   f"ranks at step 3 (checked before the models are averaged; the last 2 "
                   f"local steps used them)",
                   f"param group 0 'lr': 0.01 on {others}; 0.005 on rank {size - 1}"):
        assert needle in raised[1], (needle, raised[1])
    return 1


def check_hyperparameters_that_differ(rank: int, size: int) -> int:
    """A ReduceLROnPlateau stepped on each rank's own metric, which lowers the learning rate on
    the last rank alone: the next step's first bucket raises MismatchError on every rank,
    naming the param group, 'lr' and each rank's value, before any rank steps with it (the
    ranks used to train apart, silently), for every registered algorithm that exchanges
    gradients, flat and with ``hierarchical=True`` (whose exchange skipped the check), and
    ``local_sgd`` before it averages. With the metric averaged first (the recipe the message
    gives) they train on alike."""
    if size == 1:
        return 0
    checks = 0
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    others = "rank 0" if size == 2 else f"ranks 0-{size - 2}"
    for name, hierarchical in itertools.product(bm.algorithms.names(), (False, True)):
        algorithm = bm.algorithms.create(name)
        if algorithm.averages_models:
            if not hierarchical:
                checks += model_averaging_with_differing_lr(name, rank, size, x, others)
            continue
        if hierarchical and algorithm.hierarchical_refusal is not None:
            continue
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 2)
        opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(), algorithm=name,
                                      hierarchical=hierarchical)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        for step in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            scheduler.step(1.0 if rank == size - 1 else -float(step))  # the last one plateaus
        opt.zero_grad()
        expect(bm.MismatchError, lambda: model(x).pow(2).mean().backward(),
               f"rank {rank}: the wrapped optimizer's hyperparameters differ across the ranks "
               f"at step 2", f"param group 0 'lr': 0.01 on {others}; 0.005 on rank {size - 1}",
               "average the metric over the ranks first")
        weights = bm.allgather(model.weight.detach()[None])
        assert all(torch.equal(w, weights[0]) for w in weights), f"{name}: the ranks differ"
        opt.close()
        checks += 1
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    for step in range(4):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        metric = 2.0 if rank == size - 1 else 1.0 - min(step, 1) / 2  # averaged: flat from 1
        scheduler.step(bm.allreduce(torch.tensor(metric)).item())
    assert opt.param_groups[0]["lr"] < 0.1  # the averaged metric plateaued: lowered alike
    weights = bm.allgather(model.weight.detach()[None])
    assert all(torch.equal(w, weights[0]) for w in weights), "the ranks differ"
    opt.close()
    return checks + 1


def expect_misuse(fn, *needles) -> str:
    try:
        fn()
    except MisuseError as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {exc}"
        return str(exc)
    raise AssertionError(f"{fn} did not raise MisuseError")


def check_misuse(rank: int, size: int) -> int:
    """A second backward pass after the step's exchange and before step(), and zero_grad()
    between the passes of one step (backward_passes_per_step=2), raise MisuseError on every
    rank (all ranks misuse alike here); zero_grad() after the exchange discards it (a skipped
    step); the optimizer keeps working."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    x = torch.randn(4, 6) + rank  # per rank
    expected = bm.allreduce(torch.ones(2, 6) * x.sum(0), bm.Average)  # d(sum)/dW, averaged
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", bm.DiscardedExchangeWarning)
        for step in range(3):  # the first step is the profiling one; all holds in both
            opt.zero_grad()
            model(x).sum().backward()
            torch.testing.assert_close(model.weight.grad, expected)  # returned averaged
            expect_misuse(lambda: model(x).sum().backward(), f"rank {rank}",
                          "backward_passes_per_step=1", "parameter '", "opt.zero_grad()")
            weight = model.weight.detach().clone()
            opt.zero_grad()  # discards the exchanged gradients: this step is skipped
            model(x).sum().backward()
            torch.testing.assert_close(model.weight.grad, expected)
            opt.step()
            torch.testing.assert_close(model.weight.detach(), weight - 0.1 * expected)
    told = [w for w in seen if issubclass(w.category, bm.DiscardedExchangeWarning)]
    assert len(told) == 1, [str(w.message) for w in told]  # the first discard, once
    opt.zero_grad()
    model(x).sum().backward()
    opt.synchronize()
    opt.synchronize()  # twice is harmless: the gradients are averaged once
    torch.testing.assert_close(model.weight.grad, expected)
    with opt.skip_synchronize():
        opt.step()
    opt.set_backward_passes_per_step(2)  # Horovod's method
    for step in range(2):
        opt.zero_grad()
        (model(x).sum() / 2).backward()
        expect_misuse(opt.zero_grad, f"rank {rank}", "zero_grad()", "waiting to be communicated")
        (model(x).sum() / 2).backward()
        torch.testing.assert_close(model.weight.grad, expected)
        opt.step()
    opt.close()
    return 4


def gan(algorithm: str, size: int, rank: int | None, recipe: str = "plain"):
    """(G, D, warnings) after a GAN's loop with one discriminator pass a step. ``rank`` None:
    one process on every rank's batch (the oracle). Recipes for the generator's pass, which
    runs through D: ``plain`` (as with DDP), ``no_sync`` (inside optD.no_sync())."""
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    D = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optG, optD = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (G, D))
    if rank is not None:
        optG = bm.DistributedOptimizer(optG, named_parameters=G.named_parameters())
        optD = bm.DistributedOptimizer(optD, named_parameters=D.named_parameters(),
                                       algorithm=bm.algorithms.create(algorithm))
    bce = torch.nn.BCEWithLogitsLoss()

    def batch(step):
        ranks = range(size) if rank is None else [rank]
        parts = [torch.randn(2, 12, generator=torch.Generator().manual_seed(100 * step + r))
                 for r in ranks]  # each rank its own noise and its own real samples
        both = torch.cat(parts)
        return both[:, :4], both[:, 4:] + 1.0

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", bm.DiscardedExchangeWarning)
        for step in range(5):
            z, real = batch(step)
            optD.zero_grad()
            fake = G(z).detach()
            (bce(D(real), torch.ones(len(real), 1))
             + bce(D(fake), torch.zeros(len(fake), 1))).backward()
            optD.step()
            optG.zero_grad()
            loss = bce(D(G(z)), torch.ones(len(z), 1))
            if recipe == "no_sync":
                with optD.no_sync():
                    loss.backward()
            else:
                loss.backward()
            optG.step()
    if rank is not None:
        optG.close()
        optD.close()
    return G, D, [w for w in seen if issubclass(w.category, bm.DiscardedExchangeWarning)]


def check_gan_discarded_exchange(rank: int, size: int) -> int:
    """A GAN's loop with one discriminator pass a step: the generator's pass completes optD's
    exchange too, which optD's next zero_grad() discards. That warns once, naming the rank and,
    for an algorithm with error feedback, what it lost; run inside optD.no_sync() it warns
    nothing. Either way G and D train as one process does on every rank's batch."""
    G0, D0, _ = gan("gradient_allreduce", size, None)
    for recipe in ("plain", "no_sync"):
        G, D, told = gan("gradient_allreduce", size, rank, recipe)
        for got, want in ((G, G0), (D, D0)):
            for p, q in zip(got.parameters(), want.parameters()):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        expected = 1 if recipe == "plain" else 0
        assert len(told) == expected, (recipe, [str(w.message) for w in told])
        if told:
            text = str(told[0].message)
            for needle in (f"rank {rank}", "zero_grad()", "no_sync()"):
                assert needle in text, (needle, text)
            assert "restarted" not in text, text  # gradient_allreduce keeps no state
    _, _, told = gan("topk", size, rank)
    assert len(told) == 1 and "topk's error feedback restarted" in str(told[0].message), (
        [str(w.message) for w in told])
    _, _, told = gan("topk", size, rank, "no_sync")
    assert not told, [str(w.message) for w in told]
    return 4


def compiled_run(size: int, rank: int | None, momentum: float, **options):
    """Five steps of a small model under ``torch.compile`` (``rank`` None: eager, one process
    on every rank's batch: the oracle)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    forward = model
    if rank is not None:
        opt = bm.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **options)
        forward = torch.compile(model, backend="aot_eager")
    for step in range(5):
        batches = [data(step, r, BATCH) for r in (range(size) if rank is None else [rank])]
        x, y = (torch.cat(t) for t in zip(*batches))
        opt.zero_grad()
        torch.nn.functional.mse_loss(forward(x), y).backward()
        opt.step()
    if rank is not None:
        opt.close()
    return model


def check_torch_compile(rank: int, size: int) -> int:
    """A model compiled with ``torch.compile`` trains as one process does on the combined batch.
    The ``aot_eager`` backend runs what every backend runs around the parameters (Dynamo's
    graph, AOTAutograd's one backward node, whose gradients the parameters' hooks then see),
    without needing a C++ compiler. gradient_allreduce with overlap on and off; local_sgd with
    period 1 and plain SGD, whose model average after each step equals a step on the averaged
    gradient."""
    from torch._dynamo.utils import counters
    runs = [(0.9, dict(overlap=True, bucket_size_mb=0.0005)), (0.9, dict(overlap=False)),
            (0.0, dict(algorithm=bm.algorithms.create("local_sgd", period=1)))]
    for momentum, options in runs:
        expected = compiled_run(size, None, momentum)
        torch._dynamo.reset()  # each run compiles afresh (a run may reuse another's graph)
        graphs = counters["stats"]["unique_graphs"]
        model = compiled_run(size, rank, momentum, **options)
        assert counters["stats"]["unique_graphs"] > graphs, "nothing was compiled"
        for (name, p), q in zip(model.named_parameters(), expected.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{options}: {name}: {m}")
    return len(runs)


FROZEN_STEPS = range(3, 6)  # the first layer is frozen at steps 3-5 (after wrapping)


def freezing_run(size: int, rank: int | None, **options):
    """A model whose first layer is frozen (``requires_grad_(False)``) at ``FROZEN_STEPS``,
    trained by SGD with momentum and weight decay, which move a weight whenever it has a
    gradient, even a zero one. ``rank`` None: one process on every rank's batch (the oracle).
    Returns the model and the first layer's weight as each step left it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    if rank is not None:
        opt = bm.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **options)
    weights = []
    for step in range(8):
        model[0].requires_grad_(step not in FROZEN_STEPS)
        batches = [data(step, r, BATCH) for r in (range(size) if rank is None else [rank])]
        x, y = (torch.cat(t) for t in zip(*batches))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        weights.append(model[0].weight.detach().clone())
    if rank is not None:
        opt.close()
    return model, weights


def check_freeze_after_wrapping(rank: int, size: int) -> int:
    """A layer frozen after wrapping is left alone by the step, as without wrapping (it used to
    get a zero gradient, which momentum and weight decay turned into updates), and unfreezing
    it trains it again: every rank equals one process on the combined batch, at ZeRO stages
    0-2 (stage 0 with and without overlap). A layer frozen when the optimizer was wrapped is
    never exchanged: unfreezing it raises MisuseError at step(), naming it, before anything
    is stepped. A rank that freezes a layer the others train raises MismatchError on every
    rank, naming the layer."""
    expected, want = freezing_run(size, None)
    assert all(torch.equal(want[s], want[2]) for s in FROZEN_STEPS)  # the oracle holds still
    checks = 0
    for options in (dict(overlap=False), dict(overlap=True, bucket_size_mb=0.0005),
                    dict(zero_stage=1), dict(zero_stage=2)):
        model, got = freezing_run(size, rank, **options)
        for s in FROZEN_STEPS:
            assert torch.equal(got[s], got[2]), (options, f"the frozen layer moved at step {s}")
        for (name, p), q in zip(model.named_parameters(), expected.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{options}: {name}: {m}")
        checks += 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model[0].requires_grad_(False)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    x, y = data(0, rank, BATCH)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    model[0].requires_grad_(True)  # unfrozen: its gradients were never going to be exchanged
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    expect(MisuseError, opt.step, f"rank {rank}: 2 parameter(s) (0.weight, 0.bias)",
           "frozen (requires_grad=False) when the optimizer was wrapped", "after wrapping")
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "stepped"
    opt.close()
    checks += 1
    if size > 1:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4))
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
        for step in range(2):
            model[0].requires_grad_(not (step == 1 and rank == 0))
            opt.zero_grad()
            pass_ = lambda: torch.nn.functional.mse_loss(model(x), y).backward()  # noqa: E731
            if step == 0:
                pass_()
                opt.step()
            else:
                expect(bm.MismatchError, pass_, "frozen", "0.weight", "rank 0")
        opt.close()
        checks += 1
    return checks


PHASES = (2, 2, 3)  # steps of each optimizer in rewrapping_run


def rewrapping_run(size: int, rank: int | None, how: str, **options):
    """Progressive unfreezing with a new optimizer per phase, as trainers build one per
    epoch or per fine-tuning stage: the last layer alone first, then every layer (the first
    one's weight unfrozen) twice over, each phase a fresh SGD with momentum over the same
    parameters. ``how`` the earlier optimizer goes: ``rebind`` (the name bound to the new one),
    ``del`` (deleted first) or ``close`` (closed first). ``rank`` None: one process on every
    rank's batch (the oracle). Returns the model and the optimizers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model[0].requires_grad_(False)
    opt, wrapped, step = None, [], 0
    for phase, steps in enumerate(PHASES):
        params = model[2].parameters() if phase == 0 else model.parameters()
        if phase == 1:
            model[0].requires_grad_(True)
        if how == "close" and opt is not None:
            opt.close()
        elif how == "del" and opt is not None:
            del opt
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if rank is not None:
            opt = bm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                          **options)
            wrapped.append(opt)
        for _ in range(steps):
            batches = [data(step, r, BATCH) for r in (range(size) if rank is None else [rank])]
            x, y = (torch.cat(t) for t in zip(*batches))
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            step += 1
    return model, wrapped


def check_rewrapping(rank: int, size: int) -> int:
    """Wrapping parameters that an earlier DistributedOptimizer still hooks takes them over:
    the earlier one is closed (its hooks used to stay, and refused the new optimizer's first
    backward pass), so every rank trains as one process does on the combined batch, whether
    the earlier optimizer was rebound, deleted or closed, with and without overlap. The
    earlier optimizer's step() then raises MisuseError naming the parameters taken over. A
    rank that closed its earlier optimizer where the others did not raises MismatchError on
    every rank at the new wrap (the others' closing would run without it)."""
    expected, _ = rewrapping_run(size, None, "rebind")
    checks = 0
    for how, options in (("rebind", dict(overlap=False)),
                         ("rebind", dict(overlap=True, bucket_size_mb=0.0005)),
                         ("del", {}), ("close", {})):
        model, wrapped = rewrapping_run(size, rank, how, **options)
        for (name, p), q in zip(model.named_parameters(), expected.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{how} {options}: {name}: {m}")
        first = wrapped[0]
        if how == "close":
            expect_misuse(first.step, f"rank {rank}: step()", "close() was called")
        else:
            expect_misuse(first.step, f"rank {rank}: step()", "no longer exchanges gradients",
                          "a DistributedOptimizer wrapped later over its parameters",
                          "(2 of them: '2.weight', '2.bias')")
            expect_misuse(wrapped[1].synchronize, f"rank {rank}: synchronize()",
                          "(4 of them: '0.weight', '0.bias', '2.weight', ...)")
        wrapped[-1].close()
        checks += 1
    if size > 1:
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 2)
        first = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
        if rank == 0:
            first.close()
        try:
            bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters())
        except bm.MismatchError as exc:
            for needle in ("replaces_open_optimizers", "rank 0", "close() them on every rank"):
                assert needle in str(exc), f"{needle!r} not in {exc}"
        else:
            raise AssertionError("a rank that closed its earlier optimizer alone went unnoticed")
        first.close()  # the failed wrap closed nothing: the earlier optimizer is still open
        checks += 1
    return checks


def converting_run(size: int, rank: int | None):
    """Two float32 steps, the model converted to float64, and two more steps with a new
    optimizer over the converted parameters. ``rank`` None: one process on every rank's batch
    (the oracle). Returns the model and the error the first float64 backward pass raised under
    the earlier wrapper."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    error = None
    for phase, dtype in enumerate((torch.float32, torch.float64)):
        if phase:
            model.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if rank is not None:
            if phase:  # the earlier wrapper's buckets hold float32 gradients
                x, y = data(0, rank, BATCH)
                error = expect(MisuseError, lambda: torch.nn.functional.mse_loss(
                    model(x.double()), y.double()).backward())
            opt = bm.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        for step in range(2 * phase, 2 * phase + 2):
            batches = [data(step, r, BATCH) for r in (range(size) if rank is None else [rank])]
            x, y = (torch.cat(t).to(dtype) for t in zip(*batches))
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    if rank is not None:
        opt.close()
    return model, error


def check_converted_after_wrapping(rank: int, size: int) -> int:
    """A model converted to another dtype after the first step: the next backward pass raises
    MisuseError naming a parameter and the change (it was torch's error about assigning a
    float gradient to a double tensor), and a new optimizer wrapped over the converted
    parameters trains as one process does on the combined batch."""
    expected, _ = converting_run(size, None)
    model, error = converting_run(size, rank)
    for needle in (f"rank {rank}: parameter '", "(dtype float32 -> float64)",
                   "changed after the optimizer was wrapped", "convert the model before"):
        assert needle in str(error), f"{needle!r} not in {error}"
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        assert p.dtype == torch.float64, name
        # the float32 steps' rounding (the sum's order) carries into the float64 ones
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    return 2


def check_torch_optimizer_hooks(rank: int, size: int) -> int:
    """torch.optim.Optimizer's per-instance hooks work on the wrapper (they raised
    AttributeError): step pre-hooks run once per step (the Horovod subclass's step calls the
    base one), after the exchange, so they see the averaged gradients, and may replace the
    closure; post-hooks see the stepped parameters; removed hooks stop; state-dict hooks may
    replace what is saved and loaded. With ZeRO stage 1, an algorithm that averages models and
    Horovod's spelling."""
    import bagua_mpi.horovod as hvd
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    want = bm.allreduce(torch.ones(2, 6) * x.sum(0), bm.Average)  # d(sum)/dW, averaged
    checks = 0
    for make in (lambda m: bm.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                   named_parameters=m.named_parameters()),
                 lambda m: bm.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                   named_parameters=m.named_parameters(),
                                                   zero_stage=1),
                 lambda m: bm.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                   named_parameters=m.named_parameters(),
                                                   algorithm="local_sgd"),
                 lambda m: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                    named_parameters=m.named_parameters())):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 2)
        opt = make(model)
        seen = []

        def pre(optimizer, args, kwargs):
            assert optimizer is opt and args[0] is opt
            seen.append(("pre", model.weight.grad.clone(), model.weight.detach().clone()))
            if len(args) > 1:  # the closure a test passed, replaced
                return (opt, lambda: "replaced"), kwargs

        def post(optimizer, args, kwargs):
            seen.append(("post", None, model.weight.detach().clone()))
        handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
        for step in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            result = opt.step(lambda: "original") if step == 1 else opt.step()
        assert [kind for kind, _, _ in seen] == ["pre", "post"] * 2, [k for k, _, _ in seen]
        if not opt.algorithm.averages_models:
            torch.testing.assert_close(seen[0][1], want)  # the pre-hook saw them averaged
            assert result == "replaced", result
        assert torch.equal(seen[1][2], seen[2][2]) and not torch.equal(seen[0][2], seen[1][2])
        for handle in handles:
            handle.remove()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        assert len(seen) == 4, "a removed hook ran"
        calls = []
        opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "note": rank})
        opt.register_load_state_dict_pre_hook(
            lambda o, sd: {k: v for k, v in sd.items() if k != "note"})
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
        saved = opt.state_dict()
        assert saved["note"] == rank and calls == ["save pre"], (saved.keys(), calls)
        opt.load_state_dict(saved)
        assert calls == ["save pre", "load post"], calls
        opt.close()
        checks += 1
    return checks


def check_users_optimizer_hooks_every_algorithm(rank: int, size: int) -> int:
    """Hooks and an LR scheduler put on the user's optimizer before wrapping (as a script that
    builds its schedule with the optimizer does) see every step, under every registered
    algorithm past its warm-up: 1-bit Adam's compressed stage and ZeRO update without calling
    that optimizer's ``step``. The post-hook sees the stepped parameters, and the scheduler
    does not warn that the optimizer never stepped."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    checks = 0
    for name in bm.algorithms.names():
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 2)
        adam = torch.optim.Adam(model.parameters(), lr=0.01)
        seen = []
        adam.register_step_pre_hook(
            lambda optimizer, args, kwargs: seen.append(("pre", model.weight.detach().clone())))
        adam.register_step_post_hook(
            lambda optimizer, args, kwargs: seen.append(("post", model.weight.detach().clone())))
        scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5)
        opt = bm.DistributedOptimizer(adam, named_parameters=model.named_parameters(),
                                      algorithm=bm.algorithms.create(
                                          name, **HYPERPARAMETERS.get(name, {})))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
            for _ in range(5):
                opt.zero_grad()
                model(x).pow(2).sum().backward()
                opt.step()
                scheduler.step()
        kinds = [kind for kind, _ in seen]
        assert kinds == ["pre", "post"] * 5, f"{name}: {kinds}"
        for step in range(5):
            assert not torch.equal(seen[2 * step][1], seen[2 * step + 1][1]), (
                f"{name}, step {step}: the post-hook saw the parameters before the update")
        assert adam.param_groups[0]["lr"] == 0.01 * 0.5 ** 2, (name, adam.param_groups[0]["lr"])
        opt.close()
        checks += 1
    return checks


def growing_run(size: int, rank: int | None):
    """The last layer trained alone for 2 steps, then the first layer's parameters appended to
    the wrapped optimizer's group and 2 more steps. ``rank`` None: one process on every rank's
    batch (the oracle). Returns the model and the error the first step after the append
    raised under the earlier wrapper, and whether it stepped anything."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    torch_opt = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    opt = torch_opt
    if rank is not None:
        opt = bm.DistributedOptimizer(torch_opt, named_parameters=model.named_parameters())
    error, stepped = None, False
    for step in range(4):
        batches = [data(step, r, BATCH) for r in (range(size) if rank is None else [rank])]
        x, y = (torch.cat(t) for t in zip(*batches))
        if step == 2:
            torch_opt.param_groups[0]["params"].extend(model[0].parameters())
            if rank is not None:  # the parameters appended have no hook: refused
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                before = [p.detach().clone() for p in model.parameters()]
                error = expect(MisuseError, opt.step)
                stepped = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
                opt = bm.DistributedOptimizer(torch_opt, named_parameters=model.named_parameters())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if rank is not None:
        opt.close()
    return model, error, stepped


def check_groups_changed_after_wrapping(rank: int, size: int) -> int:
    """Parameters appended to a wrapped optimizer's param group (they have no hook and no
    bucket, and each rank used to train them alone, silently) make step() raise MisuseError
    naming the group and the count, before anything is stepped; the wrapped optimizer wrapped
    again (the remedy the message gives) trains as one process does on the combined batch."""
    expected, _, _ = growing_run(size, None)
    model, error, stepped = growing_run(size, rank)
    for needle in (f"rank {rank}: the wrapped optimizer's param groups changed after wrapping "
                   "(group 0: 2 -> 4 parameters)", "Wrap a new DistributedOptimizer"):
        assert needle in str(error), f"{needle!r} not in {error}"
    assert not stepped, "the refused step changed the model"
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    return 2


class SpectralNet(torch.nn.Module):
    """A Fourier layer (a complex weight on the first modes, as a Fourier neural operator has)
    then a real one. ``as_real`` holds the complex weight as a real parameter with a trailing
    dimension of 2 and views it as complex in ``forward``: the same function of the same floats,
    which every algorithm already trains as a real tensor, so it is the oracle."""

    def __init__(self, as_real: bool):
        super().__init__()
        torch.manual_seed(0)
        spectral = torch.randn(6, 5, 4, dtype=torch.complex64) / 4
        self.as_real = as_real
        self.spectral = torch.nn.Parameter(torch.view_as_real(spectral).clone() if as_real
                                           else spectral)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x):  # x: (batch, 6 channels, 16 points)
        weight = torch.view_as_complex(self.spectral) if self.as_real else self.spectral
        modes = torch.fft.rfft(x)[..., :4]                     # (batch, 6, 4) complex
        mixed = torch.einsum("bim,iom->bom", modes, weight)   # (batch, 5, 4)
        y = torch.fft.irfft(mixed, n=16)                      # (batch, 5, 16)
        return self.out(torch.tanh(y)).mean(dim=1)


def spectral_run(as_real: bool, rank: int, algorithm, steps: int = 5, save_at=None, resume=None,
                 **options):
    """Train ``SpectralNet``; ``save_at=(step, directory)`` checkpoints after that many steps,
    ``resume=directory`` starts from a fresh model and optimizer loaded from it."""
    model = SpectralNet(as_real)
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.02),
                                  named_parameters=model.named_parameters(),
                                  algorithm=algorithm, **options)
    first = 0
    if resume is not None:
        first = bm.checkpoint.load(resume, model=model, optimizer=opt).step
    for step in range(first, steps):
        spectral_step(model, opt, rank, step)
        if save_at is not None and step + 1 == save_at[0]:
            bm.checkpoint.save(save_at[1], model=model, optimizer=opt, step=step + 1)
    opt.close()
    spectral = model.spectral.detach()
    return (spectral if as_real else torch.view_as_real(spectral)), model.out.weight.detach()


def spectral_step(model, opt, rank: int, step: int) -> None:
    """One training step of ``SpectralNet`` on this rank's batch of ``step``."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 6, 16, generator=g), torch.randn(4, 3, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def check_complex_parameters(rank: int, size: int) -> int:
    """A complex parameter trains as its real view, as DDP trains it: under every registered
    algorithm (from the registry) a model with a complex64 weight ends bit-identical to its
    twin holding the same floats as a real parameter. ``async`` averages on a timer, so two of
    its runs differ anyway: it must train and stay finite. Gradient averaging matches one
    process on the combined batch (flattened or not); a checkpoint resumes exactly; Horovod's
    Adasum optimizer refuses complex parameters by name (ZeRO shards them as their real view:
    ``check_complex_zero``)."""
    checks = 0
    for name in bm.algorithms.names():
        algorithm = bm.algorithms.create(name, **HYPERPARAMETERS.get(name, {}))
        ours = spectral_run(False, rank, algorithm)
        if name == "async":
            assert all(torch.isfinite(t).all() for t in ours), "async: not finite"
            checks += 1
            continue
        twin = spectral_run(True, rank, algorithm)
        for what, a, b in zip(("spectral", "out.weight"), ours, twin):
            assert torch.equal(a, b), (f"{name}: {what} differs from the real twin by "
                                       f"{(a - b).abs().max().item():.3g}")
        if not algorithm.averages_models:
            gathered = bm.allgather(ours[0][None])
            assert all(torch.equal(t, gathered[0]) for t in gathered), f"{name}: ranks differ"
        checks += 1
    model = SpectralNet(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for step in range(5):
        batches = [torch.Generator().manual_seed(100 * step + r) for r in range(size)]
        data = [(torch.randn(4, 6, 16, generator=g), torch.randn(4, 3, generator=g))
                for g in batches]
        opt.zero_grad()
        x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    # one bucket of the complex weight (first) and the real layer (51 floats: odd length)
    for options in ({}, {"flatten": False}, {"overlap": False}, {"bucket_size_mb": 25},
                    {"hierarchical": True}):
        got, _ = spectral_run(False, rank, "gradient_allreduce", **options)
        torch.testing.assert_close(got, torch.view_as_real(model.spectral.detach()),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{options}: {m}")
        checks += 1
    # a checkpoint of the complex weight, Adam's complex moments and top-k's per-rank residual
    # (sized in real elements) resumes bit for bit
    topk = bm.algorithms.create("topk", **HYPERPARAMETERS["topk"])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = bm.broadcast_object(tmp if rank == 0 else None)
        whole = spectral_run(False, rank, topk, save_at=(3, tmp))
        resumed = spectral_run(False, rank, topk, resume=tmp)
        bm.barrier()  # rank 0's directory outlives every rank's reads
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed)), "the resume differs"
    model = SpectralNet(False)
    expect(bm.UnsupportedOptionError, lambda: bm.horovod.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        op=bm.horovod.Adasum), "op=Adasum is not supported with complex parameters (1: spectral)")
    return checks + 3


class SignSGD(PerTensorSGD):
    """A step not torch.optim's: it might update a complex element as a whole."""

    @staticmethod
    def direction(p, grad):
        return grad.sgn()


def check_complex_zero(rank: int, size: int) -> int:
    """ZeRO shards a complex parameter as its real view. In one bucket (the complex weight's
    240 real elements first, then 51 real ones) the slices are of 146, 97 and 73 elements at
    2, 3 and 4 ranks, so at 3 and 4 a slice ends inside a complex element. Stages 1 and 2 (and
    stage 2 sharded over two levels at 4 ranks) end where stage 0 ends, their logical state
    dict holds the complex moments stage 0 holds, that state loaded into stage 2 goes on as
    stage 0 does, and an optimizer whose step is not torch.optim's is refused by name. The real twin trains there too, bit for bit as the complex
    model (ZeRO and decentralized make the parameters views of the bucket)."""
    def build(stage: int, **options):
        model = SpectralNet(False)
        opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.02),
                                      named_parameters=model.named_parameters(),
                                      bucket_size_mb=25, zero_stage=stage, **options)
        return model, opt

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")

    trained = {}
    # two-level sharding (nodes of 2 ranks) where every node is full
    two_level = {"2 levels": (2, {"hierarchical": True})} if size % 2 == 0 and size > 2 else {}
    for stage, (zero_stage, options) in {0: (0, {}), 1: (1, {}), 2: (2, {}),
                                         **two_level}.items():
        model, opt = build(zero_stage, **options)
        for step in range(4):
            spectral_step(model, opt, rank, step)
        trained[stage] = (model, opt, opt.state_dict())  # collective at stages 1 and 2
    reference = trained[0][2]["state"]
    assert reference[0]["exp_avg"].is_complex(), reference[0]["exp_avg"].dtype
    for stage in (1, 2, *two_level):
        model, _, state = trained[stage]
        close(model.spectral.detach(), trained[0][0].spectral.detach(), f"stage {stage}")
        close(model.out.weight.detach(), trained[0][0].out.weight.detach(), f"stage {stage}")
        for position, entry in reference.items():
            for key, value in entry.items():
                close(state["state"][position][key], value, f"stage {stage}: state {key}")
    # the twin (the weight real, viewed as complex in forward) where the model is made views of
    # the bucket: its range starts at an even offset, as view_as_complex needs
    for options in ({"zero_stage": 1}, {"zero_stage": 2}, {"algorithm": "decentralized"}):
        options = {"algorithm": "gradient_allreduce", "bucket_size_mb": 25, **options}
        algorithm = options.pop("algorithm")
        twin = spectral_run(True, rank, algorithm, **options)
        ours = spectral_run(False, rank, algorithm, **options)
        for what, a, b in zip(("spectral", "out.weight"), ours, twin):
            assert torch.equal(a, b), f"{options}: {what} differs from the twin's"
    # stage 0's state (complex moments) loaded into stage 2, then two more steps on both
    model, opt = build(2)
    model.load_state_dict(trained[0][0].state_dict())
    opt.load_state_dict(copy.deepcopy(trained[0][2]))
    for step in (4, 5):
        spectral_step(model, opt, rank, step)
        spectral_step(trained[0][0], trained[0][1], rank, step)
    close(model.spectral.detach(), trained[0][0].spectral.detach(), "stage 0's state at stage 2")
    for _, opt, _ in trained.values():
        opt.close()
    opt.close()
    model = SpectralNet(False)
    expect(bm.UnsupportedOptionError, lambda: bm.DistributedOptimizer(
        SignSGD(model.parameters()), named_parameters=model.named_parameters(), zero_stage=1,
        zero_elementwise=True),  # elementwise over reals says nothing of complex elements
        "zero_stage=1 with complex parameters (1 of them, the first of shape (6, 5, 4)) needs "
        "an optimizer whose step updates a complex tensor as its real view",
        "SignSGD's step is 'short_runs.PerTensorSGD.step'")
    return 4


def check_bucket_order_and_overlap(rank: int, size: int, tmp: str) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    prefix = os.path.join(tmp, "timeline")
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), overlap=True,
                                  named_parameters=model.named_parameters(),
                                  bucket_size_mb=0.3, timeline=prefix)
    for step in range(8):
        opt.zero_grad()
        model(torch.randn(512, 256)).square().mean().backward()
        opt.step()
    buckets = opt.buckets
    first_names = [b.names[0] for b in buckets]
    # gradients become ready last layer first: the profiled order is the execution order reversed
    assert first_names[0].startswith("7."), first_names
    assert [int(n.split(".")[0]) for n in first_names] == sorted(
        [int(n.split(".")[0]) for n in first_names], reverse=True), first_names
    assert len(buckets) >= 4, buckets
    opt.close()
    with open(f"{prefix}.rank{rank}.json") as fh:
        events = json.load(fh)["traceEvents"]
    ends = [e["ts"] for e in events if e["name"] == "backward end"]
    comm0 = [e["ts"] for e in events if e["name"] == "comm bucket 0"]
    launch0 = [e["ts"] for e in events if e["name"] == "launch" and e["args"]["bucket"] == 0]
    assert len(ends) == 8 and len(comm0) == 8 and len(launch0) == 8, (ends, comm0, launch0)
    # skip the profiling step. Launching is deterministic: bucket 0 is handed to the comm
    # thread from the hook, before the last gradient is ready...
    assert all(l < e for l, e in zip(launch0[1:], ends[1:])), "bucket 0 launched late"
    # ...and the comm thread really starts on it while backward still runs (thread scheduling
    # on a loaded machine may delay it in some iterations, not in all seven).
    overlapped = sum(c < e for c, e in zip(comm0[1:], ends[1:]))
    assert overlapped >= 1, "bucket 0 never started communicating before backward ended"
    # ...and with overlap off it never does
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  bucket_size_mb=0.3, overlap=False, timeline=prefix + "-noov")
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(64, 256)).square().mean().backward()
        opt.step()
    opt.close()
    with open(f"{prefix}-noov.rank{rank}.json") as fh:
        events = json.load(fh)["traceEvents"]
    ends = [e["ts"] for e in events if e["name"] == "backward end"]
    comm0 = [e["ts"] for e in events if e["name"] == "comm bucket 0"]
    assert all(c >= e for c, e in zip(comm0, ends)), "communication started with overlap off"
    return 3


def check_mismatched_models(rank: int, size: int) -> int:
    if size == 1:
        return 0  # nothing to disagree with
    model = torch.nn.Linear(4, 3 if rank == size - 1 else 2)
    try:
        bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters())
    except bm.MismatchError as exc:
        assert "weight" in str(exc) and f"rank {size - 1}" in str(exc), str(exc)
    else:
        raise AssertionError("mismatched models were accepted")
    return 1


def check_mismatched_settings(rank: int, size: int) -> int:
    """A setting that differs on one rank (the last) raises MismatchError on every rank at wrap
    time, naming the setting, each value and the ranks that have it, instead of a hang (two
    libraries waiting for each other) or a confusing failure inside the first step; the
    library keeps working afterwards."""
    if size == 1:
        return 0  # nothing to disagree with
    last, others = size - 1, ("rank 0" if size == 2 else f"ranks 0-{size - 2}")
    odd = rank == last
    cases = {  # name: (keyword arguments on the last rank, everyone else's, needles)
        "algorithm": ({"algorithm": "qsgd"}, {},
                      ["algorithm.name: 'gradient_allreduce' on " + others,
                       f"'qsgd' on rank {last}"]),
        "hyperparameter": ({"algorithm": bm.algorithms.create("qsgd", levels=15)},
                           {"algorithm": "qsgd"},
                           [f"algorithm.levels: 127 on {others}; 15 on rank {last}"]),
        "backend": ({"backend": "gloo"}, {"backend": "mpi"},
                    [f"backend: 'mpi' on {others} (backend='mpi'); 'gloo' on rank {last} "
                     "(backend='gloo')"]),
        "op": ({"op": bm.Sum}, {}, [f"op: 'Average' on {others}; 'Sum' on rank {last}"]),
        "passes": ({"backward_passes_per_step": 2}, {},
                   [f"backward_passes_per_step: 1 on {others}; 2 on rank {last}"]),
        "compression": ({"compression": bm.Compression.fp16}, {},
                        [f"compression: 'none' on {others}; 'fp16' on rank {last}"]),
    }
    torch.manual_seed(0)  # the same start everywhere (the first step compares the parameters)
    model = torch.nn.Linear(4, 2)
    for name, (theirs, mine, needles) in cases.items():
        kwargs = theirs if odd else mine
        expect(bm.MismatchError, lambda: bm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(), **kwargs),
            "different settings", *needles)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    model(torch.ones(3, 4) * rank).sum().backward()
    opt.step()
    opt.close()
    return len(cases)


def check_auto_that_decides_differently(rank: int, size: int) -> int:
    """backend='auto' decides on each rank (a node with a GPU per rank takes NCCL, one
    without takes MPI). Where the ranks' decisions differ, every rank takes MPI and says why,
    instead of a hang; the gradients are then averaged as usual. The last rank plays a node
    whose auto takes NCCL (a CPU model here, so it is only told so)."""
    if size == 1:
        return 0  # one rank decides alone
    import logging

    from bagua_mpi import backends
    wire, said = backends.wire, []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("bagua_mpi.optimizer").addHandler(handler)
    if rank == size - 1:
        backends.wire = lambda name, device: "nccl" if name == "auto" else wire(name, device)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2, bias=False)
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                      named_parameters=model.named_parameters(),
                                      backend="auto")
    finally:
        backends.wire = wire
        logging.getLogger("bagua_mpi.optimizer").removeHandler(handler)
    assert opt.impl.backend == "mpi" and opt.backend == "mpi", (opt.impl.backend, opt.backend)
    assert any(f"over nccl on rank {size - 1}" in m and "every rank uses mpi" in m
               for m in said), said
    before = model.weight.detach().clone()
    model(torch.full((1, 4), float(rank))).sum().backward()   # grad: rank in every column
    opt.step()
    opt.close()
    mean = (size - 1) / 2
    assert torch.allclose(model.weight, before - mean), (model.weight, before, mean)
    return 1


def check_compression(size: int) -> int:
    """fp16/bf16 compression stays within half-precision error of the exact result."""
    checks = 0
    expected = reference("sgd", size, passes=1)
    for comp, tol in ((bm.Compression.fp16, 2e-3), (bm.Compression.bf16, 2e-2)):
        model, _ = distributed("sgd", compression=comp)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), expected[name], rtol=tol, atol=tol)
        checks += 1
    return checks


def check_predivide_keeps_16_bit_sums_in_range(rank: int, size: int) -> int:
    """float16 parameters whose gradient is 40000 on every rank (fp16's largest value is
    65504): with ``gradient_predivide_factor=size`` the ranks sum 40000 / size each, and the
    average, 40000, comes back exact on every carrier. Scaled only after the sum (gloo and
    NCCL did), the sum of 40000 x size overflowed to inf; without the predivide, the MPI
    carriers sum in float32 and round once, and the exact average still comes back."""
    checks = 0
    for predivide in (float(size), 1.0):
        p = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
        opt = bm.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("p", p)],
                                      gradient_predivide_factor=predivide)
        opt.zero_grad()
        (p * 40000.0).sum().backward()
        opt.step()
        opt.close()
        if predivide > 1.0 or host_payloads_take_mpi():
            assert torch.equal(p.grad, torch.full((8,), 40000.0, dtype=torch.float16)), \
                (predivide, p.grad)
            checks += 1
    return checks


def host_payloads_take_mpi() -> bool:
    """Whether MPI carries host tensors' payloads here (backend mpi or auto; gloo's own)."""
    return bm.backends.host_carrier(bm.backends.resolve()) == "mpi"


def check_sixteen_bit_models_send_their_own_words(rank: int, size: int) -> int:
    """A bfloat16 or float16 parameter with a different gradient on each rank, averaged with no
    compression and with its own dtype's: every rank gets round16(sum over ranks in float32 /
    size), rounded once, against a NumPy replay; and on MPI the bytes sent are those of 16-bit
    words (``cast_allreduce_``), where MPI, which has no 16-bit sum, moved float32, twice the
    bytes, and a compression of the model's own dtype changed nothing."""
    from bagua_mpi import transport
    from bagua_mpi.collectives import _allreduce
    from bagua_mpi.primitives.centralized import wire_bytes_cast_allreduce
    checks = 0
    n = 5000
    carried = []  # the dtype of every buffer handed to MPI (the transport's or the collectives')
    saved = {verb: getattr(transport._HostMPI, verb)
             for verb in ("allreduce_", "alltoall", "allgather", "reduce_scatter")}
    for verb, original in saved.items():
        setattr(transport._HostMPI, verb, lambda self, buf, *a, _o=original, **k:
                carried.append(buf.dtype) or _o(self, buf, *a, **k))
    saved_reducer = _allreduce.reducer_for

    def reducer_for(tensor, topo, reductions):
        reduce = saved_reducer(tensor, topo, reductions)
        return lambda topo, buf, *a: carried.append(buf.dtype) or reduce(topo, buf, *a)
    _allreduce.reducer_for = reducer_for
    try:
        return checks + _sixteen_bit_exchanges(rank, size, n, carried,
                                               wire_bytes_cast_allreduce)
    finally:
        for verb, original in saved.items():
            setattr(transport._HostMPI, verb, original)
        _allreduce.reducer_for = saved_reducer


def _sixteen_bit_exchanges(rank, size, n, carried, wire_bytes_cast_allreduce) -> int:
    checks = 0
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for compression in (None, name):
            grads = [torch.empty(n, dtype=torch.float64).uniform_(
                -3, 3, generator=torch.Generator().manual_seed(1100 + r)).to(dtype)
                for r in range(size)]
            want = (sum(g.double().float() for g in grads) / size).to(dtype)
            p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
            kwargs = {} if compression is None else {"compression": compression}
            opt = bm.DistributedOptimizer(torch.optim.SGD([p], lr=0.0),
                                          named_parameters=[("p", p)], **kwargs)
            opt.zero_grad()
            p.grad = None
            carried.clear()
            (p * grads[rank]).sum().backward()   # the bucket's exchange starts here
            opt.step()
            sent = opt.communication_stats()["bytes_sent"]
            opt.close()
            if host_payloads_take_mpi():
                assert torch.equal(p.grad, want), (dtype, compression,
                                                   int((p.grad != want).sum()))
                if size > 1:
                    assert sent == wire_bytes_cast_allreduce(n, size, 2), \
                        (dtype, compression, sent)
                    assert dtype in carried and torch.float32 not in carried, carried
            else:   # gloo (NCCL's stand-in) sums 16-bit floats in their own dtype
                eps = torch.finfo(dtype).eps
                torch.testing.assert_close(p.grad, want, rtol=size * eps, atol=size * 3 * eps)
            checks += 1
    return checks


def check_bucket_order_and_overlap_in_tmp(rank: int, size: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = bm.broadcast_object(tmp if rank == 0 else None)
        try:
            return check_bucket_order_and_overlap(rank, size, tmp)
        finally:
            bm.barrier()  # rank 0's directory outlives every rank's timeline files


def suite_checks() -> dict:
    """Check name -> fn(rank, size), in the order they run (tests/mpi/checks.py)."""
    return {
        "equivalence": lambda rank, size: check_equivalence(size),
        "clip_right_after_backward": lambda rank, size: check_clip_right_after_backward(size),
        "activation_checkpointing": lambda rank, size: check_activation_checkpointing(size),
        "no_sync_and_skip_synchronize": lambda rank, size: check_no_sync_and_skip_synchronize(
            size),
        "unused_default": lambda rank, size: check_unused_default(size),
        "misuse": check_misuse,
        "gan_discarded_exchange": check_gan_discarded_exchange,
        "freeze_after_wrapping": check_freeze_after_wrapping,
        "rewrapping": check_rewrapping,
        "converted_after_wrapping": check_converted_after_wrapping,
        "groups_changed_after_wrapping": check_groups_changed_after_wrapping,
        "torch_compile": check_torch_compile,
        "torch_optimizer_hooks": check_torch_optimizer_hooks,
        "users_optimizer_hooks_every_algorithm": check_users_optimizer_hooks_every_algorithm,
        "complex_parameters": check_complex_parameters,
        "complex_zero": check_complex_zero,
        "sparse_gradients": lambda rank, size: check_sparse_gradients(size),
        "sparse_gradients_send_rows": check_sparse_gradients_send_rows,
        "sparse_embedding_frozen_after_wrapping": check_sparse_embedding_frozen_after_wrapping,
        "find_unused_counts_no_sync_passes": check_find_unused_counts_no_sync_passes,
        "shared_block_under_reentrant_checkpointing":
            check_shared_block_under_reentrant_checkpointing,
        "join": check_join,
        "same_start": check_same_start,
        "hyperparameters_that_differ": check_hyperparameters_that_differ,
        "compression": lambda rank, size: check_compression(size),
        "sixteen_bit_models_send_their_own_words": check_sixteen_bit_models_send_their_own_words,
        "mismatched_models": check_mismatched_models,
        "mismatched_settings": check_mismatched_settings,
        "auto_that_decides_differently": check_auto_that_decides_differently,
        "bucket_order_and_overlap": check_bucket_order_and_overlap_in_tmp,
        "predivide_keeps_16_bit_sums_in_range": check_predivide_keeps_16_bit_sums_in_range,
    }


if __name__ == "__main__":
    sys.exit(run_suite(suite_checks()))
