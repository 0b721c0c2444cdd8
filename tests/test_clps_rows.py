"""C_LP_S on the codecs' row forms against the per-partition loop it replaced, bit for bit.

``lowprec`` compresses the n partitions of a segment with one ``Codec.compress_rows`` and
decodes the n gathered partitions with one ``Codec.decompress_rows`` (one kernel launch each on
a GPU, where it made n), the segment's uneven tail read as zeros where it used to be copied
into a zero-padded buffer. Here: the row forms equal the codecs' per-partition calls on padded
copies, and the whole exchange equals the old loop's, for n = 1..4 ranks run as threads of one
process (an in-process wire with real alltoall/allgather semantics). The
kernels' own checks, host and simulated device, are ``tests/kernels/test_rows.py`` and
``tests/kernels/sim_kernels.py``; the device path under MPI is ``tests/mpi/gpu_device_suite.py``.
"""
import threading

import numpy as np
import pytest

import numba_kernels as nk
from bagua_mpi import transport
from bagua_mpi.accounting import WireStats
from bagua_mpi.primitives import lowprec
from bagua_mpi.primitives.codecs import MinMaxCodec, OneBitCodec, QSGDCodec, call_seed

CODECS = [MinMaxCodec(8, 64), MinMaxCodec(3, 96), QSGDCodec(127, 32), QSGDCodec(7, 100),
          OneBitCodec(64), OneBitCodec(96, "mean_abs")]


def zero_padded(x, n):
    """x followed by zeros to n equal partitions (what C_LP_S copied an uneven segment into)."""
    part = lowprec.partition_length(x.size, n)
    return np.concatenate([x, np.zeros(part * n - x.size, x.dtype)]), part


def partition_loop(codec, x, mat, cols, residual, seed, rank, phase):
    """Partition k of x, zero-padded, compressed on its own into mat[k, cols], every k."""
    n = mat.shape[0]
    padded, part = zero_padded(x, n)
    for k in range(n):
        codec.compress(padded[k * part:(k + 1) * part], mat[k, cols],
                       residual=None if residual is None else residual[k * part:(k + 1) * part],
                       seed=call_seed(seed, rank, k, phase))


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("ef", [False, True], ids=["plain", "error-feedback"])
def test_codec_row_forms_are_the_per_partition_calls(codec, n, ef):
    """Also for lengths n does not divide (short by 1 to n - 1, down to partitions wholly in
    the padding): the row form reads past the tensor's end as the zeros the loop padded with,
    and decodes only up to the end."""
    rng = np.random.default_rng([n, int(ef)])
    for length in sorted({1, 5, 45 * n, 45 * n - 1, 45 * n - n + 1, 1000 * n - 1}):
        x = rng.standard_normal(length).astype(np.float32)
        part = lowprec.partition_length(length, n)
        e = (rng.standard_normal(n * part) * 0.1).astype(np.float32) if ef else None
        nbytes = codec.format(part).nbytes
        cols = slice(16, 16 + nbytes)          # after another segment's payload
        mats, errs = [], []
        for compress_rows in (partition_loop, type(codec).compress_rows):
            mat = np.full((n, 16 + nbytes + 8), 0x5A, np.uint8)
            err = None if e is None else e.copy()
            compress_rows(codec, x.copy(), mat, cols, residual=err, seed=77, rank=n - 1, phase=1)
            mats.append(mat)
            errs.append(err)
        assert np.array_equal(mats[0], mats[1]), (codec, n, length)
        if ef:
            assert np.array_equal(errs[0], errs[1]), (codec, n, length)
        want = np.empty(n * part, np.float32)
        for k in range(n):
            codec.decompress_many(np.ascontiguousarray(mats[0][k:k + 1, cols]), part,
                                  out=want[k * part:(k + 1) * part])
        got = np.full(length + 1, np.nan, np.float32)
        codec.decompress_rows(mats[1], cols, part, out=got[:length])
        assert np.array_equal(got[:length], want[:length]), (codec, n, length)
        assert np.isnan(got[length])           # nothing written past the tensor's end


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_codec_decompress_many_reads_the_columns_in_place(codec):
    """C_LP_S's server decode: ``decompress_many(recv, part, cols=plan.cols)`` is the decode of
    the contiguous copy of those columns that it used to make, with and without accumulate."""
    rng = np.random.default_rng(3)
    n, part = 3, 45
    nbytes = codec.format(part).nbytes
    cols = slice(16, 16 + nbytes)
    mat = rng.integers(0, 256, (n, 16 + nbytes + 8), dtype=np.uint8)
    codec.compress_rows(rng.standard_normal(n * part).astype(np.float32), mat, cols, seed=4)
    copy = np.ascontiguousarray(mat[:, cols])
    for accumulate in (False, True):
        base = rng.standard_normal(part).astype(np.float32)
        want, got = base.copy(), base.copy()
        codec.decompress_many(copy, part, out=want, accumulate=accumulate)
        assert codec.decompress_many(mat, part, out=got, accumulate=accumulate, cols=cols) is got
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_kernels_row_seed_is_call_seed():
    rng = np.random.default_rng(5)
    for words in [(0, 0, 0, 1), (123, 7, 3, 2), (2**31 - 1, 1023, 1022, 1)] + \
            [tuple(int(v) for v in rng.integers(0, 2**31, 4)) for _ in range(100)]:
        assert nk.row_seed(*words) == call_seed(*words)


class ThreadWire(transport.Transport):
    """Rank ``rank`` of n ranks run as threads: alltoall and allgather through shared slots."""

    def __init__(self, slots, barrier, rank):
        self.slots, self.barrier = slots, barrier
        self.rank, self.size, self.backend = rank, len(slots), "threads"

    def _everyones(self, buf):
        self.slots[self.rank] = np.array(buf, copy=True)
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def alltoall(self, send, recv, *, dense=False):
        for j, theirs in enumerate(self._everyones(send)):
            recv[j] = theirs[self.rank]

    def allgather(self, send, recv, *, dense=False):
        for j, theirs in enumerate(self._everyones(send)):
            recv[j] = theirs


def per_partition_clps(xs, wes, ses, codecs, seeds, wire, scale, stats):
    """C_LP_S as ``lowprec._clps_arrays`` made it before the row forms (host arrays)."""
    n, rank = wire.size, wire.rank
    plans, row = lowprec._plans(xs, wes, ses, codecs, seeds, n)
    padded = [zero_padded(plan.x, n)[0] for plan in plans]
    send = np.empty((n, row), np.uint8)
    for plan, xp in zip(plans, padded):
        we, part = plan.worker_error, plan.part
        for k in range(n):
            plan.codec.compress(xp[k * part:(k + 1) * part], send[k, plan.cols],
                                residual=None if we is None else we[k * part:(k + 1) * part],
                                seed=call_seed(plan.seed, rank, k, 1))
    recv = np.empty((n, row), np.uint8)
    wire.alltoall(send, recv)
    mine = np.empty(row, np.uint8)
    for plan in plans:
        # the server's decode of a contiguous copy of the segment's columns (C_LP_S now reads
        # them in place: Codec.decompress_many(recv, ..., cols=plan.cols))
        merged = plan.codec.decompress_many(np.ascontiguousarray(recv[:, plan.cols]), plan.part,
                                            out=np.empty(plan.part, np.float32))
        if scale != 1.0:
            merged *= np.float32(scale)
        plan.codec.compress(merged, mine[plan.cols], residual=plan.server_error,
                            seed=call_seed(plan.seed, rank, rank, 2))
    wire.allgather(mine, send)
    for plan, xp in zip(plans, padded):
        part = plan.part
        for k in range(n):
            plan.codec.decompress_many(np.ascontiguousarray(send[k:k + 1, plan.cols]), part,
                                       out=xp[k * part:(k + 1) * part])
        plan.x[:] = xp[:plan.x.size]
    stats.add(2 * (n - 1) * row)


def _run_ranks(n, fn):
    slots, barrier = [None] * n, threading.Barrier(n)
    errors = []

    def rank_main(r):
        try:
            fn(ThreadWire(slots, barrier, r))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_packed_clps_equals_the_per_partition_loop(n):
    # uneven lengths (padding), codecs of every kind packed in one exchange, error feedback on
    # some, chunks longer than a segment on one
    layers = [(300, MinMaxCodec(8, 64), True), (37, QSGDCodec(127, 16), False),
              (256, OneBitCodec(64), True), (90, MinMaxCodec(4, 32), False),
              (9000, OneBitCodec(8192), True), (1, QSGDCodec(5, 32), True)]
    results = {}
    for name, clps in (("rows", lowprec._clps_arrays), ("loop", per_partition_clps)):
        state = {r: {j: [np.zeros(lowprec.padded_length(m, n), np.float32),
                         np.zeros(lowprec.partition_length(m, n), np.float32)]
                     for j, (m, _, ef) in enumerate(layers) if ef} for r in range(n)}
        out = {}

        def rank(wire, clps=clps, state=state, out=out):
            r = wire.rank
            for step in range(2):
                rng = np.random.default_rng([step, r, 11])
                xs = [(rng.standard_normal(m) * (1 + r)).astype(np.float32) for m, _, _ in layers]
                wes = [state[r][j][0] if j in state[r] else None for j in range(len(layers))]
                ses = [state[r][j][1] if j in state[r] else None for j in range(len(layers))]
                stats = WireStats()
                args = (xs, wes, ses, [c for _, c, _ in layers],
                        [step * 10 + j for j in range(len(layers))], wire, 1.0 / n, stats)
                if clps is lowprec._clps_arrays:
                    clps(*args, False)
                else:
                    clps(*args)
                out[r, step] = ([x.copy() for x in xs], stats.bytes_sent)
            out[r, "errors"] = [a.copy() for j in sorted(state[r]) for a in state[r][j]]

        _run_ranks(n, rank)
        results[name] = out
    for key, value in results["loop"].items():
        got = results["rows"][key]
        if key[1] == "errors":
            assert all(np.array_equal(a, b) for a, b in zip(got, value)), key
        else:
            assert got[1] == value[1], key
            assert all(np.array_equal(a, b) for a, b in zip(got[0], value[0])), key


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("common", [True, False], ids=["common-memory", "own-memories"])
def test_a_kept_plan_runs_as_a_call_each_step(n, common):
    """A ``CompressedExchange`` planned once and run for several steps, its tensors and error
    memories rewritten in place between them, gives the bytes a ``packed_compressed_allreduce_``
    of each step gives (a bucket's min-max layers at their own widths in common memory: the
    together route; or each tensor in its own memory with mixed codecs: one by one)."""
    import torch
    if common:
        lengths, codecs = [300, 37, 1030, 5], [MinMaxCodec(b, 64) for b in (8, 2, 4, 6)]
    else:
        lengths, codecs = [300, 37, 90], [MinMaxCodec(8, 64), QSGDCodec(127, 16),
                                          OneBitCodec(64)]

    def memories():
        """(tensors, worker errors, server errors): slices of one buffer each, or their own."""
        sizes = [lengths, [lowprec.padded_length(m, n) for m in lengths],
                 [lowprec.partition_length(m, n) for m in lengths]]
        if not common:
            return [[torch.zeros(m) for m in kind] for kind in sizes]
        return [list(torch.zeros(sum(kind)).split(kind)) for kind in sizes]

    results = {}
    for route in ("kept", "calls"):
        out = {}

        def rank(wire, route=route, out=out):
            xs, wes, ses = memories()
            segments = [lowprec.Segment(x, c, w, s, seed=j)
                        for j, (x, c, w, s) in enumerate(zip(xs, codecs, wes, ses))]
            plan = lowprec.CompressedExchange(segments, n) if route == "kept" else None
            if plan is not None:
                assert isinstance(plan.steps, lowprec._Together if common
                                  else lowprec._OneByOne), plan.steps
            for step in range(3):
                rng = np.random.default_rng([step, wire.rank, 5])
                for x in xs:
                    x.copy_(torch.from_numpy(rng.standard_normal(x.numel()).astype(np.float32)))
                stats = WireStats()
                if plan is not None:
                    plan.run(wire, scale=1.0 / n, stats=stats)
                else:
                    lowprec.packed_compressed_allreduce_(segments, wire, scale=1.0 / n,
                                                         stats=stats)
                out[wire.rank, step] = ([t.clone() for t in xs + wes + ses], stats.bytes_sent)

        _run_ranks(n, rank)
        results[route] = out
    for key, (tensors, sent) in results["calls"].items():
        got, got_sent = results["kept"][key]
        assert got_sent == sent, key
        assert all(torch.equal(a, b) for a, b in zip(got, tensors)), key


def test_a_plan_refuses_a_communicator_of_another_size():
    import torch
    plan = lowprec.CompressedExchange([lowprec.Segment(torch.zeros(10), MinMaxCodec(8, 64))], 2)
    with pytest.raises(ValueError, match="planned for 2 ranks, and the communicator has 1"):
        _run_ranks(1, lambda wire: plan.run(wire))
