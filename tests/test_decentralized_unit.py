"""The decentralized primitives' host arithmetic on its own: the same bits as the whole-array
expressions it replaced, which allocated arrays of the bucket's length at every step; and the
models the host D_FP_S refuses."""
import numpy as np
import pytest
import torch

from bagua_mpi.primitives.decentralized import (HOST_PIECE, _average_, _mix_,
                                                decentralized_average_)


@pytest.mark.parametrize("n_peers", [1, 2])
@pytest.mark.parametrize("n", [1000, HOST_PIECE, 2 * HOST_PIECE + 777])
def test_mix_in_pieces_matches_the_expression(n, n_peers):
    rng = np.random.default_rng([n, n_peers])
    x = rng.standard_normal(n).astype(np.float32)
    own = rng.standard_normal(n).astype(np.float32)
    seen = [rng.standard_normal(n).astype(np.float32) for _ in range(n_peers)]
    weight = np.float32(0.7 / (1 + n_peers))
    mix = np.zeros(n, dtype=np.float32)
    for h in seen:
        mix += h - own
    want = x + weight * mix
    work = rng.standard_normal(n).astype(np.float32)   # whatever it held before
    _mix_(x, own, seen, weight, work)
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("n_peers", [1, 2])
@pytest.mark.parametrize("n", [1000, HOST_PIECE, 2 * HOST_PIECE + 777])
def test_average_in_pieces_matches_the_expression(n, n_peers):
    """D_FP_S: own model in float64 plus each peer's, divided by 1 + peers, to float32."""
    rng = np.random.default_rng([n, n_peers, 1])
    x = rng.standard_normal(n).astype(np.float32)
    recvs = [rng.standard_normal(n).astype(np.float32) for _ in range(n_peers)]
    total = x.astype(np.float64)
    for r in recvs:
        total += r
    want = (total / (1 + n_peers)).astype(np.float32)
    _average_(x, recvs)
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32])
def test_host_average_refuses_what_numpy_cannot_average(dtype):
    """The host D_FP_S averages through NumPy, which sees bfloat16 as integers. Refused before
    any exchange (no communicator is needed to get the error)."""
    with pytest.raises(ValueError, match="float16, float32 or float64 tensor, got"):
        decentralized_average_(torch.zeros(8, dtype=dtype), None, [1])
