"""Min-max over many tensors side by side (``numba_kernels.minmax_segments``) on the host: the
per-tensor calls' bytes, and the errors for segments that do not fit. (The device kernels
against the same calls: ``sim_kernels.py``, ``test_minmax_segments_equal_the_per_tensor_calls``.)
"""
import numpy as np
import pytest

import numba_kernels as nk
from numba_kernels.errors import KernelParameterError, LayoutError
from kernel_refs import minmax_payload
from row_refs import segment_layout


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("residual", [True, False])
def test_segments_write_the_per_tensor_bytes(rows, residual):
    chunk = 64
    specs = [(300, 3), (1, 8), (0, 2), (129, 1), (64, 5), (1000, 4)]
    segments, size, err_size, width, _ = segment_layout(specs, rows, chunk)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal(size).astype(np.float32)
    e = (rng.standard_normal(err_size) * 0.1).astype(np.float32) if residual else None
    ref_e, ref = (None if e is None else e.copy()), np.full((rows, width), 0xAB, np.uint8)
    for s in segments:
        part = -(-s.length // rows)
        nk.compress_minmax_rows(x[s.offset:s.offset + s.length], ref, s.col, bits=s.bits,
                                chunk=chunk, residual=None if ref_e is None else
                                ref_e[s.error_offset:s.error_offset + rows * part])
    got_e, got = (None if e is None else e.copy()), np.full((rows, width), 0xAB, np.uint8)
    nk.compress_minmax_rows_segments(x, segments, got, chunk=chunk, residual=got_e)
    np.testing.assert_array_equal(got, ref)
    if residual:
        np.testing.assert_array_equal(got_e, ref_e)
    out_ref, out = np.full(size, np.nan, np.float32), np.full(size, np.nan, np.float32)
    for s in segments:
        nk.decompress_rows(ref, nk.MinMaxFormat(-(-s.length // rows), s.bits, chunk), col=s.col,
                           out=out_ref[s.offset:s.offset + s.length])
    nk.decompress_minmax_rows_segments(ref, segments, out, chunk=chunk)
    np.testing.assert_array_equal(out, out_ref)     # the gaps stay NaN in both
    sums = [nk.MinMaxSegment(j * 1100, -(-s.length // rows), s.bits, s.col)
            for j, s in enumerate(segments)]
    sum_ref, summed = (np.zeros(1100 * len(sums), np.float32) for _ in range(2))
    for s in sums:
        nk.decompress_many(ref, nk.MinMaxFormat(s.length, s.bits, chunk), col=s.col, factor=0.25,
                           out=sum_ref[s.offset:s.offset + s.length])
    nk.decompress_minmax_segments(ref, sums, summed, chunk=chunk, factor=0.25)
    np.testing.assert_array_equal(summed, sum_ref)


def test_segments_that_do_not_fit_are_refused():
    x = np.zeros(100, np.float32)
    mat = np.zeros((2, 256), np.uint8)
    one = nk.MinMaxSegment(0, 50, 4, 8)
    cases = {"outside x": [nk.MinMaxSegment(60, 50, 4, 8)],
             "payload past the row": [nk.MinMaxSegment(0, 50, 8, 240)],
             "unaligned column": [nk.MinMaxSegment(0, 50, 4, 12)],
             "payloads overlap": [one, nk.MinMaxSegment(50, 50, 4, 16)]}
    for what, segments in cases.items():
        with pytest.raises(LayoutError):
            nk.compress_minmax_rows_segments(x, segments, mat, chunk=32)
        assert not mat.any(), f"{what}: something was written before the refusal"
    with pytest.raises(LayoutError, match="error memory"):
        nk.compress_minmax_rows_segments(x, [one, nk.MinMaxSegment(50, 50, 4, 64, 20)], mat,
                                         chunk=32, residual=np.zeros(100, np.float32))
    with pytest.raises(LayoutError, match="places in out"):
        nk.decompress_minmax_rows_segments(mat, [one, nk.MinMaxSegment(40, 50, 4, 64)], x,
                                           chunk=32)
    with pytest.raises(KernelParameterError):
        nk.compress_minmax_rows_segments(x, [nk.MinMaxSegment(0, 50, 9, 8)], mat, chunk=32)


def test_the_layouts_of_a_large_models_buckets_stay_checked():
    """A call's layout is checked once and kept: 256 buckets' layouts, over two steps, are
    checked 256 times and found 256 times (with room for 64, as before, every one was checked
    again at every step, and on a GPU its table copied to the device again)."""
    from numba_kernels import minmax_segments
    minmax_segments._layout.cache_clear()
    x, out = np.ones(300, np.float32), np.zeros((1, 512), np.uint8)
    for _ in range(2):
        for bucket in range(256):
            nk.compress_minmax_rows_segments(x, [nk.MinMaxSegment(0, 1 + bucket, 8, 0)], out,
                                             chunk=64)
    info = minmax_segments._layout.cache_info()
    assert (info.misses, info.hits) == (256, 256), info


@pytest.mark.parametrize("residual", [True, False])
def test_a_nan_makes_its_chunk_nan_in_every_segment(residual):
    """One NaN in each of some segments (a chunk's first element, the last element of a warp
    lane's fold, a partition's last): the chunk holding it stores NaN parameters (0x7FC00000)
    and codes 0 and decodes to NaN, in every form (encode, decode-sum, row decode), byte for
    byte the per-tensor calls' and the NumPy reference's; the other chunks and segments are
    as without the NaN."""
    rows, chunk = 2, 64
    specs = [(300, 3), (129, 1), (1000, 8), (64, 2), (45, 4)]
    segments, size, err_size, width, parts = segment_layout(specs, rows, chunk)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(size).astype(np.float32)
    e_old = (rng.standard_normal(err_size) * 0.1).astype(np.float32) if residual else None
    # (segment, element): chunk 0's first; in partition 1 of 65 elements, the last of lane 0's
    # fold of a 64-element chunk (lanes fold l, l + 32); the last element of partition 1 (of
    # 500) and of partition 1 of 32 (lane 31's); segment 4 untouched
    nans = [(0, 0), (1, 65 + 32), (2, 999), (3, 63)]
    y = x.copy()
    for j, i in nans:
        y[segments[j].offset + i] = np.nan
    mats = []
    for values in (x, y):
        mat = np.full((rows, width), 0xAB, np.uint8)
        e = None if e_old is None else e_old.copy()
        nk.compress_minmax_rows_segments(values, segments, mat, chunk=chunk, residual=e)
        ref_e, ref = (None if e_old is None else e_old.copy()), np.full((rows, width), 0xAB,
                                                                      np.uint8)
        for s, part in zip(segments, parts):
            nk.compress_minmax_rows(values[s.offset:s.offset + s.length], ref, s.col,
                                    bits=s.bits, chunk=chunk, residual=None if ref_e is None
                                    else ref_e[s.error_offset:s.error_offset + rows * part])
        np.testing.assert_array_equal(mat, ref)
        if residual:
            np.testing.assert_array_equal(e, ref_e)
        mats.append(mat)
    clean, mat = mats
    outs = []
    for m in (clean, mat):
        out = np.zeros(size, np.float32)
        nk.decompress_minmax_rows_segments(m, segments, out, chunk=chunk)
        outs.append(out)
    for j, (s, part) in enumerate(zip(segments, parts)):
        seg = y[s.offset:s.offset + s.length]
        padded = np.concatenate([seg, np.zeros(rows * part - s.length, np.float32)])
        c = padded if e_old is None else padded + e_old[s.error_offset:s.error_offset
                                                       + rows * part]
        fmt = nk.MinMaxFormat(part, s.bits, chunk)
        bad = np.zeros(s.length, bool)
        for k in range(rows):
            ref, _ = minmax_payload(c[k * part:(k + 1) * part], s.bits, chunk)
            np.testing.assert_array_equal(mat[k, s.col:s.col + fmt.nbytes], ref,
                                          err_msg=f"segment {j} row {k}")
        for jj, i in nans:
            if jj == j:
                k, r = divmod(i, part)
                first = k * part + r // chunk * chunk
                bad[first:min(k * part + part, first + chunk, s.length)] = True
        got, was = (o[s.offset:s.offset + s.length] for o in (outs[1], outs[0]))
        assert np.isnan(got[bad]).all() and not np.isnan(got[~bad]).any(), j
        np.testing.assert_array_equal(got[~bad], was[~bad])
    sums = [nk.MinMaxSegment(sum(parts[:j]), part, s.bits, s.col)
            for j, (s, part) in enumerate(zip(segments, parts))]
    summed, ref_sum = (np.zeros(sum(parts), np.float32) for _ in range(2))
    nk.decompress_minmax_segments(mat, sums, summed, chunk=chunk, factor=0.5)
    for s in sums:
        nk.decompress_many(mat, nk.MinMaxFormat(s.length, s.bits, chunk), col=s.col,
                           out=ref_sum[s.offset:s.offset + s.length], factor=0.5)
    np.testing.assert_array_equal(summed, ref_sum)
    assert np.isnan(summed).any() and not np.isnan(summed[sums[4].offset:]).any()
