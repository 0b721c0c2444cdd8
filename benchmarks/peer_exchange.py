"""Peer exchange (decentralized SGD's swap) on the process-group plane: the batch every rank
posts at once against the former pair-by-pair order, with MPI's Isend/Irecv beside them.

    BAGUA_MPI_BACKEND=gloo mpiexec -n 4 python benchmarks/peer_exchange.py
        [--topology ring] [--min-kib 4] [--max-mib 16] [--rounds 7] [--markdown out.md]

Variants, measured in interleaved rounds (each variant once per round, the median round kept):
  batch       ``Transport.exchange`` on the gloo group: every send and receive posted, then
              waited on together (on NCCL, one group call)
  pairwise    what the group did before: pair by pair in the order (lower rank, higher rank),
              the lower rank sending first, each transfer waited on before the next. On a ring
              the pairs form a chain, so P - 1 transfers follow one another
  mpi         ``comm.Irecv``/``Isend`` + ``Waitall`` on the same buffers (MPI's own wire)
The time of a round is the slowest rank's.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi import backends, process_groups, transport
from bagua_mpi.primitives.decentralized import peers_for
from collectives import timed  # the slowest rank's time per call

_TAG = 17


def pairwise(group, send, recvs, peers) -> None:
    me = group.rank
    for i in sorted(range(len(peers)), key=lambda i: peers[i]):
        peer = peers[i]
        if me < peer:
            group.send(send, peer, _TAG)
            group.recv(recvs[i], peer, _TAG)
        else:
            group.recv(recvs[i], peer, _TAG)
            group.send(send, peer, _TAG)


def mpi_exchange(comm, send, recvs, peers) -> None:
    reqs = [comm.Irecv(r.numpy(), source=p, tag=_TAG) for r, p in zip(recvs, peers)]
    reqs += [comm.Isend(send.numpy(), dest=p, tag=_TAG) for p in peers]
    MPI.Request.Waitall(reqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="ring", choices=["ring", "random"])
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--markdown", help="also write the table to this file (rank 0)")
    args = parser.parse_args()

    bm.init()
    if backends.resolve() != "gloo":
        raise SystemExit("run with BAGUA_MPI_BACKEND=gloo: this measures the process-group "
                         "plane's exchange")
    comm = bm.runtime.get().topo.comm
    rank, size = comm.Get_rank(), comm.Get_size()
    wire = transport.of(comm)
    peers = peers_for(args.topology, rank, size, step=1, seed=0)
    sizes, nbytes = [], args.min_kib * 1024
    while nbytes <= args.max_mib * 1024 * 1024:
        sizes.append(nbytes)
        nbytes *= 4
    rows = []
    for nbytes in sizes:
        send = torch.full((nbytes // 4,), float(rank))
        recvs = [torch.empty_like(send) for _ in peers]
        group = process_groups.group(comm, "gloo")
        variants = {"batch": lambda: wire.exchange(send, recvs, peers, tag=_TAG),
                    "pairwise": lambda: pairwise(group, send, recvs, peers),
                    "mpi": lambda: mpi_exchange(comm, send, recvs, peers)}
        for fn in variants.values():  # warm-up, and the first call makes the group
            fn()
        for r, p in zip(recvs, peers):
            assert torch.equal(r, torch.full_like(r, float(p))), "a message went astray"
        iters = max(3, min(200, (64 << 20) // nbytes))
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(timed(fn, iters, comm))
        med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        rows.append((nbytes, med))
    if rank == 0:
        lines = [f"# Peer exchange, {args.topology} peers, {size} ranks, gloo group "
                 f"(median of {args.rounds} interleaved rounds, slowest rank)", "",
                 "| bytes per message | batch µs | pairwise µs | mpi µs | pairwise / batch |",
                 "|---:|---:|---:|---:|---:|"]
        for nbytes, med in rows:
            lines.append(f"| {nbytes} | {med['batch']:.0f} | {med['pairwise']:.0f} | "
                         f"{med['mpi']:.0f} | {med['pairwise'] / med['batch']:.2f} |")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write(text + "\n")
    bm.shutdown()


if __name__ == "__main__":
    main()
