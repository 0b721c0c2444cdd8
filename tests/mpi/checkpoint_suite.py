"""Checkpoints under a real mpiexec (any world size; also as a plain single process).

    python checkpoint_suite.py roundtrip DIR
    python checkpoint_suite.py train "ALG;ALG..." DIR N M   # reference N+M steps; N steps, save
    python checkpoint_suite.py resume "ALG;ALG..." DIR M [MB] # new job: load, M more steps
    python checkpoint_suite.py world DIR_SHARED DIR_PER_RANK  # load on another world size
    python checkpoint_suite.py batchnorm_save DIR           # BatchNorm buffers that differ
    python checkpoint_suite.py batchnorm_load DIR SAVED_BY  # per rank, loaded on any size
    python checkpoint_suite.py gan_train ALG DIR N M        # a GAN: two optimizers, one file
    python checkpoint_suite.py gan_resume ALG DIR M
    python checkpoint_suite.py gan_misuse ALG DIR M         # errors; another world size
    python checkpoint_suite.py channels_last DIR N M        # fused Adam state of channels_last
    python checkpoint_suite.py crash DIR PHASE[@RANK]       # save, then die inside the next save
    python checkpoint_suite.py saveloop DIR                 # save until killed

Every rank checks its own results and raises on a mismatch (bagua_mpi then aborts the job);
``train``/``resume`` print ``REF``/``RES <algorithm> rank <r> <sha256>`` lines that the pytest
side compares, since the two runs are separate jobs. An algorithm is ``name`` or
``name:key=value,...`` (hyperparameters); checkpoints go to ``DIR/<algorithm>``.

``ckpt_ef16`` (registered here) is gradient averaging with float16 rounding and per-rank error
feedback: a small algorithm whose per-rank state changes the trajectory, so a resume that lost
it would not be bit-identical.
"""
import hashlib
import os
import random
import signal
import sys
from dataclasses import dataclass

import numpy as np
import torch

import bagua_mpi as bm
import bagua_mpi.checkpoint as ckpt
from bagua_mpi import collectives, preemption
from bagua_mpi.algorithms import Algorithm, AlgorithmImpl, register
from bagua_mpi.ops import Sum
from short_runs import gan_models


class EF16Impl(AlgorithmImpl):
    """Written against the algorithm framework: its per-rank state is one vector per exchanged
    tensor, allocated through ``self.state`` (so it is checkpointed by parameter name)."""

    def reduce_bucket(self, bucket, step: int) -> None:
        for k, (grad, segments) in enumerate(zip(bucket.communication_tensors(),
                                                 bucket.communication_segments())):
            residual = self.state.vector("residual", (bucket.index, k), segments).data
            x = grad.reshape(-1) + residual  # what float16 rounding dropped on this rank
            q = x.half().float()
            residual.copy_(x - q)
            grad.copy_(q.view_as(grad))
            collectives.allreduce_(grad, Sum, prescale_factor=self.ctx.prescale,
                                   postscale_factor=self.ctx.postscale)


@register
@dataclass(frozen=True)
class EF16(Algorithm):
    name = "ckpt_ef16"
    impl_class = EF16Impl


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 24)
        self.drop = torch.nn.Dropout(0.2)
        self.b = torch.nn.Linear(24, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.b(self.drop(torch.tanh(self.a(x))))


def seed_everything(rank: int) -> None:
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)


def parse_algorithm(spec: str):
    """``name`` or ``name:key=value,...`` (True/False, ints, floats or strings) -> an
    Algorithm."""
    name, _, args = spec.partition(":")
    kwargs = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        if value in ("True", "False"):  # configs take real booleans, not 1/0
            kwargs[key] = value == "True"
            continue
        for cast in (int, float, str):
            try:
                kwargs[key] = cast(value)
                break
            except ValueError:
                continue
    return bm.algorithms.create(name, **kwargs)


def build(algorithm: str, init_seed: int = 0, bucket_size_mb: float = 25.0):
    torch.manual_seed(init_seed)
    model = Net()
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(),
                                  algorithm=parse_algorithm(algorithm),
                                  bucket_size_mb=bucket_size_mb)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=3, gamma=0.5)
    bm.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt, sched


def train(model, opt, sched, steps: int) -> None:
    """Steps that draw from all three global RNGs (dropout, data, noise, subsampling)."""
    for _ in range(steps):
        x = torch.randn(16, 12)
        y = torch.from_numpy(np.random.standard_normal((16, 3)).astype(np.float32))
        keep = sorted(random.sample(range(16), 12))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[keep]), y[keep])
        loss.backward()
        opt.step()
        sched.step()


def digest(model, opt) -> str:
    """The model, the wrapped optimizer's state and the algorithm's own state."""
    h = _model_hash(model, opt)
    hash_tree(h, opt.algorithm_state_dict())
    return h.hexdigest()


def model_digest(model, opt) -> str:
    """The model and the wrapped optimizer's state, without the algorithm's own state (whose
    layout may follow the buckets)."""
    return _model_hash(model, opt).hexdigest()


def _model_hash(model, opt):
    h = hashlib.sha256()
    for _, t in sorted(model.state_dict().items()):
        h.update(t.numpy().tobytes())
    for _, s in sorted(opt.optimizer.state_dict()["state"].items()):
        for key in sorted(s):
            h.update(torch.as_tensor(s[key]).numpy().tobytes())
    return h


def hash_tree(h, x) -> None:
    """Feed nested state into ``h`` in a fixed order (tensors by their bytes)."""
    if torch.is_tensor(x):
        h.update(str(x.dtype).encode() + x.detach().cpu().contiguous().view(-1)
                 .view(torch.uint8).numpy().tobytes())
    elif isinstance(x, dict):
        for key in sorted(x, key=repr):
            h.update(repr(key).encode())
            hash_tree(h, x[key])
    elif isinstance(x, (list, tuple)):
        for v in x:
            hash_tree(h, v)
    else:
        h.update(repr(x).encode())


def clone(x):
    if torch.is_tensor(x):
        return x.clone()
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone(v) for v in x)
    return x


def snapshot(model, opt):
    return (clone(model.state_dict()), clone(opt.optimizer.state_dict()),
            clone(opt.algorithm_state_dict()))


def assert_same(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        # bits in logical order (reshape: a channels_last tensor is no row-major view)
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                           b.reshape(-1).view(torch.uint8) if b.numel() else b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def roundtrip(directory: str) -> None:
    rank, size = bm.rank(), bm.size()
    seed_everything(rank)
    model, opt, sched = build("ckpt_ef16")
    train(model, opt, sched, 3)
    rank_extras = {"rank": rank, "t": torch.full((rank + 1,), float(rank), dtype=torch.bfloat16)}
    path = ckpt.save(directory, model=model, optimizer=opt, step=3, epoch=1,
                     extras={"scheduler": sched.state_dict()}, rank_extras=rank_extras)
    expected = snapshot(model, opt)
    draws = (torch.rand(4), np.random.rand(3), random.random())
    meta = ckpt.read_meta(path)
    assert meta["world_size"] == size and meta["trees"]["model"] == "replicated", meta
    assert meta["per_rank_algorithm_state"] is True and meta["write_scheme"] == ckpt.scheme()
    if rank == 0:
        import h5py
        with h5py.File(path, "r") as f:
            assert sorted(f["ranks"], key=int) == [str(r) for r in range(size)]
            assert "model" in f and "model" not in f["ranks/0"]

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    train(model, opt, sched, 1)
    info = ckpt.load(directory, model=model, optimizer=opt)
    assert (info.step, info.epoch, info.world_size) == (3, 1, size), info
    assert info.rng_restored and info.algorithm_state == "loaded" and not info.skipped
    assert_same(info.rank_extras, rank_extras, "rank_extras")
    actual = snapshot(model, opt)
    for name, a, b in zip(("model", "optimizer", "algorithm"), expected, actual):
        assert_same(a, b, name)
    assert torch.equal(torch.rand(4), draws[0]) and np.array_equal(np.random.rand(3), draws[1])
    assert random.random() == draws[2]

    # Ranks whose models differ (decentralized training): each rank's copy is kept.
    with torch.no_grad():
        model.a.bias[0] = float(rank)
    path = ckpt.save(directory, model=model, optimizer=opt, step=4)
    meta = ckpt.read_meta(path)
    want = "per_rank" if size > 1 else "replicated"
    assert meta["trees"]["model"] == want, meta["trees"]
    mine = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.a.bias.zero_()
    ckpt.load(path, model=model, optimizer=opt)
    assert_same(mine, model.state_dict(), "per-rank model")
    assert ckpt.latest(directory) == path
    opt.close()
    preemption_agreement()
    print(f"roundtrip OK on {size} ranks", flush=True)


def on_one_rank(directory: str) -> None:
    """``save`` and ``load`` are collective. Called on rank 0 alone while the others step on
    (DDP's ``if rank == 0: torch.save(...)`` habit), each raises ``MismatchError`` on every
    rank naming both calls (rank 0's save or load, the others' next bucket); ``save`` had
    failed inside MPI ("Message truncated"), under ZeRO or another algorithm it could hang.
    Afterwards, every rank saving and loading together works as before."""
    rank, size = bm.rank(), bm.size()
    for call in ("save", "load"):
        for stage in (0, 1):
            seed_everything(rank)
            torch.manual_seed(0)
            model = Net()
            opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                          named_parameters=model.named_parameters(),
                                          zero_stage=stage)
            sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=3, gamma=0.5)
            train(model, opt, sched, 2)
            path = ckpt.save(directory, model=model, optimizer=opt, step=2)
            message = expect_error(bm.MismatchError, f"bm.checkpoint.{call}", lambda: (
                (ckpt.save(directory, model=model, optimizer=opt, step=3) if call == "save"
                 else ckpt.load(path, model=model, optimizer=opt))
                if rank == 0 else train(model, opt, sched, 1)))
            assert "rank 1: bucket(" in message, message
            if rank != 0:
                opt.abandon_iteration()
            before = digest(model, opt)
            path = ckpt.save(directory, model=model, optimizer=opt, step=3)
            train(model, opt, sched, 1)
            ckpt.load(path, model=model, optimizer=opt)
            assert digest(model, opt) == before, f"{call}, zero_stage={stage}: not restored"
            opt.close()
    print(f"on_one_rank OK on {size} ranks", flush=True)


def preemption_agreement() -> None:
    """SIGUSR1 reaches only the last rank, mid-loop: every rank stops at the same step."""
    rank, size = bm.rank(), bm.size()
    with preemption.install() as guard:
        stopped_at = None
        for step in range(6):
            if step == 2 and rank == size - 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            if guard.should_stop():
                stopped_at = step
                break
        assert guard.requested_here == (rank == size - 1)
    assert bm.allgather_object(stopped_at) == [2] * size


def directory_of(base: str, algorithm: str) -> str:
    return os.path.join(base, "".join(c if c.isalnum() else "_" for c in algorithm))


def train_then_save(algorithms: str, base: str, n: int, m: int) -> None:
    """For each algorithm: the N+M-step reference, then N steps saved to base/<algorithm>."""
    rank = bm.rank()
    for algorithm in algorithms.split(";"):
        seed_everything(rank)
        model, opt, sched = build(algorithm)
        train(model, opt, sched, n + m)
        print(f"REF {algorithm} rank {rank} {digest(model, opt)}", flush=True)
        print(f"REFMODEL {algorithm} rank {rank} {model_digest(model, opt)}", flush=True)
        opt.close()

        seed_everything(rank)
        model, opt, sched = build(algorithm)
        train(model, opt, sched, n)
        ckpt.save(directory_of(base, algorithm), model=model, optimizer=opt, step=n,
                  extras={"scheduler": sched.state_dict()})
        opt.close()


def resume(algorithms: str, base: str, m: int, bucket_size_mb: float = 25.0) -> None:
    """For each algorithm: fresh objects and RNGs, load base/<algorithm>, M more steps.

    With another ``bucket_size_mb`` than the saving job (one parameter per bucket), the
    per-parameter algorithm state must still load and training go on."""
    rank = bm.rank()
    for algorithm in algorithms.split(";"):
        seed_everything(rank + 17)  # deliberately different: the checkpoint restores the RNGs
        model, opt, sched = build(algorithm, init_seed=5, bucket_size_mb=bucket_size_mb)
        info = ckpt.load(directory_of(base, algorithm), model=model, optimizer=opt)
        sched.load_state_dict(info.extras["scheduler"])
        assert info.rng_restored and info.algorithm_state == "loaded", info
        assert opt.steps == info.step, (opt.steps, info.step)
        if rank == 0:
            print(f"META {algorithm} per_rank_algorithm_state="
                  f"{info.meta['per_rank_algorithm_state']} model={info.meta['trees']['model']}",
                  flush=True)
        train(model, opt, sched, m)
        if bucket_size_mb != 25.0:
            assert len(opt.buckets) == len(list(model.parameters())), opt.buckets
            assert all(torch.isfinite(p).all() for p in model.parameters()), algorithm
        print(f"RES {algorithm} rank {rank} {digest(model, opt)}", flush=True)
        print(f"RESMODEL {algorithm} rank {rank} {model_digest(model, opt)}", flush=True)
        opt.close()


class ChannelsLastNet(torch.nn.Module):
    """A small CNN whose conv weights are ``channels_last`` (the head stays row-major)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 6, 3)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.conv2(torch.relu(self.conv1(x))).mean((2, 3)))


# How the channels_last mode resumes: bm.checkpoint (also at ZeRO-1), or Horovod's recipe (rank
# 0 loads a torch.save file, then broadcast_parameters + broadcast_optimizer_state) with rank 0
# loading through the wrapper or, before wrapping, into the plain optimizer a state written
# row-major (a checkpoint of the run before it turned channels_last on).
CL_ROUTES = ("ckpt", "ckpt_zero1", "hvd", "hvd_row_major")


def build_channels_last(kind: str, route: str, init_seed: int, load=None):
    """Model and wrapped fused ``kind`` optimizer for ``route``; ``load(model, inner)`` runs
    between building the plain optimizer and wrapping it."""
    import bagua_mpi.horovod as hvd

    torch.manual_seed(init_seed)
    model = ChannelsLastNet().to(memory_format=torch.channels_last)
    if kind == "adam":
        inner = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    if load is not None:
        load(model, inner)
    named = model.named_parameters()
    if route.startswith("hvd"):
        opt = hvd.DistributedOptimizer(inner, named_parameters=named)
    else:
        opt = bm.DistributedOptimizer(inner, named_parameters=named,
                                      zero_stage=1 if route == "ckpt_zero1" else 0)
    return model, opt


def train_channels_last(model, opt, start: int, stop: int) -> None:
    """Steps ``start``..``stop - 1``; each rank's batch depends on its rank and the step only."""
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * bm.rank() + step)
        x = torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.randn(4, 2, generator=g)).backward()
        opt.step()


def channels_last_state(model, opt) -> dict:
    """Copies of the parameters and of the logical optimizer state (collective at ZeRO), each
    parameter's state by sorted key (a broadcast state comes in that order)."""
    state = opt.state_dict()
    state["state"] = {pid: {k: entry[k] for k in sorted(entry)}
                      for pid, entry in state["state"].items()}
    return clone({"model": dict(model.named_parameters()), "optimizer": state})


def check_state_layouts(model, opt, where: str) -> None:
    """Every state tensor shaped like its parameter has the parameter's strides, as torch's
    optimizer creates it. (With ZeRO the optimizer steps flat slices in the buckets' memory
    order: there the bit-exact resume is the check.)"""
    params = list(model.parameters())
    assert any(p.dim() == 4 and not p.is_contiguous() for p in params), "not channels_last"
    checked = 0
    for index, p in enumerate(params):
        for key, value in opt.state[p].items():
            if torch.is_tensor(value) and value.shape == p.shape:
                assert value.stride() == p.stride(), \
                    f"{where}: state {key!r} of parameter {index} has strides " \
                    f"{value.stride()}, the parameter {p.stride()}"
                checked += 1
    assert checked >= 2 * len(params), (where, checked)


def channels_last(directory: str, n: int, m: int) -> None:
    """A channels_last CNN with fused Adam and AdamW (torch's CPU kernels pair a parameter's
    elements with its moments' by memory position, unchecked): each route resumes N steps into
    a new optimizer and must end, after M more steps, bit for bit where an uninterrupted run
    ends, on every rank, with state laid out as its parameters."""
    import bagua_mpi.horovod as hvd

    rank, size = bm.rank(), bm.size()
    for kind in ("adam", "adamw"):
        for route in CL_ROUTES:
            where = f"{kind} {route}"
            model, opt = build_channels_last(kind, route, init_seed=0)
            train_channels_last(model, opt, 0, n + m)
            reference = channels_last_state(model, opt)
            opt.close()

            model, opt = build_channels_last(kind, route, init_seed=0)
            train_channels_last(model, opt, 0, n)
            path = os.path.join(directory, f"{kind}_{route}")
            if route.startswith("ckpt"):
                ckpt.save(path, model=model, optimizer=opt, step=n)
            else:
                saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                if route == "hvd_row_major":
                    for entry in saved["optimizer"]["state"].values():
                        for key, value in entry.items():
                            entry[key] = value.contiguous()
                if rank == 0:
                    torch.save(saved, path + ".pt")
            opt.close()
            bm.barrier()

            def load_plain(model, inner):
                if rank == 0:
                    saved = torch.load(path + ".pt")
                    model.load_state_dict(saved["model"])
                    inner.load_state_dict(saved["optimizer"])

            # another initialisation: what the resumed run ends with comes from the load
            model, opt = build_channels_last(kind, route, init_seed=7,
                                             load=load_plain if route == "hvd_row_major"
                                             else None)
            if route.startswith("ckpt"):
                ckpt.load(path, model=model, optimizer=opt)
            else:
                if rank == 0 and route == "hvd":
                    saved = torch.load(path + ".pt")
                    model.load_state_dict(saved["model"])
                    opt.load_state_dict(saved["optimizer"])
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                hvd.broadcast_optimizer_state(opt, root_rank=0)
            if route != "ckpt_zero1":
                check_state_layouts(model, opt, where)
            train_channels_last(model, opt, n, n + m)
            assert_same(channels_last_state(model, opt), reference, where)
            h = hashlib.sha256()
            hash_tree(h, channels_last_state(model, opt))
            digests = bm.allgather_object(h.hexdigest())
            assert len(set(digests)) == 1, f"{where}: the ranks differ: {digests}"
            opt.close()
    print(f"channels_last OK on {size} ranks", flush=True)


def build_gan(algorithm: str, init_seed: int = 0):
    """A GAN: a generator and a discriminator, each with its own DistributedOptimizer (the
    discriminator's runs ``algorithm``); both sub-models in one ModuleDict, for the file."""
    G, D = gan_models(init_seed)
    opt_g = bm.DistributedOptimizer(torch.optim.Adam(G.parameters(), lr=0.01),
                                    named_parameters=G.named_parameters())
    opt_d = bm.DistributedOptimizer(torch.optim.Adam(D.parameters(), lr=0.01),
                                    named_parameters=D.named_parameters(),
                                    algorithm=parse_algorithm(algorithm))
    models = torch.nn.ModuleDict({"G": G, "D": D})
    bm.broadcast_parameters(models.state_dict(), root_rank=0)
    return models, opt_g, opt_d


def train_gan(models, opt_g, opt_d, steps: int) -> None:
    G, D = models["G"], models["D"]
    bce = torch.nn.BCEWithLogitsLoss()
    for _ in range(steps):
        z, real = torch.randn(8, 4), torch.randn(8, 6) + 1.0
        opt_d.zero_grad()
        (bce(D(real), torch.ones(8, 1)) + bce(D(G(z).detach()), torch.zeros(8, 1))).backward()
        opt_d.step()
        opt_g.zero_grad()
        with opt_d.no_sync():  # the generator's pass goes through D: not D's exchange
            bce(D(G(z)), torch.ones(8, 1)).backward()
        opt_g.step()


def gan_digest(models, opt_g, opt_d) -> str:
    h = hashlib.sha256()
    hash_tree(h, models.state_dict())
    for opt in (opt_g, opt_d):
        hash_tree(h, opt.optimizer.state_dict()["state"])
        hash_tree(h, opt.algorithm_state_dict())
    return h.hexdigest()


def gan_train_then_save(algorithm: str, base: str, n: int, m: int) -> None:
    """The N+M-step reference, then N steps saved with both optimizers by name
    (``optimizer={"G": opt_g, "D": opt_d}``, docs/checkpoints.md)."""
    rank = bm.rank()
    seed_everything(rank)
    models, opt_g, opt_d = build_gan(algorithm)
    train_gan(models, opt_g, opt_d, n + m)
    print(f"GANREF {algorithm} rank {rank} {gan_digest(models, opt_g, opt_d)}", flush=True)
    for opt in (opt_g, opt_d):
        opt.close()
    seed_everything(rank)
    models, opt_g, opt_d = build_gan(algorithm)
    train_gan(models, opt_g, opt_d, n)
    ckpt.save(directory_of(base, algorithm), model=models, step=n,
              optimizer={"G": opt_g, "D": opt_d})
    meta = ckpt.read_meta(ckpt.latest(directory_of(base, algorithm)))
    assert sorted(meta["optimizers"]) == ["D", "G"], meta
    assert meta["optimizers"]["D"]["per_rank_algorithm_state"], meta  # error feedback
    assert not meta["optimizers"]["G"]["per_rank_algorithm_state"], meta  # config and steps
    for opt in (opt_g, opt_d):
        opt.close()


def gan_resume(algorithm: str, base: str, m: int) -> None:
    """Same world size: both optimizers and their algorithm state come back exactly (the dict
    is built in another order than at the save)."""
    rank = bm.rank()
    seed_everything(rank + 17)  # the checkpoint restores the RNGs
    models, opt_g, opt_d = build_gan(algorithm, init_seed=5)
    info = ckpt.load(directory_of(base, algorithm), model=models,
                     optimizer={"D": opt_d, "G": opt_g})
    assert info.algorithm_state == {"D": "loaded", "G": "loaded"}, info.algorithm_state
    assert opt_d.steps == opt_g.steps == info.step, (opt_d.steps, opt_g.steps, info.step)
    train_gan(models, opt_g, opt_d, m)
    print(f"GANRES {algorithm} rank {rank} {gan_digest(models, opt_g, opt_d)}", flush=True)
    for opt in (opt_g, opt_d):
        opt.close()


def expect_error(kind, pattern: str, call) -> str:
    """``call()`` must raise ``kind`` with ``pattern`` in its message; returns the message."""
    try:
        call()
    except kind as exc:
        assert pattern in str(exc), (pattern, str(exc))
        return str(exc)
    raise AssertionError(f"no {kind.__name__} ({pattern!r})")


def gan_misuse(algorithm: str, base: str, m: int) -> None:
    """Another world size, or other optimizers, than the GAN's save: named errors that change
    nothing, then a resume that resets the discriminator's per-rank error feedback and loads
    everything else. Also: ranks that name their optimizers differently cannot save."""
    rank, size = bm.rank(), bm.size()
    directory = directory_of(base, algorithm)
    models, opt_g, opt_d = build_gan(algorithm, init_seed=5)
    before = gan_digest(models, opt_g, opt_d)
    expect_error(ckpt.CheckpointError, "holds the state of optimizers 'D', 'G'",
                 lambda: ckpt.load(directory, model=models, optimizer=opt_g))
    expect_error(ckpt.CheckpointError, "load() was given optimizers 'G' (optimizer={...})",
                 lambda: ckpt.load(directory, model=models, optimizer={"G": opt_g}))
    expect_error(ckpt.CheckpointError, "pass the optimizers it holds",
                 lambda: ckpt.load(directory, optimizer={"G": opt_g, "d": opt_d}))
    saved_by = ckpt.read_meta(ckpt.latest(directory))["world_size"]
    if saved_by != size:
        message = expect_error(
            ckpt.WorldSizeMismatchError, "for optimizer 'D'",
            lambda: ckpt.load(directory, model=models, optimizer={"G": opt_g, "D": opt_d}))
        assert "'G'" not in message, message  # G's state is the same on every rank
    assert gan_digest(models, opt_g, opt_d) == before, "a refused load changed something"
    info = ckpt.load(directory, model=models, optimizer={"G": opt_g, "D": opt_d},
                     reset_algorithm_state=True)
    assert info.algorithm_state == {"D": "reset", "G": "reset"}, info.algorithm_state
    assert opt_d.steps == opt_g.steps == info.step, (opt_d.steps, opt_g.steps, info.step)
    torch.manual_seed(40 + rank)
    train_gan(models, opt_g, opt_d, m)
    digest = [float(p.double().sum()) for p in models.parameters()]
    assert bm.allgather_object(digest) == [digest] * size, "the ranks drifted apart"
    mine = {"G": opt_g, "D": opt_d} if rank == 0 else {"G": opt_g, "disc": opt_d}
    message = expect_error(ckpt.CheckpointError, "name their optimizers differently",
                           lambda: ckpt.save(directory, optimizer=mine, step=99))
    assert "rank 0: optimizers 'D', 'G'" in message and (
        size == 1 or "rank 1: optimizers 'G', 'disc'" in message), message
    assert ckpt.read_meta(ckpt.latest(directory))["step"] != 99, "a refused save was written"
    print(f"GANMISUSE {algorithm} rank {rank} ok", flush=True)
    for opt in (opt_g, opt_d):
        opt.close()


class BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 24)
        self.norm = torch.nn.BatchNorm1d(24)
        self.b = torch.nn.Linear(24, 3)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def parameters_and_buffers(model) -> tuple[str, str]:
    """Digests of the model's parameters and of its buffers."""
    def digest(tensors):
        return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()
    return digest(model.parameters()), digest(model.buffers())


def batchnorm_save(base: str) -> None:
    """Two checkpoints: a BatchNorm model trained with gradient_allreduce on each rank's own
    batches (identical parameters, running statistics that differ per rank), and a model whose
    parameters differ per rank."""
    rank = bm.rank()
    torch.manual_seed(0)
    model = BatchNormNet()
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    for step in range(3):
        x = torch.randn(16, 12, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.zeros(16, 3)).backward()
        opt.step()
    ckpt.save(os.path.join(base, "batchnorm"), model=model, optimizer=opt, step=3)
    print(f"BNSAVE rank {rank} {' '.join(parameters_and_buffers(model))}", flush=True)
    opt.close()
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.a.weight += rank  # as decentralized training leaves them
    ckpt.save(os.path.join(base, "diverged"), model=model, step=3)


def batchnorm_load(base: str, saved_by: int) -> None:
    """Load ``batchnorm_save``'s checkpoints: on another number of ranks the BatchNorm model
    loads (rank 0's buffers, the parameters every rank had) and the diverged one is refused;
    on the same number each rank gets its own buffers back."""
    rank, size = bm.rank(), bm.size()
    torch.manual_seed(7)
    model = BatchNormNet()
    info = ckpt.load(os.path.join(base, "batchnorm"), model=model)
    assert info.meta["trees"]["model"] == "per_rank", info.meta["trees"]
    assert info.meta["model_parameters"] == "replicated", info.meta
    print(f"BNLOAD rank {rank} {' '.join(parameters_and_buffers(model))}", flush=True)
    model = Net()
    if size == saved_by:
        ckpt.load(os.path.join(base, "diverged"), model=model)
        return
    try:
        ckpt.load(os.path.join(base, "diverged"), model=model)
    except ckpt.WorldSizeMismatchError as exc:
        assert "model state differs from rank to rank" in str(exc), exc
    else:
        raise AssertionError("a model whose parameters differ per rank loaded on "
                             f"{size} ranks, saved by {saved_by}")


def world(shared_dir: str, per_rank_dir: str) -> None:
    """Load checkpoints written by a different number of ranks."""
    size = bm.size()
    model, opt, sched = build("gradient_allreduce", init_seed=9)
    info = ckpt.load(shared_dir, model=model, optimizer=opt)
    assert info.world_size != size and not info.rng_restored and info.rank_extras is None
    assert info.algorithm_state == "loaded" and opt.steps == info.step
    sched.load_state_dict(info.extras["scheduler"])
    mine = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()
    assert len(set(bm.allgather_object(mine))) == 1
    train(model, opt, sched, 2)  # and training goes on
    opt.close()

    model, opt, sched = build("ckpt_ef16", init_seed=9)
    try:
        ckpt.load(per_rank_dir, model=model, optimizer=opt)
    except ckpt.WorldSizeMismatchError as exc:
        assert "per-rank state of algorithm 'ckpt_ef16'" in str(exc), exc
        assert "reset_algorithm_state=True" in str(exc), exc
    else:
        raise AssertionError("per-rank algorithm state was loaded on another world size")
    info = ckpt.load(per_rank_dir, model=model, optimizer=opt, reset_algorithm_state=True)
    assert info.algorithm_state == "reset" and opt.algorithm_state_dict()["state"]["tensors"] == {}
    train(model, opt, sched, 2)
    opt.close()
    print(f"world OK on {size} ranks", flush=True)


def nodes(directory: str) -> None:
    """The same ranks on other nodes: saved with every rank a node of its own, loaded with the
    ranks two to a node. Per-rank algorithm state (a node leader's exchange state belongs to
    the node it led) is refused on every rank, naming both layouts; reset_algorithm_state
    loads the rest; on the saving layout it loads. Replicated state loads either way."""
    bm.shutdown()
    bm.init(ranks_per_node=1)
    model, opt, sched = build("ckpt_ef16", init_seed=9)
    train(model, opt, sched, 2)
    ckpt.save(directory, model=model, optimizer=opt, step=2)
    opt.close()
    bm.shutdown()
    bm.init(ranks_per_node=2)
    model, opt, sched = build("ckpt_ef16", init_seed=9)
    layouts = f"nodes of {[1] * bm.size()} ranks", f"this job's nodes hold [{bm.size()}]"
    try:
        ckpt.load(directory, model=model, optimizer=opt)
    except ckpt.WorldSizeMismatchError as exc:
        assert all(text in str(exc) for text in layouts), exc
        assert "reset_algorithm_state=True" in str(exc), exc
    else:
        raise AssertionError("per-rank algorithm state was loaded on other nodes")
    info = ckpt.load(directory, model=model, optimizer=opt, reset_algorithm_state=True)
    assert info.algorithm_state == "reset" and info.step == 2, info
    opt.close()
    bm.shutdown()
    bm.init(ranks_per_node=1)
    model, opt, sched = build("ckpt_ef16", init_seed=9)
    assert ckpt.load(directory, model=model, optimizer=opt).algorithm_state == "loaded"
    opt.close()
    print(f"nodes OK on {bm.size()} ranks", flush=True)


def crash(directory: str, fault: str) -> None:
    seed_everything(bm.rank())
    model, opt, sched = build("ckpt_ef16")
    train(model, opt, sched, 2)
    ckpt.save(directory, model=model, optimizer=opt, step=1)
    train(model, opt, sched, 1)
    os.environ[ckpt.writer.FAULT_ENV] = fault
    ckpt.save(directory, model=model, optimizer=opt, step=2)
    print("NOT KILLED", flush=True)
    sys.exit(3)


def saveloop(directory: str) -> None:
    # the pytest side kills the ranks themselves: mpiexec's proxy runs them in sessions of
    # their own, out of reach of a signal to mpiexec's process group
    print(f"pid {bm.rank()} {os.getpid()}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    opt = bm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                  named_parameters=model.named_parameters(),
                                  algorithm="ckpt_ef16")
    step = 0
    while True:
        opt.zero_grad()
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        step += 1
        ckpt.save(directory, model=model, optimizer=opt, step=step, keep=2)
        if bm.rank() == 0:
            print(f"saved {step}", flush=True)


def main() -> None:
    bm.init()
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "roundtrip":
        roundtrip(args[0])
    elif mode == "train":
        train_then_save(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "resume":
        resume(args[0], args[1], int(args[2]), *(float(a) for a in args[3:4]))
    elif mode == "gan_train":
        gan_train_then_save(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "gan_resume":
        gan_resume(args[0], args[1], int(args[2]))
    elif mode == "gan_misuse":
        gan_misuse(args[0], args[1], int(args[2]))
    elif mode == "batchnorm_save":
        batchnorm_save(args[0])
    elif mode == "batchnorm_load":
        batchnorm_load(args[0], int(args[1]))
    elif mode == "world":
        world(args[0], args[1])
    elif mode == "nodes":
        nodes(args[0])
    elif mode == "crash":
        crash(args[0], args[1])
    elif mode == "channels_last":
        channels_last(args[0], int(args[1]), int(args[2]))
    elif mode == "on_one_rank":
        on_one_rank(args[0])
    elif mode == "saveloop":
        saveloop(args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    bm.shutdown()


if __name__ == "__main__":
    main()
