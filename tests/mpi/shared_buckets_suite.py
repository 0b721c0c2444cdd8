"""Node-shared gradient buckets (bagua_mpi/node_shared.py) against a single-process oracle.

Every rank trains the same model on its own data. The oracle is computed without the library:
each rank runs a plain copy of the model on its batch, the ranks exchange those local gradients
with mpi4py's allgather, and NumPy averages them in float64. The synchronized gradients must
match it, be bit-identical on every rank, and agree with the MPI path
(BAGUA_MPI_SHARED_BUCKETS=0) to float32 rounding.

    mpiexec -n N python tests/mpi/shared_buckets_suite.py   (BAGUA_MPI_RANKS_PER_NODE=k: nodes)
"""
import copy
import os
import sys

import numpy as np
import torch
from mpi4py import MPI

import bagua_mpi as bm
from checks import run_suite

STEPS = 3


def model():
    torch.manual_seed(0)
    # small buckets (bucket_size_mb below) give several windows, one bucket per dtype kind
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48),
                               torch.nn.Tanh(), torch.nn.Linear(48, 5))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8 + rank, 32, generator=g), torch.randn(8 + rank, 5, generator=g)


def loss(net, x, y):
    return ((net(x) - y) ** 2).mean() * (1 + 0.5 * bm.rank())  # rank-dependent scale


def oracle_grads(net, x, y):
    """The average over ranks of each rank's local gradient, without bagua_mpi."""
    plain = copy.deepcopy(net)
    plain.zero_grad()
    loss(plain, x, y).backward()
    local = np.concatenate([p.grad.detach().double().numpy().ravel()
                            for p in plain.parameters()])
    return np.mean(MPI.COMM_WORLD.allgather(local), axis=0)


def train(shared: bool, compression="none", steps=STEPS, backend=None):
    os.environ["BAGUA_MPI_SHARED_BUCKETS"] = "1" if shared else "0"
    net = model()
    opt = bm.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                  named_parameters=net.named_parameters(), bucket_size_mb=0.01,
                                  compression=compression, backend=backend)
    grads, oracles = [], []
    for step in range(steps):
        x, y = batch(bm.rank(), step)
        oracles.append(oracle_grads(net, x, y))
        opt.zero_grad()
        loss(net, x, y).backward()
        opt.synchronize()
        grads.append(np.concatenate([p.grad.detach().double().numpy().ravel()
                                     for p in net.parameters()]))
        with opt.skip_synchronize():
            opt.step()
    return net, opt, grads, oracles


def expect_close(got, want, tol, what):
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    if not err <= tol:
        raise AssertionError(f"{what}: max relative error {err:.2e} > {tol:.0e}")


def identical_everywhere(vec, what):
    digests = MPI.COMM_WORLD.allgather(vec.tobytes())
    if any(d != digests[0] for d in digests):
        raise AssertionError(f"{what}: ranks hold different gradients")


def check_buckets_are_shared(rank, size):
    net, opt, _, _ = train(True, steps=1)
    buckets = opt._engine.buckets
    shared = [b.shared is not None for b in buckets]
    topo = bm.runtime.get().topo
    if topo.local_size > 1 and not all(shared):
        raise AssertionError(f"{len(buckets)} buckets, shared: {shared}")
    if len(buckets) < 2:
        raise AssertionError(f"expected several buckets, got {len(buckets)}")
    opt.close()


def check_average_matches_oracle(rank, size):
    _, opt, grads, oracles = train(True)
    for step, (g, o) in enumerate(zip(grads, oracles)):
        expect_close(g, o, 1e-6, f"step {step}")
        identical_everywhere(g, f"step {step}")
    opt.close()


def check_same_as_mpi_path(rank, size):
    _, opt_shared, shared, _ = train(True)
    _, opt_mpi, plain, _ = train(False)
    if any(b.shared is not None for b in opt_mpi._engine.buckets):
        raise AssertionError("BAGUA_MPI_SHARED_BUCKETS=0 still shared the buckets")
    for step, (a, b) in enumerate(zip(shared, plain)):
        expect_close(a, b, 1e-6, f"step {step}")
    opt_shared.close()
    opt_mpi.close()


def check_gloo_leaves_buckets_private(rank, size):
    """Only the MPI carrier reduces in node-shared rows: through gloo they would be allocated
    and never used."""
    _, opt, grads, oracles = train(True, backend="gloo")
    shared = [b.shared is not None for b in opt._engine.buckets]
    if any(shared):
        raise AssertionError(f"backend='gloo' allocated node-shared buckets: {shared}")
    for step, (g, o) in enumerate(zip(grads, oracles)):
        expect_close(g, o, 1e-6, f"gloo step {step}")
        identical_everywhere(g, f"gloo step {step}")
    opt.close()


def check_fp16_rounds_only_across_nodes(rank, size):
    _, opt, grads, oracles = train(True, compression="fp16")
    topo = bm.runtime.get().topo
    for step, (g, o) in enumerate(zip(grads, oracles)):
        identical_everywhere(g, f"fp16 step {step}")
        if topo.cross_size == 1:  # one node: no wire, the exact float32 sum
            expect_close(g, o, 1e-6, f"fp16 on one node, step {step}")
        else:
            expect_close(g, o, 2e-3, f"fp16 across nodes, step {step}")
    opt.close()


def check_grads_outlive_close_and_windows(rank, size):
    net, opt, grads, _ = train(True)
    opt.close()
    after_close = np.concatenate([p.grad.detach().double().numpy().ravel()
                                  for p in net.parameters()])
    if not np.array_equal(after_close, grads[-1]):
        raise AssertionError("gradients changed when the optimizer closed")
    from bagua_mpi import node_shared
    node_shared.free_all()  # what shutdown does: the windows go, p.grad must stay readable
    again = np.concatenate([p.grad.detach().double().numpy().ravel() for p in net.parameters()])
    if not np.array_equal(again, grads[-1]):
        raise AssertionError("gradients changed when the shared windows were freed")


CHECKS = {
    "buckets_are_shared": check_buckets_are_shared,
    "average_matches_oracle": check_average_matches_oracle,
    "same_as_mpi_path": check_same_as_mpi_path,
    "fp16_rounds_only_across_nodes": check_fp16_rounds_only_across_nodes,
    "gloo_leaves_buckets_private": check_gloo_leaves_buckets_private,
    "grads_outlive_close_and_windows": check_grads_outlive_close_and_windows,
}

if __name__ == "__main__":
    sys.exit(run_suite(CHECKS))
