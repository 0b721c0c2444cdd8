"""gTop-k merges: union with summation and re-selection; restoring dropped values."""
import numpy as np
import pytest

import numba_kernels as nk
from kernel_refs import topk_indices


def reference_merge(pa, pb, k):
    """Dense sum of both payloads restricted to the union of their indices, then top-k."""
    n = pa.format.n
    dense = nk.decompress(pa) + nk.decompress(pb)
    support = np.union1d(pa.views()["indices"], pb.views()["indices"])
    masked = np.zeros(n, np.float32)
    masked[support] = dense[support]
    # among the support only: entries outside it must not compete, even at zero
    key = np.abs(masked[support]).view(np.uint32).astype(np.int64)
    keep = np.sort(support[np.lexsort((support, -key))[:k]])
    return keep, dense[keep]


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("kind", ["normal", "ties", "cancel"])
@pytest.mark.parametrize("n, k", [(1, 1), (33, 5), (1025, 40), (10**5, 100)])
def test_merge_matches_reference(index_dtype, kind, n, k, rng):
    if kind == "normal":
        xa, xb = rng.standard_normal(n), rng.standard_normal(n)
    elif kind == "ties":
        xa, xb = rng.integers(-3, 4, n), rng.integers(-3, 4, n)
    else:                                 # b cancels a exactly on the shared support
        xa = rng.standard_normal(n)
        xb = -xa
    xa, xb = xa.astype(np.float32), xb.astype(np.float32)
    pa = nk.compress_topk(xa, k, index_dtype=index_dtype)
    pb = nk.compress_topk(xb, k, index_dtype=index_dtype)
    m = nk.merge_topk(pa, pb)
    idx, val = reference_merge(pa, pb, k)
    np.testing.assert_array_equal(m.views()["indices"], idx)
    np.testing.assert_array_equal(m.views()["values"], val)
    assert m.format == pa.format


def test_merge_with_smaller_k_and_errors(rng):
    xa = rng.standard_normal(100).astype(np.float32)
    pa, pb = nk.compress_topk(xa, 10), nk.compress_topk(-2 * xa, 10)
    m = nk.merge_topk(pa, pb, k=3)
    np.testing.assert_array_equal(m.views()["indices"], topk_indices(-xa, 3))
    with pytest.raises(nk.KernelParameterError, match="k must be"):
        nk.merge_topk(pa, pb, k=11)
    with pytest.raises(nk.PayloadError, match="different tensors"):
        nk.merge_topk(pa, nk.compress_topk(xa[:50], 10))
    with pytest.raises(nk.PayloadError, match="top-k"):
        nk.merge_topk(pa, nk.compress_minmax(xa))


def test_gtopk_tree_round_and_restore(rng):
    """One gTop-k step for 3 ranks (not a power of two): feedback, tree merges, restore."""
    n, k, ranks = 2000, 20, 3
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(ranks)]
    resid = [np.zeros(n, np.float32) for _ in range(ranks)]
    sent = [nk.compress_topk(g, k, residual=r) for g, r in zip(grads, resid)]
    merged = nk.merge_topk(nk.merge_topk(sent[0], sent[1]), sent[2])
    kept = merged.views()["indices"]
    for g, r, s in zip(grads, resid, sent):
        nk.restore_unselected(r, s, merged)
        mine = s.views()["indices"]
        shipped = np.intersect1d(mine, kept)
        # entries that made it into the global set are gone from the residual ...
        assert (r[shipped] == 0).all()
        # ... and everything else is back where it was
        rest = np.setdiff1d(np.arange(n), shipped)
        np.testing.assert_array_equal(r[rest], g[rest])


def test_scale_topk_stack_is_each_rows_scale(rng):
    """One call scales every row's values as ``scale_topk_values`` on each row, and leaves the
    indices and the padding (int64 indices, odd k) alone; a stack at a column of wider rows
    too. Other formats are refused."""
    k, rows = 7, 3
    payloads = [nk.compress_topk(rng.standard_normal(100).astype(np.float32), k,
                                 index_dtype="int64") for _ in range(rows)]
    fmt = payloads[0].format
    assert fmt.nbytes > fmt.used_nbytes
    stack = np.stack([p.buffer for p in payloads])
    wide = np.zeros((rows, 16 + fmt.nbytes + 8), np.uint8)
    wide[:, 16:16 + fmt.nbytes] = stack
    expected = stack.copy()
    for r in range(rows):
        nk.scale_topk_values(nk.Payload(fmt, expected[r]), 0.25)
    assert not np.array_equal(expected, stack)
    nk.scale_topk_stack(stack, fmt, 0.25)
    np.testing.assert_array_equal(stack, expected)
    nk.scale_topk_stack(wide, fmt, 0.25, col=16)
    np.testing.assert_array_equal(wide[:, 16:16 + fmt.nbytes], expected)
    assert not wide[:, :16].any() and not wide[:, 16 + fmt.nbytes:].any()
    with pytest.raises(nk.PayloadError, match="TopKFormat"):
        nk.scale_topk_stack(stack, nk.MinMaxFormat(100, 8, 32), 0.5)
