"""Single-process checks of node-shared gradient rows (``bagua_mpi/node_shared.py``); their
multi-rank behaviour is ``tests/mpi/shared_buckets_suite.py``'s."""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import bagua_mpi as bm
from bagua_mpi import node_shared


@pytest.fixture
def initialized():
    bm.init(abort_on_exception=False)
    yield
    bm.shutdown()


class _DirtyWindows:
    """mpi4py's MPI for node_shared, but a new shared window comes filled with 0xFF bytes (a NaN
    in every float): MPI does not promise zeroed memory, though MPICH's fresh pages are."""

    class Win:
        @staticmethod
        def Allocate_shared(size, disp_unit, *args, **kwargs):  # noqa: N802 - MPI's spelling
            win = MPI.Win.Allocate_shared(size, disp_unit, *args, **kwargs)
            memory, _ = win.Shared_query(0)
            np.frombuffer(memory, dtype=np.uint8)[:] = 0xFF
            return win

    def __getattr__(self, name):
        return getattr(MPI, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rank_row_starts_zeroed_whatever_the_mpi_hands_out(initialized, monkeypatch, dtype):
    """A bucket's row is padded past its gradients (ZeRO's partitions, the even length of pairs)
    and the padding must read zero, so the row is cleared however the window came."""
    monkeypatch.setattr(node_shared, "MPI", _DirtyWindows())
    rows = node_shared.SharedRows(bm.runtime.get().topo, 37, dtype)
    try:
        assert rows.tensor.dtype == dtype and rows.tensor.numel() == 37
        assert torch.equal(rows.tensor, torch.zeros(37, dtype=dtype)), rows.tensor
    finally:
        node_shared.free_all()
