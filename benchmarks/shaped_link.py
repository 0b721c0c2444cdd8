"""Run commands over a shaped network link: a fresh network namespace whose loopback is shaped.

Needs root (``ip netns``, ``tc``). Inside the namespace, only the loopback exists; ``tc tbf``
limits its rate, so every byte that ranks inside it exchange over TCP passes one link of that
bandwidth, shared by all of them (aggregate, not per rank). MPICH is forced onto TCP over that
loopback (``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=lo MPIR_CVAR_NOLOCAL=1``):
without the netmod variable the mpich wheel uses UCX, and without ``NOLOCAL`` ranks on one
machine talk through shared memory; either bypasses the shaper. Latency needs the netem qdisc,
which not every kernel has (``latency_ms`` adds it where it exists).

    from shaped_link import shaped_link
    with shaped_link(1.0) as link:          # 1 Gbit/s; None: an unshaped namespace
        subprocess.run(link.prefix + ["mpiexec", "-n", "4", sys.executable, "x.py"],
                       check=True)

The namespace is deleted on exit, also after an error.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
from dataclasses import dataclass, field

# MPICH over TCP on the namespace's loopback, one OpenMP thread per rank.
MPI_TCP_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo",
               "MPIR_CVAR_NOLOCAL": "1", "OMP_NUM_THREADS": "1"}
# Variables handed to the command (from the caller's environment, overridden by MPI_TCP_ENV).
PASSED_PREFIXES = ("MPIR_", "FI_", "OMP_", "PYTHONPATH")

_count = itertools.count()


def one_rank_per_node(ranks: int) -> list[str]:
    """``env`` assignments under which each of ``ranks`` ranks on this machine poses as its own
    node, as on a cluster with one rank per node: bagua_mpi's node-shared buckets would
    otherwise reduce through memory, past the shaped link. A rank alone on its node gives its
    CPU kernels every core, so their threads are set to one rank's share of this machine's
    (4 ranks of 2 kernel threads each on 2 cores made qsgd's and 1-bit Adam's steps 1.9x
    slower in ``algorithms.py --sweep``)."""
    threads = max(1, (os.cpu_count() or 1) // ranks)
    return ["BAGUA_MPI_RANKS_PER_NODE=1", f"BAGUA_MPI_KERNEL_THREADS={threads}"]


@dataclass
class ShapedLink:
    """A live shaped namespace: ``prefix + argv`` runs argv inside it with ``env`` set."""
    namespace: str
    gbit: float | None
    latency_ms: float
    env: dict = field(default_factory=dict)

    @property
    def prefix(self) -> list[str]:
        return (["ip", "netns", "exec", self.namespace, "env"]
                + [f"{k}={v}" for k, v in self.env.items()])

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(prefix + argv, check=True, **kwargs)``."""
        kwargs.setdefault("check", True)
        return subprocess.run(self.prefix + list(argv), **kwargs)


@contextlib.contextmanager
def shaped_link(gbit: float | None, latency_ms: float = 0.0, *, burst: str = "4mb",
                queue_latency: str = "500ms"):
    """Yield a ``ShapedLink`` whose loopback runs at ``gbit`` Gbit/s (None: unshaped).

    ``burst`` and ``queue_latency`` are tbf's ``burst`` and ``latency`` (the queue it may build).
    """
    ns = f"bagua_bench_{os.getpid()}" + (f"_{n}" if (n := next(_count)) else "")
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        run = ["ip", "netns", "exec", ns]
        subprocess.run(run + ["ip", "link", "set", "lo", "up"], check=True)
        if gbit is not None:
            subprocess.run(run + ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:",
                                  "tbf", "rate", f"{gbit * 1000:g}mbit", "burst", burst,
                                  "latency", queue_latency], check=True)
            if latency_ms:
                subprocess.run(run + ["tc", "qdisc", "add", "dev", "lo", "parent", "1:1",
                                      "netem", "delay", f"{latency_ms}ms"], check=True)
        env = dict(os.environ, **MPI_TCP_ENV)
        env = {k: v for k, v in env.items() if k.startswith(PASSED_PREFIXES)}
        yield ShapedLink(ns, gbit, latency_ms, env)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
