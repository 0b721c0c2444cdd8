"""BAGUA's primitives against a NumPy simulation of every rank.

``python primitives_suite.py [--check NAME]`` on every rank; each check reports its own line.

Each rank builds every rank's input from a seed, runs the primitive for real, and compares with
a single-process simulation of the same algorithm that uses the same compressor functions,
so compressed results must match exactly (same bytes in, same bytes out).
"""
import sys

import numpy as np
import torch

import bagua_mpi as bm
from bagua_mpi.primitives import (MinMaxCodec, OneBitCodec, PeerEstimates, QSGDCodec, Segment,
                                  cast_allreduce_, compressed_allreduce_, decentralized_average_,
                                  low_precision_decentralized_, packed_compressed_allreduce_,
                                  padded_length, partition_length,
                                  peers_for, random_pairing)
from bagua_mpi.algorithms import AlgorithmContext, AlgorithmImpl
from bagua_mpi.primitives.codecs import call_seed
from bagua_mpi.primitives.lowprec import compressed_reduce_scatter_
from checks import run_suite
from dispatch_count import ArraysAsked, shares_memory


def inputs(seed, size, length, integer=False):
    rng = np.random.default_rng(seed)
    if integer:  # exactly representable sums: any summation order gives the same float32
        return [rng.integers(-8, 9, length).astype(np.float32) for _ in range(size)]
    return [rng.standard_normal(length).astype(np.float32) for _ in range(size)]


def simulate_clps(xs, codec, worker_errors, server_errors, scale, seed):
    """C_LP_S on all ranks at once; returns (result, new worker errors, new server errors)."""
    n, length = len(xs), xs[0].size
    part = partition_length(length, n)
    fmt = codec.format(part)
    payloads = np.empty((n, n, fmt.nbytes), np.uint8)  # [sender, partition]
    for i in range(n):
        padded = np.zeros(part * n, np.float32)
        padded[:length] = xs[i]
        for k in range(n):
            res = None if worker_errors is None else worker_errors[i][k * part:(k + 1) * part]
            codec.compress(padded[k * part:(k + 1) * part], payloads[i, k], residual=res,
                           seed=call_seed(seed, i, k, 1))
    merged_payloads = np.empty((n, fmt.nbytes), np.uint8)
    for k in range(n):
        merged = codec.decompress_many(np.ascontiguousarray(payloads[:, k]), part,
                                        out=np.empty(part, np.float32))
        merged *= np.float32(scale)
        res = None if server_errors is None else server_errors[k]
        codec.compress(merged, merged_payloads[k], residual=res, seed=call_seed(seed, k, k, 2))
    out = np.empty(part * n, np.float32)
    for k in range(n):
        codec.decompress_many(merged_payloads[k:k + 1], part, out=out[k * part:(k + 1) * part])
    return out[:length]


def check_compressed_allreduce(rank, size):
    comm = bm.runtime.get().topo.comm
    checks = 0
    for codec, ef in ((MinMaxCodec(8, 256), False), (QSGDCodec(127, 256), False),
                      (OneBitCodec(256), True), (MinMaxCodec(4, 128), True)):
        for length in (1, 257, 3000):
            part = partition_length(length, size)
            w_sim = [np.zeros(part * size, np.float32) for _ in range(size)] if ef else None
            s_sim = [np.zeros(part, np.float32) for _ in range(size)] if ef else None
            w = torch.zeros(padded_length(length, size)) if ef else None
            s = torch.zeros(part) if ef else None
            running_exact = np.zeros(length)
            running_got = np.zeros(length)
            for step in range(4):  # several steps: error feedback carries state across them
                xs = inputs([length, step, 11], size, length)
                seed = 99 + step
                expected = simulate_clps(xs, codec, w_sim, s_sim, 1.0 / size, seed)
                mine = torch.from_numpy(xs[rank].copy())
                compressed_allreduce_(mine, comm, codec, worker_error=w, server_error=s,
                                      scale=1.0 / size, seed=seed)
                what = f"C_LP_S {codec} ef={ef} n={length} step {step}"
                assert np.array_equal(mine.numpy(), expected), what
                if ef:  # this rank's error state equals the simulated one
                    assert np.array_equal(w.numpy(), w_sim[rank]), what + " worker error"
                    assert np.array_equal(s.numpy(), s_sim[rank]), what + " server error"
                exact = np.mean(xs, axis=0)
                running_exact += exact
                running_got += mine.numpy()
                if codec.name == "minmax" and codec.bits == 8 and not ef:
                    # two quantization phases of at most half a step each, per element
                    # (plus float32 rounding of the mean itself)
                    spread = max(float(np.ptp(x)) for x in xs)
                    rounding = 1e-6 * (1 + max(float(np.abs(x).max()) for x in xs))
                    assert np.max(np.abs(mine.numpy() - exact)) <= 2 * spread / 255 + rounding, what
                checks += 1
            if ef:
                # error feedback: what was lost is carried, so the running sums stay close
                # (the gap is bounded by the current errors, it does not grow with the steps)
                gap = np.abs(running_got - running_exact)
                carried = np.abs(w_sim[rank]).max() + np.abs(np.concatenate(s_sim)).max()
                assert gap.max() <= size * (carried + 1e-3) + 1e-3, (codec, gap.max(), carried)
    return checks


def check_compressed_reduce_scatter(rank, size):
    """The first half of C_LP_S (ZeRO stage 2's exchange) at lengths the ranks do not divide:
    this rank's reduced partition, and its worker error, against every rank's payloads made
    from zero-padded copies in one process."""
    comm = bm.runtime.get().topo.comm
    checks = 0
    for codec in (MinMaxCodec(8, 64), QSGDCodec(127, 64), OneBitCodec(64)):
        for length in (1, 257, 1000 * size - 1):
            part = partition_length(length, size)
            xs = inputs([length, 17], size, length)
            padded = [np.concatenate([x, np.zeros(part * size - length, np.float32)])
                      for x in xs]
            errors = [np.random.default_rng([i, 5]).standard_normal(part * size)
                      .astype(np.float32) * np.float32(0.1) for i in range(size)]
            fmt = codec.format(part)
            payloads = np.empty((size, fmt.nbytes), np.uint8)   # the senders' partition `rank`
            my_error = errors[rank].copy()
            for i in range(size):
                err = errors[i].copy() if i != rank else my_error
                for k in range(size):
                    out = np.empty(fmt.nbytes, np.uint8)
                    codec.compress(padded[i][k * part:(k + 1) * part], out,
                                   residual=err[k * part:(k + 1) * part],
                                   seed=call_seed(3, i, k, 1))
                    if k == rank:
                        payloads[i] = out
            expected = codec.decompress_many(payloads, part, out=np.empty(part, np.float32))
            expected *= np.float32(1.0 / size)
            got = torch.empty(part)
            worker = torch.from_numpy(errors[rank].copy())
            compressed_reduce_scatter_(torch.from_numpy(xs[rank].copy()), comm, codec, got,
                                       worker_error=worker, scale=1.0 / size, seed=3)
            what = f"compressed reduce-scatter {codec} length {length}"
            assert np.array_equal(got.numpy(), expected), what
            assert np.array_equal(worker.numpy(), my_error), what + " worker error"
            checks += 1
    return checks


def check_hierarchical_compressed(rank, size):
    topo = bm.runtime.get().topo
    codec = MinMaxCodec(8, 64)
    length = 501
    xs = inputs([5], size, length, integer=True)
    # simulation: node sums (exact: integers), then C_LP_S among leaders
    rpn = topo.simulated_ranks_per_node or size
    nodes = sorted(set(r // rpn for r in range(size)))
    sums = [np.sum([xs[r] for r in range(size) if r // rpn == nd], axis=0).astype(np.float32)
            for nd in nodes]
    expected = simulate_clps(sums, codec, None, None, 1.0 / size, 7)
    mine = torch.from_numpy(xs[rank].copy())
    # the algorithm framework's two-level wrapper around C_LP_S among the node leaders
    ctx = AlgorithmContext(topo=topo, average=True, prescale=1.0, postscale=1.0 / size,
                           hierarchical=True, compression=bm.Compression.none)
    impl = AlgorithmImpl(None, ctx)
    impl.two_level([mine], lambda: compressed_allreduce_(mine, topo.leaders, codec,
                                                         scale=1.0 / size, seed=7))
    assert np.array_equal(mine.numpy(), expected), "hierarchical C_LP_S"
    return 1


def check_decentralized(rank, size):
    """D_FP_S against every rank's average in float64, on the float32 wire and on the 16-bit
    ones (the peers' models rounded to 16 bits, this rank's own exact), of a contiguous model
    and of a strided one."""
    comm = bm.runtime.get().topo.comm
    checks = 0
    for wire, kind in ((None, None), (torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        for topology in ("ring", "random"):
            for step in range(3):
                xs = inputs([step, 3], size, 1001)
                peers = [peers_for(topology, r, size, step, seed=42) for r in range(size)]
                for r in range(size):  # i picks j iff j picks i
                    for p in peers[r]:
                        assert r in peers[p], (topology, peers)
                total = xs[rank].astype(np.float64)  # float64 accumulation, peers in order
                for p in peers[rank]:
                    total += xs[p] if wire is None else round_16(xs[p], kind)
                expected = total / (1 + len(peers[rank]))
                contiguous = torch.from_numpy(xs[rank].copy())
                strided = torch.zeros(xs[rank].size, 2)[:, 0]  # every other float
                strided.copy_(contiguous)
                for form, mine in (("contiguous", contiguous), ("strided", strided)):
                    decentralized_average_(mine, comm, peers[rank], wire_dtype=wire)
                    assert np.array_equal(mine.numpy(), expected.astype(np.float32)), \
                        (topology, step, kind, form)
                    checks += 1
    if size % 2:  # odd world: exactly one rank sits out each random step
        assert sum(p < 0 for p in random_pairing(size, 0, 42)) == 1
    return checks


def check_low_precision_decentralized(rank, size):
    comm = bm.runtime.get().topo.comm
    codec = MinMaxCodec(8, 128)
    length = 700
    models = inputs([77], size, length)
    mine = torch.from_numpy(models[rank].copy())
    est = PeerEstimates(length)
    sim_models = [m.copy() for m in models]
    sim_est = [PeerEstimates(length) for _ in range(size)]
    spreads = []
    for step in range(12):
        # simulation of every rank (same codec, same order of operations)
        payloads = []
        for r in range(size):
            buf = np.empty(codec.format(length).nbytes, np.uint8)
            codec.compress(sim_models[r] - sim_est[r].own, buf)
            codec.decompress_many(buf[None], length, out=sim_est[r].own, accumulate=True)
            payloads.append(buf)
        for r in range(size):
            mix = np.zeros(length, np.float32)
            peers = peers_for("ring", r, size)
            for p in peers:
                h = sim_est[r].of(p)
                codec.decompress_many(payloads[p][None], length, out=h, accumulate=True)
                mix += h - sim_est[r].own
            sim_models[r] += np.float32(1.0 / (1 + len(peers))) * mix
        low_precision_decentralized_(mine, comm, peers_for("ring", rank, size), codec, est)
        assert np.array_equal(mine.numpy(), sim_models[rank]), f"D_LP_S step {step}"
        spreads.append(max(np.abs(m - np.mean(sim_models, axis=0)).max() for m in sim_models))
    if size > 1:
        assert spreads[-1] < 0.1 * spreads[0], spreads  # the models reach consensus
    return 12


def check_decentralized_payloads_kept(rank, size):
    """The host D_FP_S (float32 and 16-bit wires) and D_LP_S ask for no new array once their
    payload buffers exist: the peers' models or payloads, the 16-bit words and D_LP_S's
    difference are kept from call to call (``device_arrays.kept``), where each call mapped
    them anew, as large as the bucket. Two ways: no ``device_arrays.empty`` in the second
    call, and its exchange sends (where not the model itself) from and receives into the
    first call's memory, which is still held, so a new array could not land on it."""
    comm = bm.runtime.get().topo.comm
    peers = peers_for("ring", rank, size)
    codec, length = MinMaxCodec(8, 128), 700
    est = PeerEstimates(length)
    calls = {"D_FP_S": lambda t: decentralized_average_(t, comm, peers),
             "D_FP_S fp16": lambda t: decentralized_average_(t, comm, peers,
                                                             wire_dtype=torch.float16),
             "D_FP_S bf16": lambda t: decentralized_average_(t, comm, peers,
                                                             wire_dtype=torch.bfloat16),
             "D_LP_S": lambda t: low_precision_decentralized_(t, comm, peers, codec, est)}
    for what, call in calls.items():
        calls_made = [ArraysAsked() for _ in range(2)]
        for attempt, asked in enumerate(calls_made):
            with asked:
                call(torch.from_numpy(inputs([attempt, 5], size, length)[rank]))
        first, second = calls_made
        assert not second.new, f"{what}: {len(second.new)} new arrays in its second call"
        (send1, recvs1), (send2, recvs2) = first.exchanges + second.exchanges
        assert len(recvs2) == len(peers) and all(
            shares_memory(a, b) for a, b in zip(recvs1, recvs2)), f"{what}: new receives"
        if what != "D_FP_S":   # the float32 wire sends the model itself
            assert shares_memory(send1, send2), f"{what}: a new send buffer"
    return len(calls)


def check_packed_compressed_allreduce(rank, size):
    """One packed exchange of layers at different levels == C_LP_S of each layer on its own."""
    comm = bm.runtime.get().topo.comm
    layers = [(1000, MinMaxCodec(2, 128), True), (1, MinMaxCodec(8, 128), True),
              (0, MinMaxCodec(4, 128), False), (777, MinMaxCodec(5, 128), False),
              (300, QSGDCodec(15, 128), True)]
    state, sim = [], []
    for length, _, ef in layers:
        part = partition_length(length, size)
        state.append((torch.zeros(part * size), torch.zeros(part)) if ef else (None, None))
        sim.append(([np.zeros(part * size, np.float32) for _ in range(size)],
                    [np.zeros(part, np.float32) for _ in range(size)]) if ef else (None, None))
    for step in range(3):
        xs = [inputs([length, step, 23], size, length) for length, _, _ in layers]
        mine = [torch.from_numpy(x[rank].copy()) for x in xs]
        packed_compressed_allreduce_(
            [Segment(m, codec, *state[j], seed=call_seed(step, j))
             for j, (m, (_, codec, _)) in enumerate(zip(mine, layers))],
            comm, scale=1.0 / size)
        for j, (length, codec, ef) in enumerate(layers):
            expected = simulate_clps(xs[j], codec, *sim[j], 1.0 / size, call_seed(step, j))
            what = f"packed C_LP_S layer {j} ({codec}, n={length}) step {step}"
            assert np.array_equal(mine[j].numpy(), expected), what
            if ef:
                assert np.array_equal(state[j][0].numpy(), sim[j][0][rank]), what + " worker"
                assert np.array_equal(state[j][1].numpy(), sim[j][1][rank]), what + " server"
    return 3 * len(layers)


def round_16(x: np.ndarray, kind: str) -> np.ndarray:
    """x (float32) rounded to fp16/bf16 and back, nearest even (NumPy's float16; bf16 by its
    float32 bits: add 0x7fff plus the kept lowest bit, drop 16 bits)."""
    if kind == "fp16":
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    kept = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return (kept & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def simulate_cast_allreduce(xs, kind: str, scale: float) -> np.ndarray:
    """Every rank's casts, partition sums in float32 in rank order, the scaled sum's cast."""
    n, length = len(xs), xs[0].size
    part = partition_length(length, n)
    padded = np.zeros((n, part * n), np.float32)
    for i, x in enumerate(xs):
        padded[i, :length] = round_16(x.astype(np.float32), kind)
    total = padded[0].copy()
    for i in range(1, n):
        total += padded[i]
    return round_16(total * np.float32(scale), kind)[:length]


def check_cast_allreduce(rank, size):
    """The 16-bit wire's scatter-reduce, exact against the simulation (lengths that do not
    divide by the world size; float64 tensors are cast from their float32 rounding)."""
    comm = bm.runtime.get().topo.comm
    checks = 0
    for kind, wire in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for dtype in (np.float32, np.float64):
            for length in (1, 5, 1001, 40_003):
                xs = [x.astype(dtype) for x in inputs(7 + length, size, length)]
                expected = simulate_cast_allreduce([x.astype(np.float32) for x in xs], kind,
                                                   1.0 / size)
                mine = torch.from_numpy(xs[rank].copy())
                cast_allreduce_(mine, comm, wire, 1.0 / size)
                what = f"cast_allreduce {kind} {np.dtype(dtype).name} length {length}"
                assert np.array_equal(mine.numpy().astype(np.float32), expected), what
                checks += 1
    return checks


def suite_checks() -> dict:
    """Every ``check_*`` function of this module by name (in the order they are defined), each
    reported on its own (``checks.run_suite``): a new check cannot be left out of the run."""
    return {name.removeprefix("check_"): fn for name, fn in globals().items()
            if name.startswith("check_") and callable(fn)}


if __name__ == "__main__":
    sys.exit(run_suite(suite_checks()))
