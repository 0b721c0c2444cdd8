"""Every verb of ``bagua_mpi.transport`` against a NumPy oracle, under the backend in
``BAGUA_MPI_BACKEND`` (``mpi``: mpi4py; ``gloo``: torch.distributed's process group, the code
NCCL runs). With ``NUMBA_ENABLE_CUDASIM=1`` the simulator's device arrays take the staged-MPI
carrier (pinned host buffers) as well.

Each rank's data is a function of its rank (``data(rank)``), so every rank builds the oracle of
the whole job itself. One line per check (``checks.py``).
"""
import os
import sys

import numpy as np
import torch

import bagua_mpi as bm
from mpi4py import MPI

from bagua_mpi import backends, process_groups, topology, transport
from bagua_mpi.accounting import staging
from bagua_mpi.primitives.decentralized import random_peers, ring_peers
from checks import run_checks

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def data(rank: int, n: int = 37, dtype=np.float32) -> np.ndarray:
    """Small integers, different on every rank: sums are exact in every dtype used here."""
    return ((np.arange(n) * (rank + 3)) % 11 - 5).astype(dtype)


def wire():
    return transport.Transport(bm.runtime.get().topo.comm)


def forms(values: np.ndarray):
    """The buffer kinds a primitive hands the transport, each holding ``values``."""
    yield "numpy", values.copy()
    yield "torch", torch.from_numpy(values.copy())
    if SIM:
        from numba import cuda
        yield "device", cuda.to_device(values.copy())


def as_numpy(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf
    if isinstance(buf, torch.Tensor):
        return buf.float().numpy() if buf.dtype == torch.bfloat16 else buf.numpy()
    return buf.copy_to_host()


def expect_carrier(buf) -> str:
    if transport.on_device(buf):
        return "mpi_staged"
    return "gloo" if backends.resolve() == "gloo" else "mpi"


def check_allreduce(rank, size):
    everyone = np.stack([data(r) for r in range(size)])
    oracles = {"sum": everyone.sum(0), "min": everyone.min(0), "max": everyone.max(0)}
    for op, expected in oracles.items():
        for kind, buf in forms(data(rank)):
            assert wire().carrier(buf) == expect_carrier(buf), (kind, wire().carrier(buf))
            wire().allreduce_(buf, op)
            assert np.array_equal(as_numpy(buf), expected), (op, kind, as_numpy(buf), expected)
    half = torch.from_numpy(data(rank)).to(torch.bfloat16)  # MPI sums it in float32
    wire().allreduce_(half)
    assert np.array_equal(half.float().numpy(), oracles["sum"]), "bfloat16 sum"


def check_reduce_and_broadcast(rank, size):
    total = np.sum([data(r) for r in range(size)], axis=0)
    root = size - 1
    for kind, buf in forms(data(rank)):
        wire().reduce_(buf, 0)
        if rank == 0:
            assert np.array_equal(as_numpy(buf), total), (kind, "reduce")
    for kind, buf in forms(data(rank)):
        wire().broadcast_(buf, root)
        assert np.array_equal(as_numpy(buf), data(root)), (kind, "broadcast")


def check_alltoall(rank, size):
    block = 24
    send = np.stack([np.full(block, 16 * rank + k, np.uint8) for k in range(size)])
    expected = np.stack([np.full(block, 16 * j + rank, np.uint8) for j in range(size)])
    for kind, buf in forms(send):
        recv = next(b for k, b in forms(np.zeros_like(send)) if k == kind)
        wire().alltoall(buf, recv)
        assert np.array_equal(as_numpy(recv), expected), kind


def check_allgather(rank, size):
    expected = np.concatenate([data(r) for r in range(size)])
    for kind, buf in forms(data(rank)):
        recv = next(b for k, b in forms(np.zeros_like(expected)) if k == kind)
        wire().allgather(buf, recv)
        assert np.array_equal(as_numpy(recv), expected), kind
    n = data(0).size  # in place: this rank's block of the receive buffer is the send buffer
    whole = np.zeros(n * size, np.float32)
    whole[rank * n:(rank + 1) * n] = data(rank)
    for kind, buf in forms(whole):
        if kind == "device":
            continue  # device slices are copies in the simulator: in place needs real memory
        wire().allgather(buf[rank * n:(rank + 1) * n], buf)
        assert np.array_equal(as_numpy(buf), expected), (kind, "in place")


def check_reduce_scatter(rank, size):
    n = data(0).size
    everyone = np.stack([np.concatenate([data(r + k) for k in range(size)])
                         for r in range(size)])
    expected = everyone.sum(0)[rank * n:(rank + 1) * n]  # block `rank` of the sum
    mine = everyone[rank]
    for kind, buf in forms(mine):
        recv = next(b for k, b in forms(np.zeros(n, np.float32)) if k == kind)
        wire().reduce_scatter(buf, recv)
        assert np.array_equal(as_numpy(recv), expected), kind
    half = torch.from_numpy(mine).to(torch.bfloat16)
    out = torch.zeros(n, dtype=torch.bfloat16)
    wire().reduce_scatter(half, out)
    assert np.array_equal(out.float().numpy(), expected), "bfloat16 reduce_scatter"


def check_reduce_scatter_ops(rank, size):
    """Min, max and product: the op reaches every carrier (MPI's Reduce_scatter_block, the
    process group's options)."""
    n = data(0).size
    everyone = np.stack([np.concatenate([data(r + k) for k in range(size)])
                         for r in range(size)])
    oracles = {"min": everyone.min(0), "max": everyone.max(0), "product": everyone.prod(0)}
    for op, whole in oracles.items():
        for kind, buf in forms(everyone[rank]):
            recv = next(b for k, b in forms(np.zeros(n, np.float32)) if k == kind)
            wire().reduce_scatter(buf, recv, op)
            assert np.array_equal(as_numpy(recv), whole[rank * n:(rank + 1) * n]), (op, kind)


def check_alltoallv(rank, size):
    """Rank r sends (r + 2k) % 3 + k elements to rank k (none at all from some ranks to some),
    so what a rank sends differs from what it receives; against NumPy."""
    def counts_from(r):
        return [(r + 2 * k) % 3 + k for k in range(size)]

    def sent_by(r):
        return (np.arange(sum(counts_from(r))) + 100 * r).astype(np.float32)

    recv_counts = [counts_from(j)[rank] for j in range(size)]
    want = np.concatenate([np.split(sent_by(j), np.cumsum(counts_from(j))[:-1])[rank]
                           for j in range(size)])
    for kind, buf in forms(sent_by(rank)):
        recv = next(b for k, b in forms(np.zeros(sum(recv_counts), np.float32)) if k == kind)
        wire().alltoallv(buf, counts_from(rank), recv, recv_counts)
        assert np.array_equal(as_numpy(recv), want), kind
    try:
        wire().alltoallv(sent_by(rank), counts_from(rank)[:-1] + [99], np.zeros(
            sum(recv_counts), np.float32), recv_counts)
    except ValueError as e:
        assert "send_counts" in str(e), e
    else:
        raise AssertionError("alltoallv took counts its send buffer does not hold")


def check_every_verb_checked(rank, size):
    """Every public verb of Transport has a check here (a new verb fails until it has)."""
    verbs = {name for name, value in vars(transport.Transport).items()
             if callable(value) and not name.startswith("_") and name[0].islower()
             and name not in ("carrier",)}
    checked = {"allreduce_", "reduce_", "broadcast_", "alltoall", "alltoallv", "allgather",
               "reduce_scatter", "send", "recv", "exchange"}
    assert verbs == checked, f"verbs without a check: {sorted(verbs - checked)}"


def check_send_recv(rank, size):
    for kind, buf in forms(data(rank)):
        if rank == 0:
            for dest in range(1, size):
                wire().send(buf, dest, tag=11)
        else:
            wire().recv(buf, 0, tag=11)
        assert np.array_equal(as_numpy(buf), data(0)), kind


def check_exchange(rank, size):
    """Ring and random peers, and every other rank listed in an order of the rank's own (odd
    ranks backwards): the ranks' orders differ, and nothing may wait on a peer's order."""
    everyone = [p for p in range(size) if p != rank][::-1 if rank % 2 else 1]
    for peers in (ring_peers(rank, size), random_peers(rank, size, step=3, seed=5), everyone):
        for kind, buf in forms(data(rank)):
            recvs = [next(b for k, b in forms(np.zeros_like(data(rank))) if k == kind)
                     for _ in peers]
            wire().exchange(buf, recvs, peers)
            for peer, got in zip(peers, recvs):
                assert np.array_equal(as_numpy(got), data(peer)), (kind, peer)


MOVED_DTYPES = (np.uint16, np.int16, np.uint32, np.int8, np.bool_, np.float16, np.float64,
                np.complex64)


def check_moves_every_dtype(rank, size):
    """The verbs that only move data carry any dtype's bytes: the host paths send 16-bit words
    as uint16 arrays, which gloo (and NCCL) refuse as a dtype (ZeRO's fp16 wire failed on
    gloo). Against NumPy, for each dtype: alltoall, allgather, broadcast, exchange."""
    for dtype in MOVED_DTYPES:
        def mine(r, n=6 * size):
            return ((np.arange(n) * (r + 2)) % 7).astype(dtype)
        got = np.empty_like(mine(rank))
        wire().alltoall(mine(rank), got)
        want = np.concatenate([np.split(mine(r), size)[rank] for r in range(size)])
        assert np.array_equal(got, want), ("alltoall", dtype)
        gathered = np.empty(size * mine(rank).size, dtype)
        wire().allgather(mine(rank), gathered)
        assert np.array_equal(gathered, np.concatenate([mine(r) for r in range(size)])), \
            ("allgather", dtype)
        root_data = mine(rank).copy()
        wire().broadcast_(root_data, 0)
        assert np.array_equal(root_data, mine(0)), ("broadcast", dtype)
        peers = ring_peers(rank, size)
        recvs = [np.empty_like(mine(rank)) for _ in peers]
        wire().exchange(mine(rank), recvs, peers)
        for peer, r in zip(peers, recvs):
            assert np.array_equal(r, mine(peer)), ("exchange", dtype, peer)


def check_staging_counted(rank, size):
    """Host payloads are never counted as staging; simulated device ones are, as payloads
    unless the caller says dense."""
    staging.reset()
    for kind, buf in forms(data(rank)):
        wire().allreduce_(buf, dense=False)
    snap = staging.snapshot()
    staged = data(rank).nbytes if SIM and size > 1 else 0
    assert snap["d2h_bytes"] == staged and snap["dense_d2h_bytes"] == 0, snap


def check_nccl_hierarchical_form(rank, size):
    """``transport.nccl_allreduce_``'s two-level form (NCCL inside each node, MPI among the
    node leaders, NCCL's broadcast back), with gloo groups standing in for NCCL's, on nodes of
    one rank and of two: every op and float dtype against the oracle. Otherwise only a job of
    several nodes with GPUs runs this code (a one-GPU machine runs NCCL at world size 1)."""
    if backends.resolve() != "gloo":
        return   # the stand-in is the gloo group
    real = process_groups.group
    process_groups.group = lambda comm, library="nccl": real(comm, "gloo")
    everyone = np.stack([data(r) for r in range(size)]).astype(np.float64)
    oracles = {"sum": everyone.sum(0), "max": everyone.max(0), "min": everyone.min(0),
               "product": everyone.prod(0)}
    try:
        for per_node in (1, 2):
            topo = topology.build(MPI.COMM_WORLD, per_node)
            for op, expected in oracles.items():
                for dtype in (torch.float32, torch.float16, torch.float64):
                    t = torch.from_numpy(data(rank)).to(dtype)
                    transport.nccl_allreduce_(t, topo, "nccl_hierarchical", op)
                    assert np.array_equal(t.double().numpy(), expected), \
                        (per_node, op, dtype, t, expected)
    finally:
        process_groups.group = real


def main():
    bm.init()
    failures = run_checks({"allreduce": check_allreduce,
                           "reduce_broadcast": check_reduce_and_broadcast,
                           "alltoall": check_alltoall, "allgather": check_allgather,
                           "reduce_scatter": check_reduce_scatter,
                           "reduce_scatter_ops": check_reduce_scatter_ops,
                           "alltoallv": check_alltoallv,
                           "every_verb_checked": check_every_verb_checked,
                           "send_recv": check_send_recv, "exchange": check_exchange,
                           "moves_every_dtype": check_moves_every_dtype,
                           "staging_counted": check_staging_counted,
                           "nccl_hierarchical_form": check_nccl_hierarchical_form})
    if bm.rank() == 0 and not failures:
        print(f"transport suite OK on {bm.size()} ranks, backend {backends.resolve()}, "
              f"simulator {SIM}", flush=True)
    bm.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
