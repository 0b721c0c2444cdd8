"""A peer exchange as the first use of the job's process group, at an odd world size.

A process group is made on its first use, and making it takes every rank of the communicator.
With random pairing at an odd world size one rank has no partner each step; it once skipped
the exchange, so where the exchange was the group's first use the others waited for it in the
group's set-up until the watchdog ended the job (``decentralized``'s default peers, through gloo
or NCCL, at 3, 5, 7... ranks).

    mpiexec -n 3 python first_exchange_suite.py primitive    # D_FP_S against a NumPy oracle
    mpiexec -n 3 python first_exchange_suite.py algorithm    # 3 steps; prints each rank's digest
    mpiexec -n 3 python first_exchange_suite.py every        # each registered algorithm's first
                                                             # steps on a group made for it

Nothing before it touches the process group: ``init`` and the optimizer's wrap talk over MPI.
"""
import hashlib
import sys

import numpy as np
import torch

import bagua_mpi as bm
from bagua_mpi import process_groups
from bagua_mpi.primitives.decentralized import (decentralized_average_, random_pairing,
                                                random_peers)

STEP, SEED = 2, 7


def own_model(rank: int) -> np.ndarray:
    return (np.arange(29, dtype=np.float32) * (rank + 1) - 3 * rank).astype(np.float32)


def primitive(rank: int, size: int) -> None:
    comm = bm.runtime.get().topo.comm
    flat = torch.from_numpy(own_model(rank).copy())
    decentralized_average_(flat, comm, random_peers(rank, size, STEP, SEED))
    partner = random_pairing(size, STEP, SEED)[rank]
    want = own_model(rank) if partner < 0 else (
        (own_model(rank).astype(np.float64) + own_model(partner)) / 2).astype(np.float32)
    assert np.array_equal(flat.numpy(), want), (rank, partner, flat.numpy(), want)
    alone = [r for r, p in enumerate(random_pairing(size, STEP, SEED)) if p < 0]
    if rank == 0:
        print(f"first exchange OK on {size} ranks (unpaired: {alone})", flush=True)


def algorithm(rank: int, size: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  algorithm=bm.algorithms.create("decentralized"))
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=data)).pow(2).sum().backward()
        opt.step()
    opt.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print(f"DIGEST rank {rank} {digest}", flush=True)


def every(rank: int, size: int) -> None:
    """Each registered algorithm trains with its exchanges as the first use of a process group:
    the groups are forgotten before each (``process_groups.reset``), so the next use makes a
    new one, as in a job that runs only that algorithm. Short warm-ups reach the compressed
    stages in the steps run."""
    options = {"onebit_adam": dict(warmup_steps=2), "lgreco": dict(warmup_steps=2,
                                                                  period_steps=2),
               "async": dict(sync_interval_ms=0, max_staleness=1)}
    for name in bm.algorithms.names():
        process_groups.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        inner = (torch.optim.Adam(model.parameters(), lr=1e-3) if name == "onebit_adam"
                 else torch.optim.SGD(model.parameters(), lr=0.05))
        opt = bm.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                      algorithm=bm.algorithms.create(name,
                                                                     **options.get(name, {})))
        data = torch.Generator().manual_seed(100 + rank)
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
            opt.step()
        opt.close()
        if rank == 0:
            print(f"first use OK: {name}", flush=True)


def main() -> int:
    bm.init()
    {"primitive": primitive, "algorithm": algorithm, "every": every}[sys.argv[1]](
        bm.rank(), bm.size())
    bm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
