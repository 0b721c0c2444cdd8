"""The primitives' device paths (Numba device arrays; MPI on device buffers, or payloads
staged through the transport's pinned pool) against their host paths, byte for byte.

Run with NUMBA_ENABLE_CUDASIM=1: Numba's CUDA simulator runs the device kernels on the CPU and
its device arrays expose host memory to MPI, so the code a GPU runs (allocation, kernels,
synchronisation, MPI on device buffers or staging of payloads) runs here. Each check runs
twice: as with a CUDA-aware MPI, and staged (``set_cuda_aware(False)``), where the staging
counter must show payload bytes only and the pool must not grow after the first step.
"""
import os
import sys

import numpy as np
from numba import cuda

import bagua_mpi as bm
from bagua_mpi import cuda as bcuda
from bagua_mpi import transport
from bagua_mpi.accounting import WireStats, overhead, staging
from bagua_mpi.primitives.codecs import MinMaxCodec, OneBitCodec, QSGDCodec
from bagua_mpi.primitives.lowprec import SharedBases, _clps_arrays, partition_length
from checks import run_suite


def say(comm, msg):
    if comm.Get_rank() == 0:
        print(msg, flush=True)


def check_clps(comm, aware: bool):
    rank, n = comm.Get_rank(), comm.Get_size()
    bcuda.set_cuda_aware(aware)
    # uneven lengths (padding), several codecs in one packed exchange, error feedback on some
    layers = [(300, MinMaxCodec(8, 64), True), (37, QSGDCodec(127, 16), False),
              (256, OneBitCodec(64), True), (90, MinMaxCodec(4, 32), False)]
    state = {}
    for j, (length, _, ef) in enumerate(layers):
        part = partition_length(length, n)
        if ef:
            state[j] = [np.zeros(part * n, np.float32), np.zeros(part, np.float32)]
    dev_state = {j: [cuda.to_device(a) for a in v] for j, v in state.items()}
    allocations = None
    for step in range(2):
        rng = np.random.default_rng([step, rank, 11])
        grads = [(rng.standard_normal(length) * (1 + rank)).astype(np.float32)
                 for length, _, _ in layers]
        host = [g.copy() for g in grads]
        dev = [cuda.to_device(g) for g in grads]
        codecs = [c for _, c, _ in layers]
        seeds = [step * 10 + j for j in range(len(layers))]
        hw, hs = [state.get(j, [None, None])[0] for j in range(len(layers))], \
            [state.get(j, [None, None])[1] for j in range(len(layers))]
        dw, ds = [dev_state.get(j, [None, None])[0] for j in range(len(layers))], \
            [dev_state.get(j, [None, None])[1] for j in range(len(layers))]
        hstats, dstats = WireStats(), WireStats()
        _clps_arrays(host, hw, hs, codecs, seeds, comm, 1.0 / n, hstats, False)
        staging.reset()
        launches, syncs = overhead.snapshot()
        _clps_arrays(dev, dw, ds, codecs, seeds, comm, 1.0 / n, dstats, True)
        snap = staging.snapshot()
        # the host waits for the device once per collective (alltoall, allgather) before a
        # CUDA-aware MPI reads device memory; staged, in the copy out and in the copy back
        waits = overhead.snapshot()[1] - syncs
        expected = 0 if n == 1 else 2 if aware else 4
        assert waits == expected, f"{waits} host waits for one C_LP_S exchange, not {expected}"
        # launches per segment, whatever n and whether n divides its length: one encode of
        # all n partitions, the server's decode-sum-and-scale, its encode, one decode of all n
        # partitions (it was 2n + 3 with one encode and one decode per partition, and a zero
        # fill besides where the kernels did not yet read past the end as padding; 5 with the
        # scale in a launch of its own)
        expected = 4 * len(layers)
        launched = overhead.snapshot()[0] - launches
        assert launched == expected, f"{launched} kernel launches, expected {expected}"
        for j in range(len(layers)):
            assert np.array_equal(dev[j].copy_to_host(), host[j]), f"layer {j} step {step}"
            if j in state:
                assert np.array_equal(dw[j].copy_to_host(), hw[j]), f"worker error {j}"
                assert np.array_equal(ds[j].copy_to_host(), hs[j]), f"server error {j}"
        assert dstats.bytes_sent == hstats.bytes_sent
        row = sum(c.format(partition_length(length, n)).nbytes for length, c, _ in layers)
        dense = sum(length for length, _, _ in layers) * 4
        if aware:
            assert snap["d2h_bytes"] == 0, snap
        else:  # the alltoall's n rows and this rank's merged row: payloads, nothing dense
            assert snap["d2h_bytes"] == n * row + row, (snap, n, row)
            assert snap["dense_d2h_bytes"] == 0, snap
            assert snap["largest_d2h"] < dense, (snap, dense)
            if allocations is None:
                allocations = transport.pinned_pool.allocations
            else:
                assert transport.pinned_pool.allocations == allocations, "pool grew after step 0"
        everyone = comm.allgather([h.tobytes() for h in host])
        assert all(e == everyone[0] for e in everyone), "ranks disagree"
    say(comm, f"C_LP_S device == host ({'CUDA-aware' if aware else 'staged'}) on {n} ranks")


def check_clps_together(comm, aware: bool):
    """L-GreCo's min-max exchange: layers at their own widths (one chunk), their gradients in
    one memory with gaps between them and their error memories end to end, take 4 launches for
    all of them (``_Together``), where each layer took 4 of its own; the same bytes as the
    host's layer-by-layer exchange, with and without error feedback, an empty layer among
    them."""
    rank, n = comm.Get_rank(), comm.Get_size()
    bcuda.set_cuda_aware(aware)
    chunk = 32
    layers = [(300, 8), (37, 3), (0, 4), (256, 1), (90, 6), (5, 2)]
    for feedback in (True, False):
        offsets, size = [], 7
        for length, _ in layers:
            offsets.append(size)
            size += length + 5    # gaps, which no kernel may write
        parts = [partition_length(length, n) for length, _ in layers]
        worker_at = np.cumsum([0] + [p * n for p in parts])
        server_at = np.cumsum([0] + parts)
        worker = np.zeros(worker_at[-1], np.float32)
        server = np.zeros(server_at[-1], np.float32)
        dev_worker, dev_server = cuda.to_device(worker), cuda.to_device(server)
        codecs = [MinMaxCodec(bits, chunk) for _, bits in layers]
        for step in range(2):
            rng = np.random.default_rng([step, rank, 13])
            base = (rng.standard_normal(size) * (1 + rank)).astype(np.float32)
            host = [base[o:o + length].copy() for o, (length, _) in zip(offsets, layers)]
            dev_base = cuda.to_device(base)
            dev = [dev_base[o:o + length] for o, (length, _) in zip(offsets, layers)]

            def errors(w, s, j):
                if not feedback:
                    return None, None
                return w[worker_at[j]:worker_at[j + 1]], s[server_at[j]:server_at[j + 1]]
            hw, hs = zip(*[errors(worker, server, j) for j in range(len(layers))])
            dw, ds = zip(*[errors(dev_worker, dev_server, j) for j in range(len(layers))])
            seeds = [0] * len(layers)
            hstats, dstats = WireStats(), WireStats()
            _clps_arrays(host, list(hw), list(hs), codecs, seeds, comm, 1.0 / n, hstats, False)
            bases = SharedBases(dev_base, offsets, [length for length, _ in layers],
                                *((dev_worker, list(worker_at[:-1]), dev_server,
                                   list(server_at[:-1])) if feedback else ()))
            launches, _ = overhead.snapshot()
            _clps_arrays(dev, list(dw), list(ds), codecs, seeds, comm, 1.0 / n, dstats, True,
                         bases)
            launched = overhead.snapshot()[0] - launches
            assert launched == 4, f"{launched} kernel launches for {len(layers)} layers"
            got = dev_base.copy_to_host()
            for j, (o, (length, _)) in enumerate(zip(offsets, layers)):
                assert np.array_equal(got[o:o + length], host[j]), f"layer {j} step {step}"
            gaps = np.ones(size, bool)
            for o, (length, _) in zip(offsets, layers):
                gaps[o:o + length] = False
            assert np.array_equal(got[gaps], base[gaps]), "a kernel wrote between the layers"
            if feedback:
                assert np.array_equal(dev_worker.copy_to_host(), worker), "worker errors"
                assert np.array_equal(dev_server.copy_to_host(), server), "server errors"
            assert dstats.bytes_sent == hstats.bytes_sent
    say(comm, f"C_LP_S of min-max layers together == host ({'aware' if aware else 'staged'}) "
              f"on {n} ranks")


def check_topk(comm, aware: bool):
    from bagua_mpi.primitives.sparse import _topk_arrays
    rank, n = comm.Get_rank(), comm.Get_size()
    bcuda.set_cuda_aware(aware)
    length, k = 500, 12
    host_res = np.zeros(length, np.float32)
    dev_res = cuda.to_device(host_res)
    allocations = None
    for step in range(2):
        rng = np.random.default_rng([step, rank, 5])
        g = (rng.standard_t(2, length) * (1 + rank)).astype(np.float32)
        host, dev = g.copy(), cuda.to_device(g)
        _topk_arrays(host, host_res, k, comm, 1.0 / n, "int32", None, False)
        staging.reset()
        launches, syncs = overhead.snapshot()
        allocated_before = overhead.allocations()
        _topk_arrays(dev, dev_res, k, comm, 1.0 / n, "int32", None, True)
        snap = staging.snapshot()
        waits = overhead.snapshot()[1] - syncs  # the selection itself never waits
        expected = 0 if n == 1 else 1 if aware else 2   # staged: the copies out and back
        assert waits == expected, f"{waits} host waits for one top-k allgather, not {expected}"
        # one block selects (residual added inside), one pass scales the n gathered rows'
        # values (none at n = 1), the decode zeroes out and one block scatters every row
        launched = overhead.snapshot()[0] - launches
        assert launched == 1 + (n > 1) + 2, f"{launched} kernel launches for top-k on {n} ranks"
        if step:   # the selection's scratch and the payload exist after the first step
            assert overhead.allocations() == allocated_before, "top-k allocated device memory"
        assert np.array_equal(dev.copy_to_host(), host), f"topk result step {step}"
        assert np.array_equal(dev_res.copy_to_host(), host_res), f"topk residual step {step}"
        if not aware:
            assert 0 < snap["d2h_bytes"] < length * 4 and snap["dense_d2h_bytes"] == 0, snap
            if allocations is None:
                allocations = transport.pinned_pool.allocations
            assert transport.pinned_pool.allocations == allocations, "pool grew"
        else:
            assert snap["d2h_bytes"] == 0, snap
    say(comm, f"Top-k device == host ({'CUDA-aware' if aware else 'staged'}) on {n} ranks")


def merges_made(rank, n):
    """How many payloads ``rank`` merges in gTop-k on n ranks: at n = 2 both ranks merge
    once; else in the binomial tree's round j (mask 2^j) a rank with bit j set sends and
    leaves, and the others merge what rank + mask sends, when that rank exists."""
    if n == 2:
        return 1
    merges, mask = 0, 1
    while mask < n and not rank & mask:
        merges += rank + mask < n
        mask <<= 1
    return merges


def check_gtopk_staged(comm):
    """gTop-k's device tree through staged point-to-point messages (an MPI that cannot read
    device memory): the host path's bytes, payload copies only, pool reused."""
    from bagua_mpi.primitives.sparse import _gtopk_arrays
    rank, n = comm.Get_rank(), comm.Get_size()
    bcuda.set_cuda_aware(False)
    layers = [(300, 5), (64, 7)]
    host_res = [np.zeros(m, np.float32) for m, _ in layers]
    dev_res = [cuda.to_device(r) for r in host_res]
    allocations = None
    for step in range(2):
        rng = np.random.default_rng([step, rank, 3])
        grads = [(rng.standard_t(2, m) * (1 + rank)).astype(np.float32) for m, _ in layers]
        host, dev = [g.copy() for g in grads], [cuda.to_device(g) for g in grads]
        ks = [k for _, k in layers]
        _gtopk_arrays(host, host_res, ks, comm, 1.0 / n, "int32", None)
        staging.reset()
        launches = overhead.snapshot()[0]
        _gtopk_arrays(dev, dev_res, ks, comm, 1.0 / n, "int32", None)
        snap = staging.snapshot()
        # per segment (each its own array here): the selection, and the decode (restore,
        # scale, zero fill and scatter in one); one launch per merge this rank makes, for all
        # the segments
        launched = overhead.snapshot()[0] - launches
        expected = 2 * len(layers) + merges_made(rank, n)
        assert launched == expected, f"rank {rank}: {launched} kernel launches, not {expected}"
        for j in range(len(layers)):
            assert np.array_equal(dev[j].copy_to_host(), host[j]), f"gtopk {j} step {step}"
            assert np.array_equal(dev_res[j].copy_to_host(), host_res[j]), f"residual {j}"
        assert snap["dense_d2h_bytes"] == 0 and snap["largest_d2h"] < 300 * 4, snap
        assert snap["d2h_bytes"] > 0 or n == 1, snap
        if allocations is None:
            allocations = transport.pinned_pool.allocations
        assert transport.pinned_pool.allocations == allocations, "pool grew"
    say(comm, f"gTop-k device == host (staged) on {n} ranks")


def check_decentralized(comm, aware: bool):
    """The torch device forms of D_FP_S and D_LP_S (run here on CPU tensors: the simulator has
    no torch device) against the NumPy host forms, byte for byte."""
    import torch
    from bagua_mpi.primitives import decentralized as dec
    rank, n = comm.Get_rank(), comm.Get_size()
    bcuda.set_cuda_aware(aware)
    peers = dec.ring_peers(rank, n)
    codec = MinMaxCodec(8, 64)
    length = 333
    est_host = dec.PeerEstimates(length)
    est_dev = dec.PeerEstimates(length, torch.zeros(length))
    for step in range(3):
        rng = np.random.default_rng([step, rank, 9])
        m = (rng.standard_normal(length) + rank).astype(np.float32)
        a, b = torch.from_numpy(m.copy()), torch.from_numpy(m.copy())
        dec.decentralized_average_(a, comm, peers)
        dec._device_average_(b, comm, peers, None, None)
        assert torch.equal(a, b), f"D_FP_S step {step}"
        for wire in (torch.float16, torch.bfloat16):
            a, b = torch.from_numpy(m.copy()), torch.from_numpy(m.copy())
            dec.decentralized_average_(a, comm, peers, wire_dtype=wire)
            dec._device_average_(b, comm, peers, None, wire)
            assert torch.equal(a, b), f"D_FP_S {wire} step {step}"
        a, b = torch.from_numpy(m.copy()), torch.from_numpy(m.copy())
        dec.low_precision_decentralized_(a, comm, peers, codec, est_host, gamma=0.5)
        dec._device_lowprec_(b, comm, peers, codec, est_dev, 0.5, None)
        assert torch.equal(a, b), f"D_LP_S step {step}"
        own, others = est_dev.tensors()
        assert np.array_equal(own.numpy(), est_host.own), "own estimate"
        for p in peers:
            assert np.array_equal(others[p].numpy(), est_host.of(p)), f"estimate of {p}"
    say(comm, f"decentralized device forms == host ({'aware' if aware else 'staged'}) on {n}")


def both_ways(check):
    """A check run as with a CUDA-aware MPI, then staged."""
    def run(rank, size):
        for aware in (True, False):
            check(bm.runtime.get().topo.comm, aware)
    return run


CHECKS = {"gtopk": lambda rank, size: check_gtopk_staged(bm.runtime.get().topo.comm),
          "clps": both_ways(check_clps),
          "clps_together": both_ways(check_clps_together),
          "topk": both_ways(check_topk),
          "decentralized": both_ways(check_decentralized)}


def main():
    """Every check, or those named by ``--check NAME``, each reported on its own line."""
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run under the CUDA simulator"
    return run_suite(CHECKS)


if __name__ == "__main__":
    sys.exit(main())
