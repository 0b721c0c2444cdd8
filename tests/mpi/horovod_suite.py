"""Horovod's torch API under ``import bagua_mpi as hvd``, against a NumPy simulation of all ranks.

Run by every rank under mpiexec (tests/test_horovod_mpi.py). Each mode is a group of checks;
modes given together run in one job and print ``CHECK <mode> PASS`` (or ``FAIL``) on rank 0;
``process_sets`` and ``elastic`` run alone and print ``horovod <mode> OK on <n> ranks``.
"""
import os
import sys
import warnings

import numpy as np
import torch
from mpi4py import MPI

import bagua_mpi as hvd
from checks import expect, run_checks

SEED = 20261123
DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
          "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64, "bool": torch.bool}
FLOATS = ("float16", "bfloat16", "float32", "float64")
# (rtol, atol): inputs are up to 20 in magnitude, sums of 4 ranks cancel to near zero
TOL = {"float16": (2e-3, 2e-2), "bfloat16": (1.6e-2, 1.6e-1), "float32": (1e-5, 1e-4),
       "float64": (1e-12, 1e-11)}


def inp(tag, r, shape, dtype, lo=-20, hi=20):
    """Rank r's input for check ``tag``: every rank can build every rank's input."""
    rng = np.random.default_rng([SEED, r, sum(map(ord, tag))])
    if dtype == "bool":
        return torch.from_numpy(rng.random(shape) < 0.5)
    if dtype in FLOATS:
        return torch.from_numpy(rng.uniform(lo, hi, size=shape)).to(DTYPES[dtype])
    if dtype == "uint8":
        lo = 0
    return torch.from_numpy(rng.integers(lo, hi + 1, size=shape)).to(DTYPES[dtype])


def same(got, want, what):
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != " \
                                                  f"{tuple(want.shape)}"
    name = str(got.dtype).replace("torch.", "")
    if name in TOL:
        rtol, atol = TOL[name]
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, msg=what)
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


def f64(ts):
    return np.stack([t.double().numpy() for t in ts])


# -- modes ---------------------------------------------------------------------------------------

def mode_api(rank, size):
    """Build queries, keyword arguments, positional order, names, dtypes, integer Average."""
    assert hvd.is_initialized() and hvd.mpi_built() and hvd.mpi_enabled()
    assert not hvd.gloo_built() and not hvd.gloo_enabled() and hvd.nccl_built() == (hvd.nccl_built() if torch.cuda.is_available() else 0)
    assert not any(f() for f in (hvd.ccl_built, hvd.ddl_built, hvd.rocm_built, hvd.mlsl_built))
    assert hvd.cuda_built() == torch.cuda.is_available()
    assert isinstance(hvd.mpi_threads_supported(), bool) and hvd.is_homogeneous()
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1) or os.environ.get(
        "BAGUA_MPI_RANKS_PER_NODE")
    xs = [inp("kw", r, (5, 3), "float32") for r in range(size)]
    total = torch.from_numpy(f64(xs).sum(0)).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        same(hvd.allreduce(xs[rank], average=False), total, "average=False")
        same(hvd.allreduce(xs[rank], average=True), total / size, "average=True")
        same(hvd.allreduce(xs[rank], False), total, "positional average")
    expect(ValueError, lambda: hvd.allreduce(xs[rank], average=True, op=hvd.Sum), "supersedes")
    if size & (size - 1):  # Adasum: power-of-two rank counts only (tests/mpi/adasum_suite.py)
        expect(NotImplementedError, lambda: hvd.allreduce(xs[rank], op=hvd.Adasum), "power of 2")
    else:
        assert hvd.allreduce(xs[rank], op=hvd.Adasum).shape == xs[rank].shape
    # Horovod's positional order: (tensor, average, name, compression, op, prescale, postscale, ps)
    got = hvd.allreduce(xs[rank], None, "pos", hvd.Compression.none, hvd.Sum, 2.0, 0.5,
                        hvd.global_process_set)
    same(got, total, "positional order")
    same(hvd.allreduce(xs[rank], hvd.Sum), total, "bagua positional op")
    got = hvd.allreduce(xs[rank], op=hvd.Average, prescale_factor=3.0, postscale_factor=0.25)
    same(got, total * 0.75 / size, "pre/postscale")
    got = hvd.allreduce(xs[rank], name="fp16", compression=hvd.Compression.fp16, op=hvd.Sum)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, total, rtol=2e-3, atol=2e-2)
    mine = xs[rank].clone()
    assert hvd.allreduce_(mine, None, "inplace", hvd.Sum) is mine
    same(mine, total, "allreduce_ positional")
    mine = xs[rank].clone()
    same(hvd.synchronize(hvd.allreduce_async_(mine, name="ia", op=hvd.Sum)), total, "async_")
    # duplicate names of operations in flight: ValueError at once, on every rank
    h = hvd.allreduce_async(xs[rank], name="dup")
    expect(ValueError, lambda: hvd.allreduce_async(xs[rank], name="dup"), "'dup'")
    expect(ValueError, lambda: hvd.broadcast(xs[rank], 0, "dup"), "'dup'")
    same(hvd.synchronize(h), total / size, "dup first")
    hvd.synchronize(hvd.allreduce_async(xs[rank], name="dup"))  # free again
    # every Horovod dtype in every collective, per-rank different data
    for dt in DTYPES:
        ins = [inp("dt" + dt, r, (2 * size + 1, 3), dt, -9, 9) for r in range(size)]
        if dt == "bool":
            want = torch.from_numpy(np.stack([t.numpy() for t in ins]).any(0))
            same(hvd.allreduce(ins[rank], op=hvd.Max), want, "bool Max")
        else:
            want = torch.from_numpy(f64(ins).sum(0)).to(DTYPES[dt])
            same(hvd.allreduce(ins[rank], op=hvd.Sum), want, f"allreduce {dt}")
            red = torch.from_numpy(f64(ins).sum(0)).to(DTYPES[dt])
            rows = hvd.collectives.reducescatter_rows(2 * size + 1, size)
            start = sum(rows[:rank])
            same(hvd.reducescatter(ins[rank], op=hvd.Sum), red[start:start + rows[rank]],
                 f"reducescatter {dt}")
        same(hvd.allgather(ins[rank][:rank + 1]), torch.cat([t[:r + 1] for r, t in
                                                             enumerate(ins)]), f"allgather {dt}")
        root = size - 1
        same(hvd.broadcast(ins[rank], root), ins[root], f"broadcast {dt}")
        a2a = [inp("a2a" + dt, r, (2 * size, 2), dt) for r in range(size)]
        same(hvd.alltoall(a2a[rank]), torch.cat([t[2 * rank:2 * rank + 2] for t in a2a]),
             f"alltoall {dt}")
    # Average of integers: sum, scale by 1/n in float64, truncate toward zero (Horovod)
    for dt in ("int8", "int16", "int32", "int64", "uint8"):
        ins = [inp("avg" + dt, r, (40,), dt, -20, 20) for r in range(size)]
        want = torch.from_numpy(np.trunc(f64(ins).sum(0) / size)).to(DTYPES[dt])
        same(hvd.allreduce(ins[rank]), want, f"integer average {dt}")
        same(hvd.grouped_allreduce([ins[rank]])[0], want, f"grouped integer average {dt}")
        want = torch.from_numpy(np.trunc(np.trunc(f64(ins) * 1.5).sum(0) * 0.5)).to(
            DTYPES[dt])
        same(hvd.allreduce(ins[rank], op=hvd.Sum, prescale_factor=1.5, postscale_factor=0.5),
             want, f"integer scaling {dt}")
    # alltoall returns (tensor, received splits) when splits are given, as Horovod
    splits = [(rank + j) % 3 for j in range(size)]
    t = inp("split", rank, (sum(splits), 2), "float32")
    out, received = hvd.alltoall(t, splits=splits, name="a2a")
    assert received.dtype == torch.int32 and received.tolist() == [(r + rank) % 3
                                                                   for r in range(size)]
    assert out.shape[0] == sum(received.tolist())
    return 0


def mode_grouped(rank, size):
    """grouped_allgather, grouped_reducescatter, sparse_allreduce_async, barrier, objects."""
    shapes = [(rank + 1, 3), (0, 2), (2,)]
    per = [[inp(f"ga{i}", r, (s[0] if i != 0 else r + 1,) + s[1:], "float32")
            for i, s in enumerate(shapes)] for r in range(size)]
    got = hvd.grouped_allgather(per[rank], name="ga")
    for i in range(3):
        same(got[i], torch.cat([per[r][i] for r in range(size)]), f"grouped_allgather {i}")
    got = hvd.synchronize(hvd.grouped_allgather_async(per[rank]))
    same(got[0], torch.cat([per[r][0] for r in range(size)]), "grouped_allgather_async")
    rows = 2 * size + 1
    per = [[inp(f"rs{i}", r, (rows, 2), dt) for i, dt in enumerate(["float32", "int32",
                                                                     "float64"])]
           for r in range(size)]
    split = hvd.collectives.reducescatter_rows(rows, size)
    start = sum(split[:rank])
    for op, name in ((hvd.Sum, "sum"), (hvd.Average, "avg")):
        got = hvd.grouped_reducescatter(per[rank], op=op)
        for i in range(3):
            full = f64([per[r][i] for r in range(size)]).sum(0)
            if name == "avg":
                full = np.trunc(full / size) if i == 1 else full / size
            same(got[i], torch.from_numpy(full).to(per[rank][i].dtype)[start:start + split[rank]],
                 f"grouped_reducescatter {name} {i}")
    got = hvd.synchronize(hvd.grouped_reducescatter_async(per[rank], op=hvd.Sum))
    same(got[2], torch.from_numpy(f64([per[r][2] for r in range(size)]).sum(0))[start:start +
                                                                                split[rank]],
         "grouped_reducescatter_async")
    # sparse allreduce: every rank's entries, averaged (dense view compared)
    dense = [torch.zeros(6, 2) for _ in range(size)]
    for r in range(size):
        dense[r][r % 6] = r + 1.0
        dense[r][(r + 2) % 6] = -2.0 * r
    for op in (hvd.Average, hvd.Sum):
        want = sum(dense) / (size if op is hvd.Average else 1)
        h = hvd.sparse_allreduce_async(dense[rank].to_sparse(), f"sp{op.name}", op)
        got = hvd.synchronize(h)
        assert got.is_sparse
        same(got.to_dense(), want, f"sparse {op.name}")
        # Horovod's own way: the handle is a function returning the result
        got = hvd.sparse_allreduce_async(dense[rank].to_sparse(), f"spc{op.name}", op)()
        assert got.is_sparse
        same(got.to_dense(), want, f"sparse {op.name}, handle called")
    hvd.barrier()
    hvd.barrier(process_set=hvd.global_process_set)
    assert hvd.broadcast_object({"r": rank}, size - 1) == {"r": size - 1}
    assert hvd.allgather_object(rank, name="ag") == list(range(size))
    return 0


def mode_process_sets(rank, size):
    """Process sets from ranks and from a communicator (registered at init), added and removed
    later, node-local / cross-node ones; non-members refused; roots are global ranks."""
    even, from_comm = _init_sets
    assert even.process_set_id is not None and even.ranks == list(range(0, size, 2))
    members = [r for r in range(size) if r // 2 == rank // 2]
    assert from_comm.ranks == members and from_comm.process_set_id is not None
    assert hvd.global_process_set.size() == size and hvd.global_process_set.rank() == rank
    xs = [inp("ps", r, (4, 2), "float64") for r in range(size)]
    got = hvd.allreduce(xs[rank], op=hvd.Sum, process_set=from_comm)
    same(got, torch.from_numpy(f64([xs[r] for r in members]).sum(0)), "allreduce on set")
    assert from_comm.size() == len(members) and from_comm.rank() == members.index(rank)
    same(hvd.allgather(xs[rank], process_set=from_comm), torch.cat([xs[r] for r in members]),
         "allgather on set")
    root = members[-1]  # a global rank
    same(hvd.broadcast(xs[rank], root, process_set=from_comm), xs[root], "broadcast on set")
    rows = hvd.collectives.reducescatter_rows(4, len(members))
    me = members.index(rank)
    same(hvd.reducescatter(xs[rank], op=hvd.Sum, process_set=from_comm),
         torch.from_numpy(f64([xs[r] for r in members]).sum(0))[sum(rows[:me]):
                                                                sum(rows[:me]) + rows[me]],
         "reducescatter on set")
    hvd.barrier(process_set=from_comm)
    if even.included():
        got = hvd.allreduce(xs[rank], op=hvd.Sum, process_set=even)
        same(got, torch.from_numpy(f64(xs[::2]).sum(0)), "allreduce on even set")
        assert even.topology is not None and even.topology.size == len(even.ranks)
    else:
        assert even.topology is None and even.rank() == -1
        expect(ValueError, lambda: hvd.allreduce(xs[rank], process_set=even), "not in")
    outsiders = [r for r in range(size) if r not in members]
    if outsiders:  # a root outside the set
        expect(ValueError, lambda: hvd.broadcast(xs[rank], outsiders[0], process_set=from_comm),
               "not in")
    # registering the same ranks again (init on an initialised job only registers) names the
    # same set; add_process_set refuses it instead (below)
    clone = hvd.ProcessSet(list(even.ranks))
    hvd.init(process_sets=[clone])
    assert clone.process_set_id == even.process_set_id
    # dynamic sets (collective): ranks 1 and size-1; a duplicate is refused
    if size >= 3:
        last = hvd.add_process_set([1, size - 1])
        assert last.process_set_id not in (None, 0)
        expect(ValueError, lambda: hvd.add_process_set([size - 1, 1]), "exists")
        if last.included():
            got = hvd.allreduce(xs[rank], op=hvd.Sum, process_set=last)
            same(got, torch.from_numpy(f64([xs[1], xs[-1]]).sum(0)), "allreduce on added set")
        assert hvd.remove_process_set(last) and last.process_set_id is None
        assert not hvd.remove_process_set(last)
        expect(ValueError, lambda: hvd.allreduce(xs[rank], process_set=last), "not registered")
    assert not hvd.remove_process_set(hvd.global_process_set)
    # node-local and cross-node sets (BAGUA_MPI_RANKS_PER_NODE=2 poses pairs as nodes)
    node = hvd.node_local_process_set()
    cross = hvd.cross_node_process_set()
    assert node.ranks == sorted(hvd.allgather_object(rank, process_set=node))
    assert len(node.ranks) == hvd.local_size() and len(cross.ranks) == hvd.cross_size()
    same(hvd.allreduce(xs[rank], op=hvd.Sum, process_set=node),
         torch.from_numpy(f64([xs[r] for r in node.ranks]).sum(0)), "node-local allreduce")
    same(hvd.allreduce(xs[rank], op=hvd.Sum, process_set=cross),
         torch.from_numpy(f64([xs[r] for r in cross.ranks]).sum(0)), "cross-node allreduce")
    # DistributedOptimizer(process_set=): each pair trains its own model (data parallel inside)
    torch.manual_seed(rank // 2)
    model = torch.nn.Linear(3, 1)
    start = model.weight.detach().double().numpy().copy()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), process_set=from_comm)
    for _ in range(3):
        opt.zero_grad()
        model(inp(f"pso{_}", rank, (4, 3), "float32", -1, 1)).sum().backward()
        opt.step()
    opt.close()
    # the loss is linear: d sum(Wx + b) / dW is the sum of the batch's rows, whatever W is, so
    # three SGD steps move W by -0.1 x (the pair's average of those sums), summed over steps
    expected = start - 0.1 * sum(
        np.mean([inp(f"pso{step}", r, (4, 3), "float32", -1, 1).double().numpy().sum(0)
                 for r in members], axis=0) for step in range(3))
    np.testing.assert_allclose(model.weight.detach().double().numpy(), expected, rtol=1e-5,
                               atol=1e-6, err_msg="set training must average over its members only")
    weights = hvd.allgather_object(model.weight.detach().numpy().tobytes())
    assert all((weights[a] == weights[b]) == (a // 2 == b // 2) or size <= 2
               for a in range(size) for b in range(size)), "pairs must agree, not more"
    # a set's topology is what DistributedOptimizer(process_set=) uses: hierarchical works too
    got = hvd.allreduce(xs[rank], op=hvd.Sum, process_set=from_comm, hierarchical=True)
    same(got, torch.from_numpy(f64([xs[r] for r in members]).sum(0)), "hierarchical on set")
    return 0


def mode_autograd(rank, size):
    """Gradients of the collectives are Horovod's (as its tests check them)."""
    xs = [inp("ag", r, (2 * size, 3), "float64") for r in range(size)]
    gs = [inp("agg", r, (2 * size, 3), "float64") for r in range(size)]
    G = f64(gs)
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / size)):
        x = xs[rank].clone().requires_grad_()
        y = hvd.allreduce(x, op=op, prescale_factor=2.0)
        y.backward(gs[rank])
        same(x.grad, torch.from_numpy(G.sum(0) * scale * 2.0), f"allreduce grad {op.name}")
        x = xs[rank].clone().requires_grad_()
        ys = hvd.grouped_allreduce([x, x * 2], op=op)
        (ys[0] * gs[rank]).sum().add((ys[1] * gs[rank]).sum()).backward()
        same(x.grad, torch.from_numpy(G.sum(0) * scale * 3), f"grouped allreduce grad {op.name}")
    # allgather: backward = average of the gradients, this rank's rows (rank r gave r+1 rows)
    x = xs[rank][:rank + 1].clone().requires_grad_()
    y = hvd.allgather(x)
    total = sum(r + 1 for r in range(size))
    gg = [inp("gag", r, (total, 3), "float64") for r in range(size)]
    y.backward(gg[rank])
    start = sum(r + 1 for r in range(rank))
    same(x.grad, torch.from_numpy(f64(gg).mean(0)[start:start + rank + 1]), "allgather grad")
    x = xs[rank][:rank + 1].clone().requires_grad_()
    ys = hvd.grouped_allgather([x, x])
    (ys[0] * gg[rank]).sum().add((ys[1] * gg[rank]).sum()).backward()
    same(x.grad, torch.from_numpy(2 * f64(gg).mean(0)[start:start + rank + 1]),
         "grouped allgather grad")
    # broadcast: the root gets the average gradient, the others zeros
    root = size - 1
    x = xs[rank].clone().requires_grad_()
    hvd.broadcast(x, root).backward(gs[rank])
    want = G.mean(0) if rank == root else np.zeros_like(G[0])
    same(x.grad, torch.from_numpy(want), "broadcast grad")
    # alltoall: backward sends the gradient back along the received splits
    x = xs[rank].clone().requires_grad_()
    y = hvd.alltoall(x)
    y.backward(gs[rank])
    want = np.concatenate([G[j][2 * rank:2 * rank + 2] for j in range(size)])
    same(x.grad, torch.from_numpy(want), "alltoall grad")
    splits = [(rank + j) % 3 for j in range(size)]
    x = inp("a2ag", rank, (sum(splits), 2), "float64").requires_grad_()
    y, received = hvd.alltoall(x, splits)
    y.backward(torch.ones_like(y) * (rank + 1))
    want = np.concatenate([np.full((splits[j], 2), j + 1.0) for j in range(size)])
    same(x.grad, torch.from_numpy(want), "alltoall splits grad")
    # reducescatter: allgather of the gradient, times the set size for Sum (Horovod's tests)
    rows = hvd.collectives.reducescatter_rows(2 * size, size)
    for op, factor in ((hvd.Sum, size), (hvd.Average, 1)):
        x = xs[rank].clone().requires_grad_()
        y = hvd.reducescatter(x, op=op)
        gy = [inp("rsg", r, (rows[r], 3), "float64") for r in range(size)]
        y.backward(gy[rank])
        same(x.grad, torch.from_numpy(np.concatenate([g.numpy() for g in gy]) * factor),
             f"reducescatter grad {op.name}")
        x = xs[rank].clone().requires_grad_()
        ys = hvd.grouped_reducescatter([x], op=op)
        ys[0].backward(gy[rank])
        same(x.grad, torch.from_numpy(np.concatenate([g.numpy() for g in gy]) * factor),
             f"grouped reducescatter grad {op.name}")
    # a collective inside forward: model-parallel style layer trains
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    loss = hvd.allreduce(xs[rank] * w, op=hvd.Sum).sum()
    loss.backward()  # d/dw of sum over ranks' losses: every rank's rows, summed
    same(hvd.allreduce(w.grad, op=hvd.Sum), torch.from_numpy(f64(xs).sum(0).sum(0) * size),
         "layer grad")
    return 0


def mode_join(rank, size):
    """Uneven inputs: rank r runs r + 1 steps, then joins; joined ranks contribute zeros."""
    steps = rank + 1
    for i in range(steps):
        x = inp(f"j{i}", rank, (5,), "float32")
        active = [r for r in range(size) if r + 1 > i]
        got = hvd.allreduce(x, op=hvd.Sum, name=f"step{i}")
        same(got, torch.from_numpy(f64([inp(f"j{i}", r, (5,), "float32")
                                        for r in active]).sum(0)).float(), f"join step {i}")
        got = hvd.allreduce(x.double())  # Average divides by the full size, as Horovod
        same(got, torch.from_numpy(f64([inp(f"j{i}", r, (5,), "float32")
                                        for r in active]).sum(0) / size), f"join avg {i}")
        g = hvd.grouped_allreduce([x, x.half(), torch.full((2,), rank, dtype=torch.int64)],
                                  op=hvd.Sum)
        same(g[2], torch.full((2,), sum(active), dtype=torch.int64), f"join grouped {i}")
    last = hvd.join()
    assert last == size - 1, f"join returned {last}, expected {size - 1}"
    # everyone is back in step: ordinary collectives work
    same(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(size)), "after join")
    if size > 1:  # only allreduce accepts joined ranks: anything else raises where it was
        # called, and the joined rank stays joined (Horovod's test_horovod_join_allgather)
        if rank == 0:
            assert hvd.join() == size - 1
        else:
            for what, fn in (("broadcast", lambda: hvd.broadcast(torch.ones(1), 1)),
                             ("allgather", lambda: hvd.allgather(torch.ones(2))),
                             ("alltoall", lambda: hvd.alltoall(torch.ones(size))),
                             ("reducescatter", lambda: hvd.reducescatter(torch.ones(size))),
                             ("barrier", hvd.barrier),
                             ("allgather_object", lambda: hvd.allgather_object(rank))):
                e = expect(hvd.HorovodInternalError, fn, what, "joined")
                assert isinstance(e, hvd.JoinedRankError) and isinstance(e, RuntimeError)
            same(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), size - 1.0),
                 "allreduce after the errors")
            assert hvd.join() == size - 1
    same(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(size)), "after error")
    return 0


def mode_state(rank, size):
    """broadcast_parameters / broadcast_optimizer_state as Horovod, SyncBatchNorm, elastic,
    DistributedOptimizer's Horovod arguments, exceptions, timeline."""
    torch.manual_seed(100 + rank)  # different models per rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ref = [p.detach().clone() for p in model.parameters()]
    everyone = hvd.allgather_object([p.numpy() for p in ref])
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=1 % size)
    for p, q in zip(model.parameters(), everyone[1 % size]):
        assert np.array_equal(p.detach().numpy(), q)
    torch.manual_seed(7 + rank)
    for p in model.parameters():
        p.data.normal_()
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)  # unnamed: given order
    assert hvd.allgather_object([p.detach().numpy().tobytes() for p in model.parameters()]) \
        == [[p.detach().numpy().tobytes() for p in model.parameters()]] * size
    # an optimizer with no state yet: initialised (parameters untouched), then rank 0's
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1), weight_decay=0.1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert len(opt.state) == 4 and opt.param_groups[0]["lr"] == 0.01
    assert all(float(s["step"]) == 0 for s in opt.state.values())
    # after rank-dependent steps, rank 0's state everywhere
    x = inp("opt", rank, (8, 4), "float32")
    model(x).pow(2).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sd = opt.state_dict()
    mine = [sd["state"][k]["exp_avg"].numpy().tobytes() for k in sorted(sd["state"])]
    assert hvd.allgather_object(mine) == [hvd.broadcast_object(mine, 0)] * size
    # SyncBatchNorm == BatchNorm over the concatenation of every rank's batch (uneven sizes)
    xs = [inp("bn", r, (r + 2, 3, 4), "float64") for r in range(size)]
    gs = [inp("bng", r, (r + 2, 3, 4), "float64") for r in range(size)]
    sbn = hvd.SyncBatchNorm(3, momentum=0.3).double()
    bn = torch.nn.BatchNorm1d(3, momentum=0.3).double()
    with torch.no_grad():
        for m in (sbn, bn):
            m.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = xs[rank].clone().requires_grad_()
    y = sbn(x)
    y.backward(gs[rank])
    full = torch.cat(xs).requires_grad_()
    yf = bn(full)
    yf.backward(torch.cat(gs))
    start = sum(r + 2 for r in range(rank))
    same(y.detach(), yf.detach()[start:start + rank + 2], "SyncBatchNorm forward")
    same(x.grad, full.grad[start:start + rank + 2], "SyncBatchNorm input grad")
    same(hvd.allreduce(sbn.weight.grad, op=hvd.Sum), bn.weight.grad, "SyncBatchNorm weight grad")
    same(sbn.running_mean, bn.running_mean, "running mean")
    same(sbn.running_var, bn.running_var, "running var")
    sbn.eval()
    same(sbn(xs[rank]), bn.eval()(xs[rank]), "SyncBatchNorm eval")
    # exceptions: a mismatch is catchable as Horovod's HorovodInternalError and RuntimeError
    from bagua_mpi.horovod.exceptions import HorovodInternalError, HostsUpdatedInterrupt
    assert HorovodInternalError is hvd.HorovodInternalError and issubclass(
        HostsUpdatedInterrupt, RuntimeError)
    if size > 1:
        e = expect(HorovodInternalError, lambda: hvd.allreduce(torch.zeros(2 + rank)), "rank 0")
        assert isinstance(e, RuntimeError) and isinstance(e, hvd.MismatchError)
    # DistributedOptimizer with Horovod's full signature
    model2 = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model2.state_dict(), root_rank=0)
    dopt = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                    model2.named_parameters(), hvd.Compression.none, 1,
                                    hvd.Average, 1.0, num_groups=2, sparse_as_dense=True)
    assert (dopt.backward_passes_per_step, dopt.op, dopt.num_groups, dopt.sparse_as_dense) == \
        (1, hvd.Average, 2, True)
    assert set(dopt._parameter_names.values()) == {"weight", "bias"}
    other = torch.nn.Linear(4, 2)  # wrapping model2's parameters again would close dopt
    if size & (size - 1):
        expect(NotImplementedError, lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(other.parameters(), lr=0.1), op=hvd.Adasum), "power of 2")
    else:
        assert isinstance(hvd.DistributedOptimizer(
            torch.optim.SGD(other.parameters(), lr=0.1), op=hvd.Adasum),
            hvd.DistributedOptimizer)
    model2(inp("dopt", rank, (6, 4), "float32")).sum().backward()
    dopt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dopt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught)
    model2(inp("dopt2", rank, (6, 4), "float32")).sum().backward()
    dopt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dopt.skip_synchronize():
            dopt.step()
    assert not any("skip_synchronize" in str(w.message) for w in caught)
    dopt.close()
    # timeline: named collectives recorded on rank 0
    path = os.environ.get("HVD_TIMELINE_PATH")
    if path:
        hvd.start_timeline(path)
        hvd.allreduce(torch.ones(3), name="tl.named")
        hvd.allgather(torch.ones(1))
        hvd.stop_timeline()
        if rank == 0:
            import json
            names = [e["name"] for e in json.load(open(path))["traceEvents"]]
            assert "tl.named" in names and any(n.startswith("allgather.noname") for n in names)
    return 0


def mode_sync_batch_norm(rank, size):
    """``SyncBatchNorm.convert_sync_batchnorm`` (DDP scripts call torch's, whose layers without
    torch.distributed's default group normalize each rank's batch alone): a model's
    BatchNorm1d/2d and torch SyncBatchNorm layers become ours, holding the same parameters
    and running buffers and keeping their mode; then two training forward/backward passes at
    1-4 ranks (uneven batches, one layer with ``momentum=None``) match the unconverted model
    on the concatenation of every rank's batch: outputs, input gradients, summed parameter
    gradients and running statistics."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.BatchNorm2d(3, momentum=0.3),
            torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(48, 5),
            torch.nn.BatchNorm1d(5, momentum=None), torch.nn.Tanh(),
            torch.nn.Sequential(torch.nn.SyncBatchNorm(5)), torch.nn.Linear(5, 2)).double()
    reference, net = model(), model()
    layers = [net[1], net[5], net[7][0]]
    params = [list(layer.parameters()) for layer in layers]
    buffers = [layer.running_mean for layer in layers]
    net[7][0].eval()  # the mode carries over
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(net)
    assert converted is net
    for k, old in ((1, layers[0]), (5, layers[1])):
        assert type(net[k]) is hvd.SyncBatchNorm and net[k].momentum == old.momentum
    inner = net[7][0]
    assert type(inner) is hvd.SyncBatchNorm and not inner.training, "the nested layer's mode"
    for k, layer in enumerate((net[1], net[5], inner)):
        assert all(a is b for a, b in zip(layer.parameters(), params[k], strict=True)), (
            f"layer {k}: not the same parameters")
        assert layer.running_mean is buffers[k], f"layer {k}: not the same running mean"
    inner.train()
    reference[7][0] = torch.nn.BatchNorm1d(5).double()  # one process: torch's is plain BN
    sizes = [r + 2 for r in range(size)]
    start = sum(sizes[:rank])
    for step in range(2):
        xs = [inp(f"cbn{step}", r, (sizes[r], 2, 4, 4), "float64", -2, 2) for r in range(size)]
        x = xs[rank].clone().requires_grad_()
        full = torch.cat(xs).requires_grad_()
        net.zero_grad()
        reference.zero_grad()
        y, yf = net(x), reference(full)
        y.pow(2).sum().backward()
        yf.pow(2).sum().backward()
        same(y.detach(), yf.detach()[start:start + sizes[rank]], f"step {step}: output")
        same(x.grad, full.grad[start:start + sizes[rank]], f"step {step}: input grad")
        for (name, p), q in zip(net.named_parameters(), reference.parameters()):
            same(hvd.allreduce(p.grad, op=hvd.Sum), q.grad, f"step {step}: {name} grad")
    for name, buffer in net.named_buffers():
        same(buffer, dict(reference.named_buffers())[name], f"buffer {name}")
    # float32 batches whose mean dwarfs their spread (and differs a little per rank): the
    # statistics keep the variance (float32 sums of squares minus the squared mean lose it all)
    shifts = torch.tensor([1e3, -5e2, 4e3], dtype=torch.float64).reshape(1, 3, 1)
    xs = [(inp("wide", r, (sizes[r], 3, 5), "float64", -0.5, 0.5) + 0.1 * r + shifts).float()
          for r in range(size)]
    gs = [inp("wideg", r, (sizes[r], 3, 5), "float64") for r in range(size)]
    layer, plain = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3).double()
    x = xs[rank].clone().requires_grad_()
    layer(x).backward(gs[rank].float())
    full = torch.cat(xs).double().requires_grad_()
    yf = plain(full)
    yf.backward(torch.cat(gs))
    mine = slice(start, start + sizes[rank])
    torch.testing.assert_close(layer(xs[rank]).double(), yf.detach()[mine], rtol=0, atol=2e-3,
                               msg="SyncBatchNorm forward, mean >> spread")
    torch.testing.assert_close(x.grad.double(), full.grad[mine], rtol=2e-3, atol=5e-3,
                               msg="SyncBatchNorm input grad, mean >> spread")
    # one value per channel over all ranks (rank 0's one row; the others none): refused alike
    layer = hvd.SyncBatchNorm(3).double()
    expect(ValueError, lambda: layer(torch.ones(1 if rank == 0 else 0, 3, dtype=torch.float64)),
           "value per channel")  # at one rank, torch's own message


def mode_elastic(rank, size):
    """hvd.elastic.run: an error every rank sees restores the last commit and retries; with a
    checkpoint directory, a restarted job resumes from the last commit."""
    directory = os.environ.get("HVD_ELASTIC_DIR")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(model, opt, checkpoint_dir=directory, epoch=0, batch=0)
    failures = []
    stop_at = int(os.environ.get("HVD_ELASTIC_STOP", "-1"))

    @hvd.elastic.run
    def train(state):
        while state.epoch < 6:
            x = inp(f"el{state.epoch}", rank, (4, 3), "float32", -1, 1)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            for p in model.parameters():
                hvd.allreduce_(p.grad)
            opt.step()
            if state.epoch == 3 and not failures:
                failures.append(1)  # every rank disagrees on a shape once: a MismatchError
                hvd.allreduce(torch.zeros(1 + rank))
            state.epoch += 1
            state.commit()
            if state.epoch == stop_at:
                return "stopped"
        return "done"

    result = train(state)
    # ElasticSampler: this rank's share of a shuffled epoch, minus what was processed
    sampler = hvd.elastic.ElasticSampler(list(range(23)), shuffle=True, seed=3)
    sampler.set_epoch(2)
    shares = hvd.allgather_object(list(sampler))
    assert set(sum(shares, [])) == set(range(23)) and len({len(x) for x in shares}) == 1
    sampler.record_batch(0, 2)
    sampler.reset()
    left = set(sum(hvd.allgather_object(list(sampler)), []))
    assert len(left) == 23 - 2 * size and not left & set(sum([x[:2] for x in shares], []))
    weights = model.weight.detach().numpy().tobytes()
    assert hvd.allgather_object(weights) == [weights] * size
    if rank == 0:
        print(f"elastic result={result} epoch={state.epoch} commits={state.commits} "
              f"failures={len(failures)} weight={model.weight.detach().numpy().ravel().tolist()}",
              flush=True)
    return 0


MODES = {"api": mode_api, "grouped": mode_grouped, "process_sets": mode_process_sets,
         "autograd": mode_autograd, "join": mode_join, "state": mode_state,
         "sync_batch_norm": mode_sync_batch_norm, "elastic": mode_elastic}
ALONE = ("process_sets", "elastic")  # each needs an init of its own: one job each
_init_sets = None


def main():
    """``process_sets`` and ``elastic`` run alone (each needs its own init); any other modes,
    given together, run in one job one after another, each reported on its own line by
    ``checks.run_checks`` (one interpreter start instead of one a mode)."""
    global _init_sets
    modes = sys.argv[1:]
    if modes == ["process_sets"]:
        world = MPI.COMM_WORLD
        even = hvd.ProcessSet(range(0, world.Get_size(), 2))
        split = world.Split(world.Get_rank() // 2, world.Get_rank())  # pairs
        from_comm = hvd.ProcessSet(split)
        hvd.init(process_sets=[even, from_comm])
        _init_sets = (even, from_comm)
    elif modes == ["elastic"]:
        hvd.init()
    else:
        unknown = (set(modes) - set(MODES)) | (set(modes) & set(ALONE))
        if unknown:
            raise SystemExit(f"modes {sorted(unknown)} cannot run here; valid: "
                             + ", ".join(sorted(set(MODES) - set(ALONE))))
        hvd.init()
        failures = run_checks({m: MODES[m] for m in modes}, argv=[])
        hvd.barrier()
        return 1 if failures else 0
    rank, size = hvd.rank(), hvd.size()
    MODES[modes[0]](rank, size)
    hvd.barrier()
    if rank == 0:
        print(f"horovod {modes[0]} OK on {size} ranks", flush=True)


if __name__ == "__main__":
    sys.exit(main())
