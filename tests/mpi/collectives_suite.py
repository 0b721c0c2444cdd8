"""Every collective x dtype x op x size, against a NumPy simulation of all ranks.

Run by every rank under mpiexec (see tests/test_collectives_mpi.py): ``checks.run_suite`` runs
every ``check_*`` function below (or those named by ``--check``) and reports each on its own line.
"""
import collections
import sys
import zlib

import numpy as np
import torch

import bagua_mpi as bm
from bagua_mpi import backends, process_groups, transport
from checks import run_suite
from simulate import ALL_DTYPES, FLOATS, assert_same, rank_input, reduce_all

SEED = 20261121
OPS = {"average": bm.Average, "sum": bm.Sum, "min": bm.Min, "max": bm.Max,
       "product": bm.Product}
SIZES = {"empty": (0,), "one": (1,), "large": (100_003,), "matrix": (7, 33)}


def valid(op: str, dtype: str) -> bool:
    if dtype == "bool":
        return op in ("min", "max", "product")
    return op != "average" or dtype in FLOATS


def check_allreduce(rank, size, counts):
    for dtype in ALL_DTYPES:
        for op_name, op in OPS.items():
            if not valid(op_name, dtype):
                continue
            for size_name, shape in SIZES.items():
                seed = SEED + zlib.crc32(f"{dtype}/{op_name}/{size_name}".encode()) % 1000
                inputs = [rank_input(seed, r, shape, dtype, op_name) for r in range(size)]
                expected = reduce_all(inputs, op_name)
                what = f"allreduce {op_name} {dtype} {size_name}"
                mine = inputs[rank].clone()
                assert_same(bm.allreduce(mine, op), expected, what)
                assert torch.equal(mine, inputs[rank]), f"{what}: input modified"
                assert_same(bm.allreduce_(mine, op), expected, what + " in place")
                mine = inputs[rank].clone()  # check off: the latency fast path where it applies
                assert_same(bm.allreduce_(mine, op, check=False), expected,
                            what + " in place, unchecked")
                h = bm.allreduce_async(inputs[rank], op)
                assert_same(bm.synchronize(h), expected, what + " async")
                mine = inputs[rank].clone()
                assert bm.synchronize(bm.allreduce_async_(mine, op)) is mine
                assert_same(mine, expected, what + " async in place")
                counts["allreduce"] += 5


def check_scaling_and_numpy(rank, size, counts):
    for dtype in FLOATS:
        inputs = [rank_input(SEED, r, (257,), dtype) for r in range(size)]
        expected = reduce_all(inputs, "average", prescale=0.5, postscale=3.0)
        got = bm.allreduce(inputs[rank], bm.Average, prescale_factor=0.5, postscale_factor=3.0)
        assert_same(got, expected, f"pre/postscale {dtype}")
        counts["scaling"] += 1
    # NumPy arrays in, NumPy arrays out (no bfloat16 in NumPy); non-contiguous inputs too.
    for dtype in ("float16", "float32", "float64", "int32", "int64", "uint8"):
        inputs = [rank_input(SEED, r, (6, 10), dtype) for r in range(size)]
        expected = reduce_all(inputs, "sum")
        arr = inputs[rank].numpy()
        got = bm.allreduce(arr, bm.Sum)
        assert isinstance(got, np.ndarray) and got.dtype == arr.dtype
        assert_same(torch.from_numpy(got), expected, f"numpy allreduce {dtype}")
        strided = np.ascontiguousarray(arr.T).T  # Fortran order: not C-contiguous
        bm.allreduce_(strided, bm.Sum)
        assert_same(torch.from_numpy(np.ascontiguousarray(strided)), expected,
                    f"numpy non-contiguous {dtype}")
        tt = inputs[rank].clone().t()  # non-contiguous torch view, in place
        bm.allreduce_(tt, bm.Sum)
        assert_same(tt.t(), expected, f"torch non-contiguous {dtype}")
        counts["numpy"] += 3


def check_large_outputs(rank, size, counts):
    """Outputs of >= 1 MiB are allocated through NumPy (huge pages): same results."""
    for dtype, op in (("float32", "average"), ("bfloat16", "sum"), ("bool", "max"),
                      ("uint8", "max")):
        inputs = [rank_input(SEED, r, (600_000,), dtype, op) for r in range(size)]
        got = bm.allreduce(inputs[rank], OPS[op])
        assert got.dtype == inputs[rank].dtype and got.is_contiguous()
        assert_same(got, reduce_all(inputs, op), f"large {op} {dtype}")
        gathered = bm.allgather(inputs[rank])
        assert_same(gathered, torch.cat(inputs), f"large allgather {dtype}")
        counts["large"] += 2


def check_grouped(rank, size, counts):
    dtypes = ["float32", "float16", "int64", "float32", "bfloat16"]
    shapes = [(3, 4), (5,), (2, 2), (0,), (9,)]
    inputs = [[rank_input(SEED + i, r, s, d) for i, (d, s) in enumerate(zip(dtypes, shapes))]
              for r in range(size)]
    expected = [reduce_all([inputs[r][i] for r in range(size)], "sum") for i in range(5)]
    got = bm.grouped_allreduce(inputs[rank], bm.Sum)
    for i in range(5):
        assert_same(got[i], expected[i], f"grouped {i}")
    mine = [t.clone() for t in inputs[rank]]
    bm.synchronize(bm.grouped_allreduce_async_(mine, bm.Sum))
    for i in range(5):
        assert_same(mine[i], expected[i], f"grouped async in place {i}")
    counts["grouped"] += 2


def check_data_movement(rank, size, counts):
    for dtype in ALL_DTYPES:
        # allgather: rank r contributes r+1 rows (dimension 0 differs per rank), and 0 rows too
        for rows_of in (lambda r: r + 1, lambda r: 0 if r % 2 else 3):
            inputs = [rank_input(SEED, r, (rows_of(r), 3), dtype) for r in range(size)]
            got = bm.allgather(inputs[rank])
            assert_same(got, torch.cat(inputs), f"allgather {dtype}")
            got = bm.synchronize(bm.allgather_async(inputs[rank]))
            assert_same(got, torch.cat(inputs), f"allgather async {dtype}")
        scalar = [rank_input(SEED, r, (), dtype) for r in range(size)]
        assert_same(bm.allgather(scalar[rank]), torch.stack(scalar), f"allgather 0-d {dtype}")
        # broadcast from every root (correct at any world size)
        for root in range(size):
            inputs = [rank_input(SEED + root, r, (5, 2), dtype) for r in range(size)]
            assert_same(bm.broadcast(inputs[rank], root), inputs[root], f"broadcast {dtype}")
            mine = inputs[rank].clone()
            assert bm.broadcast_(mine, root_rank=root) is mine
            assert_same(mine, inputs[root], f"broadcast_ {dtype}")
            mine = inputs[rank].clone()
            bm.synchronize(bm.broadcast_async_(mine, root))
            assert_same(mine, inputs[root], f"broadcast async {dtype}")
        # alltoall, equal parts and uneven splits (rank r sends (r + j) % 3 rows to rank j)
        inputs = [rank_input(SEED, r, (2 * size, 3), dtype) for r in range(size)]
        expected = torch.cat([inputs[r][2 * rank:2 * rank + 2] for r in range(size)])
        assert_same(bm.alltoall(inputs[rank]), expected, f"alltoall {dtype}")
        splits = [[(r + j) % 3 for j in range(size)] for r in range(size)]
        inputs = [rank_input(SEED, r, (sum(splits[r]), 2), dtype) for r in range(size)]
        pieces = []
        for r in range(size):
            start = sum(splits[r][:rank])
            pieces.append(inputs[r][start:start + splits[r][rank]])
        got, received = bm.alltoall(inputs[rank], splits[rank], return_received_splits=True)
        assert_same(got, torch.cat(pieces), f"alltoall splits {dtype}")
        assert received.tolist() == [splits[r][rank] for r in range(size)]
        counts["data"] += 6 + 3 * size
    # reducescatter: uneven rows, Sum and Average
    for dtype in ("float32", "float64", "int32", "float16", "bfloat16"):
        for op_name in ("sum", "average") if dtype in FLOATS else ("sum", "max"):
            rows = 2 * size + 1
            inputs = [rank_input(SEED, r, (rows, 4), dtype) for r in range(size)]
            full = reduce_all(inputs, op_name)
            split = bm.collectives.reducescatter_rows(rows, size)
            start = sum(split[:rank])
            got = bm.reducescatter(inputs[rank], OPS[op_name])
            assert_same(got, full[start:start + split[rank]], f"reducescatter {op_name} {dtype}")
            counts["reducescatter"] += 1


def small_ints(seed, rank, shape, dtype: str) -> torch.Tensor:
    """Rank ``rank``'s integers of a dtype ``rank_input`` has no case for (int8, int16): 1-3,
    so a product over four ranks stays in int8."""
    values = np.random.default_rng([seed, rank]).integers(1, 4, size=shape)
    return torch.from_numpy(values.astype(dtype))


def inputs_of(seed, size, shape, dtype: str, op: str = "sum") -> list:
    make = small_ints if dtype in ("int8", "int16") else rank_input
    return [make(seed, r, shape, dtype, **({} if make is small_ints else {"op": op}))
            for r in range(size)]


def check_movement_wire(rank, size, counts):
    """Allgather, broadcast, alltoall and reducescatter on the wire the backend gives them: a
    process group under ``BAGUA_MPI_BACKEND=gloo`` (the code NCCL runs for CUDA tensors),
    else MPI; strided inputs, uneven rows (none on some ranks), grouped and asynchronous
    forms, every op, and the dtypes and ops the libraries cannot reduce (16-bit integers,
    bool), which stay on MPI. Each call's carriers (``transport.carried``) are checked, and
    its result against every rank's input."""
    group = {"gloo"} if backends.resolve() == "gloo" else set()
    # one rank: a broadcast or reduce-scatter is the transport's own copy, no library call
    reducing = group if size > 1 else set()

    def on(expected: set, what: str, call):
        before = collections.Counter(transport.carried)
        result = call()
        used = set(transport.carried - before)
        assert used == expected, f"{what}: carried by {used or 'MPI'}, expected {expected}"
        counts[what.split()[0]] += 1
        return result

    for dtype in ("float32", "bfloat16", "bool", "int8", "int16"):
        # allgather of strided rows: rank r has r rows (rank 0 none), or all the same count
        for rows_of in (lambda r: r, lambda r: 2):
            everyone = [inputs_of(SEED, size, (3, rows_of(r)), dtype)[r].t()
                        for r in range(size)]
            assert not everyone[rank].is_contiguous() or rows_of(rank) <= 1
            moved = group if sum(rows_of(r) for r in range(size)) else set()  # else no call
            got = on(moved, f"allgather {dtype}", lambda: bm.allgather(everyone[rank]))
            assert_same(got, torch.cat(everyone), f"allgather strided {dtype}")
        pair = [inputs_of(SEED + k, size, (rank + k, 2), dtype)[rank] for k in (1, 2)]
        got = on(group, f"grouped_allgather {dtype}", lambda: bm.grouped_allgather(pair))
        for k, g in zip((1, 2), got):
            want = torch.cat([inputs_of(SEED + k, size, (r + k, 2), dtype)[r]
                              for r in range(size)])
            assert_same(g, want, f"grouped_allgather {dtype} {k}")
        # broadcast into a strided view, in place and asynchronously
        for root in range(size):
            inputs = inputs_of(SEED + root, size, (2, 5), dtype)
            mine = inputs[rank].new_empty((5, 2)).t().copy_(inputs[rank])  # strided
            assert not mine.is_contiguous()
            on(reducing, f"broadcast_ {dtype}", lambda: bm.broadcast_(mine, root))
            assert_same(mine, inputs[root], f"broadcast_ strided {dtype}")
            got = on(reducing, f"broadcast_async {dtype}",
                     lambda: bm.synchronize(bm.broadcast_async(inputs[rank], root)))
            assert_same(got, inputs[root], f"broadcast_async {dtype}")
        # alltoall of strided rows: rank r sends (r * (j + 1)) % 3 rows to rank j (rank 0
        # none; what a rank sends differs from what it receives)
        splits = [[(r * (j + 1)) % 3 for j in range(size)] for r in range(size)]
        sent = [inputs_of(SEED, size, (2, sum(splits[r])), dtype)[r].t() for r in range(size)]
        pieces = [sent[r][sum(splits[r][:rank]):sum(splits[r][:rank + 1])] for r in range(size)]
        got, received = on(group, f"alltoall {dtype}",
                           lambda: bm.synchronize(bm.alltoall_async(sent[rank], splits[rank])))
        assert_same(got, torch.cat(pieces), f"alltoall strided {dtype}")
        assert received.tolist() == [splits[r][rank] for r in range(size)], received
    grouped_allgather_in_one_exchange(rank, size, group, counts)
    # reducescatter: rows more than, fewer than, and a multiple of the ranks
    for rows in (2 * size + 1, size - 1, 3 * size):
        split = bm.collectives.reducescatter_rows(rows, size)
        mine = slice(sum(split[:rank]), sum(split[:rank + 1]))
        for dtype in ("float32", "float64", "float16", "int32", "int64", "uint8", "int8",
                      "int16", "bool"):
            for op_name, op in OPS.items():
                if not valid(op_name, dtype) or (dtype == "int16" and op_name == "product"):
                    continue
                inputs = inputs_of(SEED + rows, size, (rows, 3), dtype, op_name)
                full = reduce_all(inputs, op_name)
                wire = set() if dtype in ("int16", "bool") or rows == 0 else reducing
                strided = inputs[rank].t().contiguous().t()
                got = on(wire, f"reducescatter {op_name} {dtype}",
                         lambda: bm.reducescatter(strided, op))
                assert_same(got, full[mine], f"reducescatter {op_name} {dtype} {rows} rows")
        pair = [inputs_of(SEED + k, size, (rows, 2), "float32")[rank] for k in (1, 2)]
        got = on(reducing if rows else set(), "grouped_reducescatter",
                 lambda: bm.synchronize(bm.grouped_reducescatter_async(pair, op=bm.Sum)))
        for k, g in zip((1, 2), got):
            full = reduce_all(inputs_of(SEED + k, size, (rows, 2), "float32"), "sum")
            assert_same(g, full[mine], f"grouped_reducescatter {rows} rows {k}")
    grouped_reducescatter_in_one_exchange(rank, size, group, counts)
    if size >= 3:
        on_process_set(rank, size, group, on, counts)


def grouped_reducescatter_in_one_exchange(rank, size, group: set, counts):
    """Tensors of one wire dtype (float32, and float16 reduced in float32) with their own row
    counts (fewer rows than ranks among them) and shapes, Average with pre- and postscaling:
    one library call on a process group, each tensor's rows right; a group whose wire dtypes
    differ (int32 beside float32) is one call per tensor."""
    def calls_of(call):
        before = collections.Counter(transport.carried)
        result = call()
        return result, dict(transport.carried - before)

    one = {"gloo": 1} if group and size > 1 else {}  # one rank: the transport's own copy
    shapes, dtypes = [(2 * size + 1, 3), (size - 1, 2), (3 * size,)], ["float32", "float16",
                                                                       "float32"]
    inputs = [inputs_of(SEED + 20 + i, size, s, d) for i, (s, d) in enumerate(zip(shapes,
                                                                                  dtypes))]
    got, calls = calls_of(lambda: bm.grouped_reducescatter(
        [x[rank] for x in inputs], op=bm.Average, prescale_factor=0.5, postscale_factor=3.0))
    assert calls == one, f"grouped reducescatter of one wire dtype: {calls}"
    for i, (g, x) in enumerate(zip(got, inputs)):
        split = bm.collectives.reducescatter_rows(shapes[i][0], size)
        want = reduce_all(x, "average", prescale=0.5, postscale=3.0)
        assert_same(g, want[sum(split[:rank]):sum(split[:rank + 1])],
                    f"packed grouped reducescatter, tensor {i}")
    mixed = [inputs[0], inputs_of(SEED + 30, size, (size + 1, 2), "int32")]
    got, calls = calls_of(lambda: bm.grouped_reducescatter([x[rank] for x in mixed], op=bm.Sum))
    assert calls == {k: 2 for k in one}, f"grouped reducescatter of two wire dtypes: {calls}"
    for i, (g, x) in enumerate(zip(got, mixed)):
        split = bm.collectives.reducescatter_rows(x[0].shape[0], size)
        assert_same(g, reduce_all(x, "sum")[sum(split[:rank]):sum(split[:rank + 1])],
                    f"grouped reducescatter of mixed wire dtypes, tensor {i}")
    counts["grouped_reducescatter"] += 2


def grouped_allgather_in_one_exchange(rank, size, group: set, counts):
    """A group of mixed dtypes, shapes and row counts (none on some ranks, a 0-d tensor, a
    strided one) travels as one message per rank, each tensor cut out again aligned for its
    dtype: one library call on a process group; NumPy arrays come back as NumPy arrays; a
    group mixing kinds is gathered tensor by tensor."""
    def tensors_of(r):
        return [inputs_of(SEED + 7, size, (r + 1, 3), "float64")[r],
                inputs_of(SEED + 8, size, (r % 2, 5), "bool")[r],
                inputs_of(SEED + 9, size, (2, r + 1), "int8")[r].t(),
                inputs_of(SEED + 10, size, (), "bfloat16")[r],
                inputs_of(SEED + 11, size, (r,), "float16")[r]]

    def expected(i):
        return torch.cat([tensors_of(r)[i].reshape((-1,) + tuple(tensors_of(r)[i].shape[1:]))
                          for r in range(size)])

    before = collections.Counter(transport.carried)
    got = bm.grouped_allgather(tensors_of(rank))
    calls = dict(transport.carried - before)
    assert calls == ({"gloo": 1} if group else {}), f"grouped allgather: {calls}"
    for i, g in enumerate(got):
        assert_same(g, expected(i), f"grouped allgather of mixed dtypes, tensor {i}")
    as_arrays = (0, 1, 4)  # the dtypes NumPy arrays may have (not int8, not bfloat16)
    got = bm.grouped_allgather([tensors_of(rank)[i].numpy() for i in as_arrays])
    assert all(isinstance(g, np.ndarray) for g in got), [type(g) for g in got]
    for i, g in zip(as_arrays, got):
        assert_same(torch.from_numpy(g), expected(i), f"grouped allgather of arrays, {i}")
    got = bm.grouped_allgather([tensors_of(rank)[0], tensors_of(rank)[1].numpy()])
    assert isinstance(got[1], np.ndarray)
    assert_same(got[0], expected(0), "grouped allgather of mixed kinds, tensor")
    assert_same(torch.from_numpy(got[1]), expected(1), "grouped allgather of mixed kinds, array")
    counts["grouped_allgather"] += 3


def on_process_set(rank, size, group: set, on, counts):
    """The same four on a process set of ranks 1..size-1 (set ranks differ from global ones):
    a group over the set's communicator; removing the set drops that group."""
    members = list(range(1, size))
    groups_before = len(process_groups.groups())
    ps = bm.add_process_set(members)
    if rank in members:
        me, n = members.index(rank), len(members)
        inputs = {r: inputs_of(SEED, size, (r, 3), "float32")[r] for r in members}
        got = on(group, "allgather set", lambda: bm.allgather(inputs[rank], process_set=ps))
        assert_same(got, torch.cat([inputs[r] for r in members]), "allgather on a set")
        root = members[-1]  # a global rank
        mine = inputs[root].clone() if rank == root else torch.zeros_like(inputs[root])
        got = on(group, "broadcast set", lambda: bm.broadcast(mine, root, process_set=ps))
        assert_same(got, inputs[root], "broadcast on a set")

        def sent_by(m):  # set rank m's splits and rows: what it sends differs from what it gets
            splits = [(m * (j + 1) + 1) % 3 for j in range(n)]
            return splits, torch.arange(sum(splits) * 2.0).reshape(-1, 2) + 100 * m

        splits, sent = sent_by(me)
        got, received = on(group, "alltoall set",
                           lambda: bm.alltoall(sent, splits, process_set=ps))
        assert received.tolist() == [sent_by(j)[0][me] for j in range(n)], received
        want = torch.cat([sent_by(j)[1][sum(sent_by(j)[0][:me]):][:sent_by(j)[0][me]]
                          for j in range(n)])
        assert_same(got, want, "alltoall on a set")
        tall = inputs_of(SEED + 1, size, (2 * n + 1, 3), "float64")
        full = reduce_all([tall[r] for r in members], "sum")
        split = bm.collectives.reducescatter_rows(2 * n + 1, n)
        got = on(group, "reducescatter set",
                 lambda: bm.reducescatter(tall[rank], op=bm.Sum, process_set=ps))
        assert_same(got, full[sum(split[:me]):sum(split[:me + 1])], "reducescatter on a set")
    else:  # rank 0 is no member: its cases are the others' four (the suite compares counts)
        for what in ("allgather", "broadcast", "alltoall", "reducescatter"):
            counts[what] += 1
    assert bm.remove_process_set(ps)
    assert len(process_groups.groups()) == groups_before, "the set's group outlived it"


def complex_input(rank, shape, salt=0):
    g = np.random.default_rng([SEED, salt, rank])
    return torch.from_numpy((g.standard_normal(shape) + 1j * g.standard_normal(shape))
                            .astype(np.complex64))


def check_complex(rank, size, counts):
    """Complex tensors (sent as their real views) against NumPy's complex arithmetic over every
    rank's input; in-place and asynchronous forms hand back the caller's complex tensor; the
    reductions that are not sums are refused by name; allreduce's gradient flows."""
    close = dict(rtol=1e-5, atol=1e-5)
    inputs = [complex_input(r, (7, 3)) for r in range(size)]
    total = torch.from_numpy(np.sum([t.numpy() for t in inputs], axis=0))
    for op, want in ((bm.Sum, total), (bm.Average, total / size)):
        torch.testing.assert_close(bm.allreduce(inputs[rank], op=op), want, **close)
        mine = inputs[rank].clone()
        assert bm.allreduce_(mine, op=op) is mine
        torch.testing.assert_close(mine, want, **close)
        got = bm.synchronize(bm.allreduce_async(inputs[rank], op=op))
        assert got.dtype == torch.complex64, got.dtype
        torch.testing.assert_close(got, want, **close)
        mine = inputs[rank].clone()
        assert bm.synchronize(bm.allreduce_async_(mine, op=op)) is mine
        torch.testing.assert_close(mine, want, **close)
    torch.testing.assert_close(bm.allreduce(inputs[rank], bm.Sum), total, **close)  # positional
    real = [torch.full((2,), float(r + 1)) for r in range(size)]
    got = bm.grouped_allreduce([inputs[rank], real[rank]], op=bm.Sum)
    torch.testing.assert_close(got[0], total, **close)
    torch.testing.assert_close(got[1], torch.full((2,), size * (size + 1) / 2))
    for op in (bm.Max, bm.Min, bm.Product, bm.Adasum):
        for call in (lambda: bm.allreduce(inputs[rank], op=op),
                     lambda: bm.allreduce_(inputs[rank].clone(), op=op),
                     lambda: bm.reducescatter(inputs[rank], op=op)):
            try:
                call()
            except TypeError as e:
                assert f"not reduced with {op.name}" in str(e), e
            else:
                raise AssertionError(f"complex {op.name} was not refused")
    rows = [complex_input(r, (r + 1, 2), salt=1) for r in range(size)]
    assert torch.equal(bm.allgather(rows[rank]), torch.cat(rows))
    assert torch.equal(bm.synchronize(bm.allgather_async(rows[rank])), torch.cat(rows))
    for root in range(size):
        assert torch.equal(bm.broadcast(inputs[rank], root), inputs[root])
        mine = inputs[rank].clone()
        assert bm.broadcast_(mine, root) is mine and torch.equal(mine, inputs[root])
        mine = inputs[rank].clone()
        assert bm.synchronize(bm.broadcast_async_(mine, root)) is mine
        assert torch.equal(mine, inputs[root])
    splits = [[(r + j) % 3 for j in range(size)] for r in range(size)]
    sent = [complex_input(r, (sum(splits[r]), 2), salt=2) for r in range(size)]
    pieces = [sent[r][sum(splits[r][:rank]):sum(splits[r][:rank + 1])] for r in range(size)]
    got, received = bm.alltoall(sent[rank], splits[rank])
    assert torch.equal(got, torch.cat(pieces)) and received.tolist() == [
        splits[r][rank] for r in range(size)]
    tall = [complex_input(r, (2 * size + 1, 2), salt=3) for r in range(size)]
    full = torch.from_numpy(np.sum([t.numpy() for t in tall], axis=0))
    split = bm.collectives.reducescatter_rows(2 * size + 1, size)
    start = sum(split[:rank])
    torch.testing.assert_close(bm.reducescatter(tall[rank], op=bm.Sum),
                               full[start:start + split[rank]], **close)
    # the gradient of a Sum allreduce is the Sum allreduce of the gradients (the same on
    # every rank here): torch's own gradient of the loss times the number of ranks
    c = torch.tensor(0.5 - 2j, dtype=torch.complex64)
    x = inputs[rank].clone().requires_grad_(True)
    (bm.allreduce(x, op=bm.Sum) * c).real.sum().backward()
    y = total.clone().requires_grad_(True)
    (y * c).real.sum().backward()
    torch.testing.assert_close(x.grad, size * y.grad, **close)
    counts["complex"] += 24 + 3 * size


def check_objects(rank, size, counts):
    assert bm.allgather_object({"rank": rank}) == [{"rank": r} for r in range(size)]
    for root in range(size):
        assert bm.broadcast_object(("from", rank), root) == ("from", root)
    bm.barrier()
    counts["objects"] += 2 + size


def counted(check):
    """``check`` as one of the suite's checks: it counts the cases it ran, and every rank must
    have run as many (a rank that skipped some would differ here)."""
    def run(rank, size):
        counts = collections.Counter()
        check(rank, size, counts)
        assert counts and all(counts.values()), f"{check.__name__} ran no case: {counts}"
        assert bm.allgather_object(dict(counts)) == [dict(counts)] * size, "ranks ran apart"
    return run


# every check_ function above, by name (``allreduce``, ``data-movement``, ...)
CHECKS = {name.removeprefix("check_").replace("_", "-"): counted(fn)
          for name, fn in list(globals().items()) if name.startswith("check_")}


if __name__ == "__main__":
    sys.exit(run_suite(CHECKS))
