"""Top-k over many tensors side by side (``numba_kernels.topk_segments``) on the host: the
per-tensor calls' bytes, and the errors for segments that do not fit. (The device kernels
against the same calls: ``sim_kernels.py``, ``test_topk_segments_equal_the_per_tensor_calls``.)
"""
import numpy as np
import pytest

import numba_kernels as nk
from numba_kernels import _sparse_rules
from numba_kernels.errors import KernelParameterError, LayoutError, PayloadError
from numba_kernels.wire import Payload
from row_refs import topk_segment_layout


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("residual", [True, False])
def test_segments_write_the_per_tensor_bytes(index_dtype, residual):
    """Selection (a segment above the approximate method's threshold among small ones), the
    merge of two ranks' messages, and the decode with and without the restore."""
    specs = [(40_000, 400), (300, 7), (1, 1), (0, 0), (129, 0), (64, 64), (1000, 33)]
    assert specs[0][0] >= _sparse_rules.APPROX_MIN_N   # the host's approximate method runs
    segments, size, r_size, width = topk_segment_layout(specs, index_dtype)
    rng = np.random.default_rng(5)
    xs = [rng.standard_t(2, size).astype(np.float32) for _ in range(2)]
    es = [(rng.standard_normal(r_size) * 0.1).astype(np.float32) if residual else None
          for _ in range(2)]
    fmts = [nk.TopKFormat(s.length, s.k, index_dtype) for s in segments]
    cols = [slice(s.col, s.col + f.nbytes) for s, f in zip(segments, fmts)]

    def residual_of(e, s):
        return None if e is None else e[s.residual_offset:s.residual_offset + s.length]
    refs, ref_es = [], []
    for x, e in zip(xs, es):
        ref, ref_e = np.full(width, 0xAB, np.uint8), None if e is None else e.copy()
        for s, c in zip(segments, cols):
            nk.compress_topk(x[s.offset:s.offset + s.length], s.k, index_dtype=index_dtype,
                             residual=residual_of(ref_e, s), out=ref[c])
        got, got_e = np.full(width, 0xAB, np.uint8), None if e is None else e.copy()
        nk.compress_topk_segments(x, segments, got, index_dtype, residual=got_e)
        np.testing.assert_array_equal(got, ref)
        if residual:
            np.testing.assert_array_equal(got_e, ref_e)
        refs.append(ref)
        ref_es.append(ref_e)
    merged_ref, merged = np.full(width, 0xAB, np.uint8), np.full(width, 0xCD, np.uint8)
    for s, f, c in zip(segments, fmts, cols):
        nk.merge_topk(Payload(f, refs[0][c]), Payload(f, refs[1][c]), s.k, out=merged_ref[c])
    nk.merge_topk_segments(refs[0], refs[1], segments, merged, index_dtype)
    for c in cols:   # the gaps between payloads are not the merge's
        np.testing.assert_array_equal(merged[c], merged_ref[c])
    out_ref, out = np.full(size, np.nan, np.float32), np.full(size, np.nan, np.float32)
    sel_ref, sel = merged_ref.copy(), merged_ref.copy()
    e_ref, e_got = (None, None) if not residual else (ref_es[0].copy(), ref_es[0].copy())
    for s, f, c in zip(segments, fmts, cols):
        if residual:
            nk.restore_unselected(residual_of(e_ref, s), Payload(f, refs[0][c]),
                                  Payload(f, sel_ref[c]))
        nk.scale_topk_values(Payload(f, sel_ref[c]), 0.5)
        nk.decompress(Payload(f, sel_ref[c]), out=out_ref[s.offset:s.offset + s.length])
    nk.decompress_topk_segments(sel, segments, out, index_dtype, factor=0.5, residual=e_got,
                                sent=refs[0] if residual else None)
    np.testing.assert_array_equal(out, out_ref)     # the gaps stay NaN in both
    np.testing.assert_array_equal(sel, sel_ref)
    if residual:
        np.testing.assert_array_equal(e_got, e_ref)


def test_segments_that_do_not_fit_are_refused():
    x, e = np.zeros(100, np.float32), np.zeros(100, np.float32)
    msg = np.zeros(256, np.uint8)
    one = nk.TopKSegment(0, 50, 4, 8)
    cases = {"outside x": [nk.TopKSegment(60, 50, 4, 8)],
             "payload past the message": [nk.TopKSegment(0, 50, 30, 64)],
             "unaligned column": [nk.TopKSegment(0, 50, 4, 12)],
             "payloads overlap": [one, nk.TopKSegment(50, 50, 4, 24)],
             "places overlap": [one, nk.TopKSegment(40, 50, 4, 64, 50)],
             "residuals overlap": [one, nk.TopKSegment(50, 50, 4, 64, 40)],
             "residual outside": [nk.TopKSegment(0, 50, 4, 8, 60)]}
    for what, segments in cases.items():
        with pytest.raises(LayoutError):
            nk.compress_topk_segments(x, segments, msg, residual=e)
        assert not msg.any() and not e.any(), f"{what}: something was written before the refusal"
    with pytest.raises(KernelParameterError):
        nk.compress_topk_segments(x, [(0, 50, 4, 8)], msg)
    with pytest.raises(KernelParameterError):   # k above the length
        nk.compress_topk_segments(x, [nk.TopKSegment(0, 5, 6, 8)], msg)
    with pytest.raises(PayloadError):
        nk.compress_topk_segments(x, [one], np.zeros(252, np.uint8))
    with pytest.raises(KernelParameterError):   # a restore takes both residual and sent
        nk.decompress_topk_segments(msg, [one], x, residual=e)
    with pytest.raises(PayloadError):
        nk.merge_topk_segments(msg, msg, [one], np.zeros(264, np.uint8))
    assert not msg.any() and not x.any() and not e.any()


def test_the_layouts_of_a_large_models_buckets_stay_checked():
    """As min-max's: 256 buckets' layouts over two steps are checked 256 times."""
    from numba_kernels import topk_segments
    topk_segments._layout.cache_clear()
    x, message = np.ones(300, np.float32), np.zeros(64, np.uint8)
    for _ in range(2):
        for bucket in range(256):
            nk.compress_topk_segments(x, [nk.TopKSegment(0, 1 + bucket, 1, 0)], message)
    info = topk_segments._layout.cache_info()
    assert (info.misses, info.hits) == (256, 256), info
