"""Topology under the ranks-per-node override, and hierarchical vs flat allreduce.

Run with BAGUA_MPI_RANKS_PER_NODE=k: consecutive blocks of k ranks pose as nodes.
``checks.run_suite`` reports each check on its own line.
"""
import os
import sys

import torch

import bagua_mpi as bm
from checks import run_suite
from simulate import assert_same, rank_input, reduce_all


def check_ranks_and_sizes(rank, size):
    """Consecutive blocks of k ranks pose as nodes: local, cross and node sizes follow."""
    rpn = int(os.environ["BAGUA_MPI_RANKS_PER_NODE"])
    nodes = -(-size // rpn)
    assert bm.local_rank() == rank % rpn, (rank, bm.local_rank())
    assert bm.local_size() == min(rpn, size - (rank // rpn) * rpn)
    assert bm.cross_rank() == rank // rpn
    # ranks with my local rank: one per node that is big enough to have it
    assert bm.cross_size() == sum(1 for n in range(nodes) if n * rpn + rank % rpn < size)
    assert bm.mpi_threads_supported()


def check_hierarchical_and_flat(rank, size):
    """Both orders of reduction against the simulation, synchronous and asynchronous."""
    for dtype in ("float32", "float64", "int64", "bfloat16"):
        for op in ("sum", "average", "max", "min") if dtype != "int64" else ("sum", "product"):
            inputs = [rank_input(7, r, (1001,), dtype, op) for r in range(size)]
            expected = reduce_all(inputs, op)
            enum = {"sum": bm.Sum, "average": bm.Average, "max": bm.Max, "min": bm.Min,
                    "product": bm.Product}[op]
            flat = bm.allreduce(inputs[rank], enum, hierarchical=False)
            hier = bm.allreduce(inputs[rank], enum, hierarchical=True)
            assert_same(hier, expected, f"hierarchical {op} {dtype}")
            assert_same(flat, expected, f"flat {op} {dtype}")
            if dtype == "int64":  # integers: the two orders of summation must agree exactly
                assert torch.equal(hier, flat)
            mine = inputs[rank].clone()
            bm.synchronize(bm.allreduce_async_(mine, enum, hierarchical=True))
            assert_same(mine, expected, f"hierarchical async {op} {dtype}")


def check_default_switch(rank, size):
    """``set_hierarchical(True)`` makes a plain allreduce hierarchical."""
    before = bm.runtime.get().hierarchical
    bm.set_hierarchical(True)
    try:
        x = rank_input(9, rank, (10,), "float32")
        assert_same(bm.allreduce(x, bm.Sum),
                    reduce_all([rank_input(9, r, (10,), "float32") for r in range(size)], "sum"),
                    "default hierarchical")
    finally:
        bm.set_hierarchical(before)


# every check_ function above, by name
CHECKS = {name.removeprefix("check_").replace("_", "-"): fn
          for name, fn in list(globals().items()) if name.startswith("check_")}


if __name__ == "__main__":
    sys.exit(run_suite(CHECKS))
