"""Model-parallel bookkeeping without MPI: cuts, exchange plans, the locally connected layer."""
import numpy as np
import pytest
import torch
from torch import nn

from bagua_mpi import BaguaMPIError
from bagua_mpi import distbelief as db


def test_split_units_is_balanced_and_covers():
    assert db.split_units(10, 4) == [0, 3, 6, 8, 10]
    assert db.split_units(5, 5) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(db.PartitionError, match="6 partitions for 5 units"):
        db.split_units(5, 6)


def test_partition_error_is_a_library_error_and_a_value_error():
    assert issubclass(db.PartitionError, BaguaMPIError)
    assert issubclass(db.PartitionError, ValueError)


def test_exchange_plan_sends_each_needed_unit_once():
    owns = [(0, 3), (3, 6), (6, 9)]
    needs = [(0, 4), (2, 7), (5, 9)]
    plan = db.exchange_plan(needs, owns)
    got = {(t.src, t.dst, t.lo, t.hi) for t in plan}
    assert got == {(1, 0, 3, 4), (0, 1, 2, 3), (2, 1, 6, 7), (1, 2, 5, 6)}
    with pytest.raises(db.PartitionError, match="hold only"):
        db.exchange_plan([(0, 10)], [(0, 9)])


def test_replica_groups_must_divide_the_workers():
    assert db.check_replicas(6, 3) == 2
    with pytest.raises(db.PartitionError, match="5 worker rank.* cannot form replicas of 2"):
        db.check_replicas(5, 2)


def test_locally_connected_with_tied_weights_is_a_convolution():
    """Independent oracle: with the same filter at every position it must equal conv2d."""
    torch.manual_seed(0)
    lc = db.LocallyConnected2d(3, 4, (9, 8), 3, stride=2).double()
    conv = nn.Conv2d(3, 4, 3, stride=2).double()
    with torch.no_grad():
        lc.weight.copy_(conv.weight.reshape(4, -1).expand_as(lc.weight))
        lc.bias.copy_(conv.bias[:, None, None].expand_as(lc.bias))
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    assert torch.allclose(lc(x), conv(x), atol=1e-12)
    # a block of rows computed from its receptive field equals those rows of the full output
    a, b = 1, 3
    lo, hi = lc.needs(a, b)
    assert torch.allclose(lc.block(a, b)(x[:, :, lo:hi]), lc(x)[:, :, a:b], atol=1e-12)


def test_linear_blocks_compute_their_output_features():
    torch.manual_seed(1)
    lin = db.LinearBlocks(nn.Linear(5, 7))
    x = torch.randn(3, 5)
    assert torch.allclose(lin.block(2, 6)(x), lin(x)[:, 2:6])
    assert lin.needs(2, 6) == (0, 5)


def test_check_bounds_messages_name_the_values():
    from bagua_mpi.distbelief.model_parallel.partition import check_bounds
    with pytest.raises(db.PartitionError, match=r"\[0, 2, 5\] do not cover the 6 units"):
        check_bounds([0, 2, 5], 6, 2)
    with pytest.raises(db.PartitionError, match=r"leave partition\(s\) \[1\] with no unit"):
        check_bounds([0, 3, 3, 6], 6, 3)
    with pytest.raises(db.PartitionError, match="need 3 bounds"):
        check_bounds([0, 6], 6, 2)
    assert check_bounds(None, 7, 3) == [0, 3, 5, 7]
    assert np.array_equal(check_bounds(np.array([0, 4, 7]), 7, 2), [0, 4, 7])
