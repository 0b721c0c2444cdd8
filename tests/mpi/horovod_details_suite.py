"""Horovod details (issue 24, items 3-6) under ``import bagua_mpi as hvd``, each check against
an independent oracle (NumPy, or a single-process torch simulation of every rank's training).

Run by every rank under mpiexec (tests/test_horovod_details_mpi.py) with the modes to run; each
check prints ``details <check> OK on <n> ranks`` on rank 0, and each mode ``CHECK <mode> PASS``
(or ``FAIL``).
"""
import sys

import numpy as np
import torch
from mpi4py import MPI

import bagua_mpi as hvd
from checks import expect, run_checks

SEED = 20261125
COMM = MPI.COMM_WORLD


def ok(check):
    hvd.barrier()
    if hvd.rank() == 0:
        print(f"details {check} OK on {hvd.size()} ranks", flush=True)


# -- item 3: process-set optimizers on every rank -------------------------------------------------

def model_and_data(r, steps):
    torch.manual_seed(SEED)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    model = model.double()
    rng = np.random.default_rng([SEED, r])
    data = [(torch.from_numpy(rng.normal(size=(5, 4))), torch.from_numpy(rng.normal(size=(5, 1))))
            for _ in range(steps)]
    return model, data


def grads_of(model, x, y):
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def simulate(ranks, steps):
    """One process: the averaged SGD-with-momentum training of ``ranks`` (their own data)."""
    model, _ = model_and_data(0, steps)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    datas = [model_and_data(r, steps)[1] for r in ranks]
    for s in range(steps):
        per_rank = [grads_of(model, *datas[i][s]) for i in range(len(ranks))]
        for k, p in enumerate(model.parameters()):
            p.grad = sum(g[k] for g in per_rank) / len(ranks)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_ps_optimizer(rank, size, members_set, named, op_name, **options):
    steps = 3
    members = members_set.ranks
    model, data = model_and_data(rank, steps)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kwargs = {"named_parameters": model.named_parameters()} if named else {}
    kwargs.update(options)
    dopt = hvd.DistributedOptimizer(opt, process_set=members_set, **kwargs)
    inside = rank in members
    assert isinstance(dopt, hvd.DistributedOptimizer)
    assert (type(dopt).__name__ == "LocalDistributedOptimizer") == (not inside), type(dopt)
    for x, y in data:
        dopt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        dopt.step()
    want = simulate(members if inside else [rank], steps)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-10, atol=1e-12,
                                   msg=f"{op_name}: rank {rank} (member={inside})")
    if not inside:
        assert dopt.communication_stats()["bytes_sent"] == 0
    dopt.close()
    # the global communicator is still in step on every rank
    total = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum)
    assert total.item() == size * (size - 1) / 2


def mode_psopt(rank, size, sets):
    members_set = sets[0]
    check_ps_optimizer(rank, size, members_set, named=True, op_name="named")
    ok("psopt_named")
    check_ps_optimizer(rank, size, members_set, named=False, op_name="unnamed")
    ok("psopt_unnamed")
    # the engine's own collective (which parameters some rank used) runs among the set's
    # ranks, not on the global communicator the others never enter
    check_ps_optimizer(rank, size, members_set, named=True, op_name="find_unused",
                       find_unused_parameters=True)
    ok("psopt_find_unused")


# -- item 4: DistributedOptimizer details ---------------------------------------------------------

def duplicate_names_before_init():
    w = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w, b], lr=0.1)
    assert not hvd.is_initialized()
    expect(ValueError, lambda: hvd.DistributedOptimizer(
        opt, named_parameters=[("w", w), ("w", b)]), "unique", "w")
    expect(ValueError, lambda: hvd.DistributedOptimizer(
        opt, named_parameters=[("w", w)]), "not named")
    expect(ValueError, lambda: hvd.DistributedOptimizer(
        opt, named_parameters=[["w", w], ["b", b]]), "tuples")


def mode_optdetails(rank, size, sets):
    # generated names: unique across param groups, Horovod's scheme, the same on every rank
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).double()
    groups = [{"params": list(model[0].parameters())},
              {"params": list(model[1].parameters()), "lr": 0.05}]
    dopt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = [dopt._parameter_names[p] for g in groups for p in g["params"]]
    assert names == ["allreduce.noname.0.0", "allreduce.noname.0.1",
                     "allreduce.noname.1.0", "allreduce.noname.1.1"], names
    assert COMM.allgather(names) == [names] * size
    rng = np.random.default_rng([SEED, rank])
    x, y = torch.from_numpy(rng.normal(size=(4, 3))), torch.from_numpy(rng.normal(size=(4, 1)))
    dopt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    dopt.step()  # trains with the generated names: every rank ends with the same model
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    assert all(np.array_equal(flat, other) for other in COMM.allgather(flat))
    dopt.close()
    dup = torch.optim.SGD(model.parameters(), lr=0.1)
    expect(ValueError, lambda: hvd.DistributedOptimizer(
        dup, named_parameters=[("same", p) for p in model.parameters()]), "unique")
    ok("optimizer_names")

    # broadcast_optimizer_state with frozen parameters
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).double()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:  # only the root has state: two local steps on its own data
        for s in range(2):
            x = torch.from_numpy(np.random.default_rng([SEED, s]).normal(size=(4, 3)))
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    for p in model[0].parameters():
        assert p.grad is None, "a frozen parameter got a gradient"
    root = COMM.bcast(opt.state_dict() if rank == 0 else None, root=0)  # the oracle: mpi4py
    mine = opt.state_dict()
    assert mine["param_groups"][0]["lr"] == root["param_groups"][0]["lr"] == 0.01
    assert sorted(mine["state"]) == sorted(root["state"]) == [2, 3], sorted(mine["state"])
    for pid, st in root["state"].items():
        for key, value in st.items():
            got = mine["state"][pid][key]
            if torch.is_tensor(value):
                assert torch.equal(got, value), (pid, key)
            else:
                assert got == value, (pid, key)
    dopt.close()
    ok("broadcast_optimizer_state_frozen")


# -- item 5: integer and float16 scaling in reducescatter -----------------------------------------

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]


def rs_input(r, dtype, shape):
    rng = np.random.default_rng([SEED, r, DTYPES.index(dtype)])
    lo = 0 if dtype == "uint8" else -5
    if dtype.startswith("float"):
        return rng.uniform(-5, 5, size=shape).astype(dtype)
    return rng.integers(lo, 6, size=shape).astype(dtype)


def rs_oracle(inputs, dtype, op, pre, post):
    size = len(inputs)
    if dtype.startswith("int") or dtype == "uint8":  # Horovod: float64, truncated, cast back
        work = [np.trunc(x.astype(np.float64) * pre).astype(dtype) for x in inputs]
        total = np.sum(np.stack(work).astype(np.int64), axis=0).astype(dtype)
        factor = post / size if op == "Average" else post
        return np.trunc(total.astype(np.float64) * factor).astype(dtype)
    wire = np.float32 if dtype == "float16" else np.dtype(dtype).type
    work = [x.astype(wire) * wire(pre) for x in inputs]
    total = np.sum(np.stack(work), axis=0, dtype=wire)
    factor = post / size if op == "Average" else post
    return (total * wire(factor)).astype(dtype)


def mode_rsint(rank, size, sets):
    rows = [7 // size + (1 if r < 7 % size else 0) for r in range(size)]
    start = sum(rows[:rank])
    for dtype in DTYPES:
        for op in ("Sum", "Average"):
            for pre, post in ((0.7, 1.3), (2.5, 0.3), (1.0, 0.45), (0.55, 1.0)):
                inputs = [rs_input(r, dtype, (7, 3)) for r in range(size)]
                mine = torch.from_numpy(inputs[rank].copy())
                before = mine.clone()
                want = rs_oracle(inputs, dtype, op, pre, post)[start:start + rows[rank]]
                got = hvd.reducescatter(mine, op=getattr(hvd, op), prescale_factor=pre,
                                        postscale_factor=post)
                g2 = hvd.grouped_reducescatter([mine, mine.flip(0).contiguous()],
                                               op=getattr(hvd, op), prescale_factor=pre,
                                               postscale_factor=post)
                flipped = rs_oracle([x[::-1] for x in inputs], dtype, op, pre, post)
                what = f"{dtype} {op} pre={pre} post={post}"
                assert torch.equal(mine, before), f"{what}: the input was modified"
                for out, ref in ((got, want), (g2[0], want),
                                 (g2[1], flipped[start:start + rows[rank]])):
                    assert str(out.dtype) == f"torch.{dtype}", what
                    if dtype == "float16":  # summation order: within float16 rounding
                        np.testing.assert_allclose(out.numpy().astype(np.float64),
                                                   ref.astype(np.float64), rtol=2e-3,
                                                   atol=2e-3, err_msg=what)
                    elif dtype.startswith("float"):
                        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6,
                                                   err_msg=what)
                    else:
                        np.testing.assert_array_equal(out.numpy(), ref, err_msg=what)
    ok("reducescatter_scaling")


# -- item 6: names of operations in flight --------------------------------------------------------

def mode_names(rank, size, sets):
    def t(k):
        return torch.full((3,), float(k + rank))

    base = size * (size - 1) / 2  # sum of the ranks
    # (a) every rank reuses a name in flight: every rank raises, locally, and recovers
    h = hvd.allreduce_async(t(1), name="x", op=hvd.Sum)
    expect(ValueError, lambda: hvd.allreduce_async(t(2), name="x", op=hvd.Sum), "'x'", "pending")
    expect(ValueError, lambda: hvd.allreduce(t(2), name="x", op=hvd.Sum), "'x'")
    expect(ValueError, lambda: hvd.allgather_async(t(2), name="x"), "'x'")
    assert torch.equal(hvd.synchronize(h), torch.full((3,), size * 1 + base))
    h = hvd.allreduce_async(t(2), name="x", op=hvd.Sum)  # released by synchronize: usable
    assert torch.equal(hvd.synchronize(h), torch.full((3,), size * 2 + base))
    ok("names_all_reuse")

    # (b) only the last rank reuses the name: it raises before any traffic, synchronizes the
    # first operation and resubmits under another name; the others never notice
    offender = size - 1
    h1 = hvd.allreduce_async(t(3), name="y", op=hvd.Sum)
    if rank == offender:
        expect(ValueError, lambda: hvd.allreduce_async(t(4), name="y", op=hvd.Sum), "'y'")
        r1 = hvd.synchronize(h1)
        h2 = hvd.allreduce_async(t(4), name="z", op=hvd.Sum)
    else:
        h2 = hvd.allreduce_async(t(4), name="z", op=hvd.Sum)
        r1 = hvd.synchronize(h1)
    r2 = hvd.synchronize(h2)
    assert torch.equal(r1, torch.full((3,), size * 3 + base))
    assert torch.equal(r2, torch.full((3,), size * 4 + base))
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="y")  # names free again
    assert total.item() == size
    ok("names_one_rank_reuses")

    # (c) unnamed and differently named operations are never refused
    hs = [hvd.allreduce_async(t(k), op=hvd.Sum) for k in range(3)]
    hs += [hvd.allreduce_async(t(k), name=f"n{k}", op=hvd.Sum) for k in range(3)]
    for i, hh in enumerate(hs):
        assert torch.equal(hvd.synchronize(hh), torch.full((3,), size * (i % 3) + base))
    ok("names_distinct")


MODES = {"psopt": mode_psopt, "optdetails": mode_optdetails, "rsint": mode_rsint,
         "names": mode_names}


def main():
    """Every mode named runs in one job (one interpreter start), ``checks.run_checks`` reporting
    each mode on its own line; the init is the modes' together: duplicate names are checked
    before it, and psopt's process set is registered by it."""
    modes = sys.argv[1:]
    sets = []
    if "optdetails" in modes:
        duplicate_names_before_init()
    if "psopt" in modes:
        size = COMM.Get_size()
        sets = [hvd.ProcessSet(range(max(1, size - 1)))]  # the last rank is outside (size > 1)
    hvd.init(process_sets=sets)
    failures = run_checks({m: lambda rank, size, m=m: MODES[m](rank, size, sets) for m in modes},
                          argv=[])
    hvd.barrier()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
