"""Device kernels against their CPU twins, shared by the simulator and real-GPU tests.

Each check compresses the same data on the host (CPU twin) and on the device
(CUDA kernel) and requires bitwise-equal payloads, residuals and decoded
outputs: every kernel is deterministic by construction (fixed summation
order, explicit FMAs, counter-based RNG, order-preserving selection).
"""
import numpy as np
from numba import cuda

import numba_kernels as nk
from numba_kernels import _sparse_rules
from numba_kernels.wire import Payload
from row_refs import (COL, at_column, loop_decode, partition_loop, payload_stack, row_form,
                      row_format, row_matrix, segment_layout, topk_segment_layout)


def _data(seed, n, dtype, kind="normal"):
    rng = np.random.default_rng(seed)
    if kind == "ties":
        return rng.integers(-3, 4, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _same(host, dev, what):
    got = dev.copy_to_host() if hasattr(dev, "copy_to_host") else np.asarray(dev)
    np.testing.assert_array_equal(got, host, err_msg=what)


def _both(compress, x, with_residual, seed=1):
    """Run ``compress`` on host and device copies; compare payloads, residuals, decodes."""
    e = _data(seed + 1000, x.size, x.dtype) * x.dtype.type(0.1) if with_residual else None
    eh = None if e is None else e.copy()
    ed = None if e is None else cuda.to_device(e)
    ph = compress(x, eh)
    pd = compress(cuda.to_device(x), ed)
    assert pd.format == ph.format and pd.on_device and not ph.on_device
    _same(ph.buffer, pd.buffer, f"payload {ph.format}")
    if e is not None:
        _same(eh, ed, f"residual {ph.format}")
    _same(nk.decompress(ph), nk.decompress(pd), f"decode {ph.format}")
    return ph, pd


def check_decode_many(ph, rows=3):
    """decompress_many of a stack on the device equals the host, with and without accumulate."""
    stack = np.stack([ph.buffer] * rows)
    n = ph.format.n
    _same(nk.decompress_many(stack, ph.format),
          nk.decompress_many(cuda.to_device(stack), ph.format), "decompress_many")
    base = _data(5, n, np.float64)
    host = base.copy()
    nk.decompress_many(stack, ph.format, out=host, accumulate=True)
    dev = cuda.to_device(base)
    nk.decompress_many(cuda.to_device(stack), ph.format, out=dev, accumulate=True)
    _same(host, dev, "decompress_many accumulate")


def check_decode_at_column(cases, n, rows, col):
    """(id, compressor, kwargs) cases (``row_refs.registry_cases``): on the device,
    decompress_many of host payloads (different data in each row) at byte column ``col`` of
    wider rows of random bytes gives the bytes of the host's decode of the contiguous stack,
    with and without accumulate, and leaves the rows as they were."""
    for what, compress, kw in cases:
        fmt, stack = payload_stack(compress, kw, n, rows, seed=[rows, col])
        mat = at_column(stack, col, seed=col + 1)
        dmat = cuda.to_device(mat)
        _same(nk.decompress_many(stack, fmt), nk.decompress_many(dmat, fmt, col=col),
              f"decompress_many at column {col}: {what}")
        base = _data(5, n, np.float32)
        host = base.copy()
        nk.decompress_many(stack, fmt, out=host, accumulate=True)
        dev = cuda.to_device(base)
        nk.decompress_many(dmat, fmt, out=dev, accumulate=True, col=col)
        _same(host, dev, f"decompress_many accumulate at column {col}: {what}")
        _same(mat, dmat, f"rows untouched: {what}")
        # factor: the decoder stores the sum times the float32 factor, the bytes of the host's
        # sum scaled afterwards (1/3: inexact in float32, so a rounding slip would show)
        scaled = nk.decompress_many(stack, fmt) * np.float32(1 / 3)
        _same(scaled, nk.decompress_many(stack, fmt, factor=1 / 3),
              f"host decompress_many factor: {what}")
        _same(scaled, nk.decompress_many(dmat, fmt, col=col, factor=1 / 3),
              f"device decompress_many factor at column {col}: {what}")


def check_casts(cases, many=True):
    for n, kind, dtype in cases:
        ph, _ = _both(lambda x, e: nk.compress_cast(x, kind, residual=e), _data(n, n, dtype) * 300,
                      True)
        if many:
            check_decode_many(ph)


def half_codes(every=False):
    """binary16/bfloat16 bit patterns: all 65536, or (``every=False``) both signs of every
    exponent with eight mantissas each (infinities and NaNs with payloads among them) and every
    subnormal and zero."""
    if every:
        return np.arange(1 << 16, dtype=np.uint16)
    mant = np.array([0, 1, 2, 0x155, 0x200, 0x2AA, 0x3FE, 0x3FF], np.uint16)
    normal = (np.arange(64, dtype=np.uint16)[:, None] << 10) | mant
    sub = np.arange(1 << 10, dtype=np.uint16)
    return np.concatenate([normal.ravel(), sub, sub | 0x8000])


def _same_bits(host, dev, what):
    """Bitwise equal where the host has a number; a NaN where it has a NaN (a GPU's arithmetic
    returns one canonical NaN, x86 keeps the payload)."""
    got = dev.copy_to_host() if hasattr(dev, "copy_to_host") else np.asarray(dev)
    nan = np.isnan(host)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN positions")
    bits = np.uint32 if host.dtype == np.float32 else np.uint64
    np.testing.assert_array_equal(got[~nan].view(bits), host[~nan].view(bits), err_msg=what)


def check_cast_codes(every=False):
    """Every sign, exponent class and subnormal of both 16-bit kinds decodes on the device to
    the CPU twin's bits, into float32 and float64, a row alone and two rows summed; the host's
    fp16 decode is NumPy's float16 conversion, bit for bit."""
    codes = half_codes(every)
    for kind in ("fp16", "bf16"):
        fmt = nk.CastFormat(codes.size, kind)
        rows = np.zeros((2, fmt.nbytes), np.uint8)
        rows[0, :fmt.used_nbytes] = codes.view(np.uint8)
        rows[1, :fmt.used_nbytes] = codes[::-1].copy().view(np.uint8)
        if kind == "fp16":
            _same_bits(codes.view(np.float16).astype(np.float32),
                       nk.decompress_many(rows[:1], fmt), "fp16 codes on the host against NumPy")
        for dtype in (np.float32, np.float64):
            for stack in (rows[:1], rows):
                host = np.empty(codes.size, dtype)
                nk.decompress_many(stack, fmt, out=host)
                dev = cuda.device_array(codes.size, dtype)
                nk.decompress_many(cuda.to_device(stack), fmt, out=dev)
                _same_bits(host, dev, f"{kind} codes, {len(stack)} rows, {np.dtype(dtype)}")


def check_minmax(cases, many=True):
    for n, bits, chunk, dtype, res in cases:
        ph, _ = _both(lambda x, e: nk.compress_minmax(x, bits, chunk, residual=e),
                      _data(n, n, dtype), res)
        if many:
            check_decode_many(ph)


NAN_BITS = 0x7FC00000     # the quiet NaN a min-max payload stores for a NaN range


def check_minmax_nan(n, chunk, positions, cases, many=False):
    """One NaN at each of ``positions`` (one a chunk at most) in n elements, compressed at each
    of the (bits, dtype, residual) ``cases``: the device's payload, residual and decode are
    the CPU twin's, byte for byte (``_both``), the chunks holding a NaN storing NaN parameters
    (0x7FC00000) and decoding to NaN on both, the others finite. With ``many``, the first
    case's payload stacked and decoded as ``check_decode_many``."""
    for j, (bits, dtype, res) in enumerate(cases):
        x = _data(n + bits, n, dtype)
        x[list(positions)] = np.nan
        ph, _ = _both(lambda x, e: nk.compress_minmax(x, bits, chunk, residual=e), x, res)
        params = ph.views()["params"].view(np.uint32).reshape(-1, 2)
        bad = sorted({p // chunk for p in positions})
        assert (params[bad] == NAN_BITS).all(), params[bad]
        out = nk.decompress(ph)
        mask = np.isin(np.arange(n) // chunk, bad)
        assert np.isnan(out[mask]).all() and not np.isnan(out[~mask]).any()
        if many and j == 0:
            check_decode_many(ph)


def check_minmax_infinities(bits, chunk=64):
    """Infinities: a chunk with a +inf, one with a -inf, one with both and one of +inf alone
    (a NaN scale, stored as 0x7FC00000) before a finite chunk: the device's payload and decode
    are the CPU twin's (codes 0, every such chunk NaN)."""
    x = _data(9, 5 * chunk, np.float32)
    x[3] = np.inf
    x[chunk + 5] = -np.inf
    x[2 * chunk], x[3 * chunk - 1] = np.inf, -np.inf
    x[3 * chunk:4 * chunk] = np.inf
    ph, _ = _both(lambda x, e: nk.compress_minmax(x, bits, chunk, residual=e), x, True)
    assert ph.views()["params"].view(np.uint32)[7] == NAN_BITS
    out = nk.decompress(ph)
    assert np.isnan(out[:4 * chunk]).all() and np.isfinite(out[4 * chunk:]).all()


def check_signed_zero_minimum():
    """A chunk whose minimum is a zero of either sign stores +0.0 on both targets."""
    x = np.array([0.0, -0.0, 2.0] * 20, np.float32)
    ph, pd = _both(lambda x, e: nk.compress_minmax(x, 8, 32, residual=e), x, False)
    assert (ph.views()["params"][0::2].view(np.uint32) == 0).all()


def check_qsgd(cases, many=True):
    for n, levels, chunk, dtype, res in cases:
        ph, _ = _both(lambda x, e: nk.compress_qsgd(x, levels, chunk, seed=7, residual=e),
                      _data(n, n, dtype), res)
        if many:
            check_decode_many(ph)


def check_onebit(cases, many=True):
    for n, chunk, scale, dtype, res in cases:
        ph, _ = _both(lambda x, e: nk.compress_onebit(x, chunk, scale, residual=e),
                      _data(n, n, dtype), res)
        if many:
            check_decode_many(ph)


def check_topk(cases, approx_min_n=None, many=True):
    """(n, k, kind, dtype, method, residual) cases; method 'exact', 'approx' or 'randk'.

    ``approx_min_n`` lowers the size from which both targets take the approximate method."""
    saved = _sparse_rules.APPROX_MIN_N
    if approx_min_n is not None:
        _sparse_rules.APPROX_MIN_N = approx_min_n
    try:
        for n, k, kind, dtype, method, res in cases:
            x = _data(n + k, n, dtype, kind)
            if method == "randk":
                fn = lambda x, e: nk.compress_randk(x, k, seed=3, residual=e)   # noqa: E731
            else:
                fn = lambda x, e: nk.compress_topk(x, k, method=method, residual=e)  # noqa: E731
            ph, _ = _both(fn, x, res)
            if many:
                check_decode_many(ph)
    finally:
        _sparse_rules.APPROX_MIN_N = saved


def check_approx_path(n, k, kind="normal"):
    """Each way the device's approximate method can go equals the host's exact top-k (indices,
    values and residual): the sampled threshold holds (the selection runs on the candidates),
    it is too high (fewer than k candidates) or too low (more than the capacity), where the
    device selects over the whole array, having decided so itself."""
    from numba_kernels._cuda import select
    from numba_kernels._cuda import topk as dev_topk
    x = _data(11, n, np.float32, kind)
    e = _data(12, n, np.float32, kind) * np.float32(0.1)
    real = dev_topk.sample_plan
    m, ks, cap = real(n, k)
    plans = {"sample holds": ((m, ks, cap), 1), "too few": ((m, 1, cap), 0),
             "too many": ((m, ks, k), 0)}
    try:
        for what, (plan, mode) in plans.items():
            dev_topk.sample_plan = lambda n_, k_, plan=plan: plan          # noqa: E731
            idx = cuda.device_array(k, np.int32)
            val = cuda.device_array(k, np.float32)
            eh = e.copy()
            ed = cuda.to_device(x + e)    # c = x + e, formed in place as compress_topk does
            state = dev_topk._approx(ed, n, k, idx, val, ed, 0).copy_to_host()
            assert state[select.MODE] == mode, f"{what}: mode {state[select.MODE]}"
            ph = nk.compress_topk(x, k, method="exact", residual=eh)
            _same(ph.views()["indices"], idx, f"approx indices ({what})")
            _same(ph.views()["values"], val, f"approx values ({what})")
            _same(eh, ed, f"approx residual ({what})")
    finally:
        dev_topk.sample_plan = real


def check_merge(cases):
    for n, k, kind in cases:
        xa, xb = _data(1, n, np.float32, kind), _data(2, n, np.float32, kind)
        pa, pb = nk.compress_topk(xa, k), nk.compress_topk(xb, k)
        da = Payload(pa.format, cuda.to_device(pa.buffer))
        db = Payload(pb.format, cuda.to_device(pb.buffer))
        mh, md = nk.merge_topk(pa, pb), nk.merge_topk(da, db)
        _same(mh.buffer, md.buffer, "merge_topk")
        rh = np.zeros(n, np.float32)
        rd = cuda.to_device(rh)
        nk.restore_unselected(rh, pa, mh)
        nk.restore_unselected(rd, da, md)
        _same(rh, rd, "restore_unselected")


def check_scale_topk_stack(n, k, rows, col=24, factor=0.3):
    """``scale_topk_stack`` on a (rows, nbytes) stack and at byte column ``col`` of wider rows,
    host == device == each payload's values times the float32 factor, nothing else touched."""
    payloads = [nk.compress_topk(_data(40 + r, n, np.float32), k) for r in range(rows)]
    fmt = payloads[0].format
    stack = np.stack([p.buffer for p in payloads])
    wide = np.random.default_rng(7).integers(0, 256, (rows, col + fmt.nbytes + 8), np.uint8)
    wide[:, col:col + fmt.nbytes] = stack
    for host, at in ((stack, 0), (wide, col)):
        expected = host.copy()
        for r in range(rows):   # each payload's values, scaled in place through its views
            fmt.views(expected[r, at:at + fmt.nbytes])["values"][:] *= np.float32(factor)
        dev = cuda.to_device(host)
        nk.scale_topk_stack(host, fmt, factor, col=at)
        nk.scale_topk_stack(dev, fmt, factor, col=at)
        _same(expected, host, f"host scale_topk_stack at column {at}")
        _same(expected, dev, f"device scale_topk_stack at column {at}")


def check_rows(cases, dtype=np.float32):
    """(name, kwargs, rows, part, residual[, short]) cases: on the host and on the device, the
    row form writes the per-partition calls' payload bytes (and nothing outside its columns)
    and residuals, and ``decompress_rows`` gives their decodes; host == device throughout.
    With ``short``, the row forms take a tensor that many elements short of rows * part (read
    as zeros past its end) and decode up to its end; the per-partition calls take it
    zero-padded."""
    for case in cases:
        name, kw, rows, part, res = case[:5]
        short = case[5] if len(case) > 5 else 0
        length = rows * part - short
        what = (f"{name} {kw} rows={rows} part={part} residual={res} short={short} "
                f"{np.dtype(dtype)}")
        x = _data(rows * 100 + part, rows * part, dtype)
        x[length:] = 0                   # the zero padding that the per-partition calls take
        e = _data(part + 7, rows * part, dtype) * dtype(0.1) if res else None
        fmt = row_format(name, kw, part)
        copy = (lambda a: None if a is None else a.copy())                   # noqa: E731
        copy_to_device = (lambda a: None if a is None else cuda.to_device(a))  # noqa: E731
        # host: the per-partition loop, then the row form
        hl_x, hl_e, hl = x.copy(), copy(e), row_matrix(rows, fmt)
        partition_loop(name, kw, hl_x, hl_e, hl)
        hr_x, hr_e, hr = x[:length].copy(), copy(e), row_matrix(rows, fmt)
        assert row_form(name, kw, hr_x, hr_e, hr) == fmt, what
        _same(hl, hr, f"host row-form payloads: {what}")
        _same(hl_x[:length], hr_x, f"host x untouched: {what}")
        if res:
            _same(hl_e, hr_e, f"host row-form residual: {what}")
        decoded = loop_decode(fmt, hl)
        _same(decoded, nk.decompress_rows(hr, fmt, col=COL), f"host decompress_rows: {what}")
        if short:
            _same(decoded[:length], nk.decompress_rows(hr, fmt, out=np.empty(length, np.float32),
                                                       col=COL), f"host short decode: {what}")
        # device: the per-partition loop, then the row form
        dl_e, dl = copy_to_device(e), cuda.to_device(row_matrix(rows, fmt))
        partition_loop(name, kw, cuda.to_device(x), dl_e, dl)
        dr_e, dr = copy_to_device(e), cuda.to_device(row_matrix(rows, fmt))
        row_form(name, kw, cuda.to_device(x[:length]), dr_e, dr)
        _same(hl, dl, f"device per-partition payloads: {what}")
        _same(hl, dr, f"device row-form payloads: {what}")
        if res:
            _same(hl_e, dl_e, f"device per-partition residual: {what}")
            _same(hl_e, dr_e, f"device row-form residual: {what}")
        out = cuda.to_device(np.full(length + 1, np.nan, np.float32))
        nk.decompress_rows(dr, fmt, out=out[:length], col=COL)
        got = out.copy_to_host()
        _same(decoded[:length], got[:length], f"device decompress_rows: {what}")
        assert np.isnan(got[length]), f"device decompress_rows wrote past out's end: {what}"
        for k in range(rows):      # and the device's own per-partition decode
            row = cuda.to_device(np.ascontiguousarray(hl[k:k + 1, COL:COL + fmt.nbytes]))
            _same(decoded[k * part:(k + 1) * part], nk.decompress_many(row, fmt),
                  f"device decompress_many: {what}")


def check_minmax_segments(specs, rows, residual, chunk, nans=()):
    """``numba_kernels.minmax_segments`` against the per-tensor calls on the host, byte for
    byte: the encoder's payloads (and nothing written between them) and error memories, the
    server's decode-sum of each segment's payloads in every row, and the decode of each
    segment's rows into its place (the gaps between places untouched); on the device, one
    launch each (chunks up to 4096); the host form too. ``specs``: (length, bits) of each
    segment; ``nans``: (segment, element) pairs set to NaN (their chunks then decode to NaN:
    checked)."""
    what = f"segments {specs} rows={rows} residual={residual} chunk={chunk} nans={nans}"
    segments, size, err_size, width, parts = segment_layout(specs, rows, chunk)
    x = _data(size + rows, size, np.float32) * np.float32(3)
    for j, i in nans:
        x[segments[j].offset + i] = np.nan
    e = _data(err_size, err_size, np.float32) * np.float32(0.1) if residual else None
    sentinel = np.full((rows, width), 0xAB, np.uint8)
    # the reference: compress_minmax_rows of each segment on its own slices
    ref_e, ref = (None if e is None else e.copy()), sentinel.copy()
    for s, part in zip(segments, parts):
        nk.compress_minmax_rows(x[s.offset:s.offset + s.length], ref, s.col, bits=s.bits,
                                chunk=chunk, residual=None if ref_e is None else
                                ref_e[s.error_offset:s.error_offset + rows * part])
    # the server's sum of each segment's payloads, and each segment's rows decoded
    sums = [nk.MinMaxSegment(sum(parts[:j]), part, s.bits, s.col)
            for j, (s, part) in enumerate(zip(segments, parts))]
    ref_sum = np.zeros(sum(parts), np.float32)
    for s in sums:
        nk.decompress_many(ref, nk.MinMaxFormat(s.length, s.bits, chunk), col=s.col,
                           out=ref_sum[s.offset:s.offset + s.length], factor=0.5)
    ref_out = np.full(size, np.nan, np.float32)
    for s, part in zip(segments, parts):
        nk.decompress_rows(ref, nk.MinMaxFormat(part, s.bits, chunk), col=s.col,
                           out=ref_out[s.offset:s.offset + s.length])
    for j, i in nans:       # the NaN's chunk decodes to NaN: the rule holds in the reference
        s, part = segments[j], parts[j]
        k, r = divmod(i, part)      # its partition, and its place there
        first, stop = k * part + r // chunk * chunk, k * part + min(part, (r // chunk + 1) * chunk)
        assert np.isnan(ref_out[s.offset + first:s.offset + min(stop, s.length)]).all(), (j, i)
    copy = (lambda a: None if a is None else a.copy())                      # noqa: E731
    copy_to_device = (lambda a: None if a is None else cuda.to_device(a))   # noqa: E731
    for place, put in (("host", copy), ("device", copy_to_device)):
        got_e, got = put(e), put(sentinel)
        before = nk.launch_count()
        nk.compress_minmax_rows_segments(put(x), segments, got, chunk=chunk, residual=got_e)
        encode_launches = nk.launch_count() - before
        _same(ref, got, f"{place} payloads: {what}")
        if residual:
            _same(ref_e, got_e, f"{place} error memories: {what}")
        got_sum = put(np.full(sum(parts), np.nan, np.float32))
        before = nk.launch_count()
        nk.decompress_minmax_segments(put(ref), sums, got_sum, chunk=chunk, factor=0.5)
        sum_launches = nk.launch_count() - before
        _same(ref_sum, got_sum, f"{place} decode-sum: {what}")
        got_out = put(np.full(size, np.nan, np.float32))
        before = nk.launch_count()
        nk.decompress_minmax_rows_segments(put(ref), segments, got_out, chunk=chunk)
        rows_launches = nk.launch_count() - before
        _same(ref_out, got_out, f"{place} decode of the rows: {what}")
        if place == "device" and chunk <= 4096:
            assert (encode_launches, sum_launches, rows_launches) == (1, 1, 1), \
                f"launches {encode_launches}, {sum_launches}, {rows_launches}: {what}"


def check_topk_segments(specs, residual, index_dtype="int32", kind="normal", factor=0.25,
                        one_launch=True):
    """``numba_kernels.topk_segments`` against the per-tensor calls on the host, byte for byte:
    two ranks' messages (and nothing written between their payloads) and residuals, their merge,
    and the decode of the merge (what the selection dropped restored, the values scaled in
    place, the gaps between places untouched), also with the sent message as the selected one
    (one rank); on the device, one launch each (``one_launch``: every segment fits a block).
    ``specs``: (length, k) of each segment."""
    what = f"segments {specs} residual={residual} {index_dtype} {kind}"
    segments, size, r_size, width = topk_segment_layout(specs, index_dtype)
    fmts = [nk.TopKFormat(s.length, s.k, index_dtype) for s in segments]
    cols = [slice(s.col, s.col + f.nbytes) for s, f in zip(segments, fmts)]
    xs = [_data(7 + r, size, np.float32, kind) * np.float32(1 + r) for r in range(2)]
    es = [_data(70 + r, r_size, np.float32) * np.float32(0.1) if residual else None
          for r in range(2)]
    copy = (lambda a: None if a is None else a.copy())                      # noqa: E731
    sentinel = np.full(width, 0xAB, np.uint8)

    def places(a):   # each segment's slice of a base array
        return [a[s.offset:s.offset + s.length] for s in segments]

    def residuals(e):
        return [e[s.residual_offset:s.residual_offset + s.length] for s in segments]

    # the reference: the per-tensor calls on each segment's slices
    ref_e, ref_msgs = [copy(e) for e in es], [sentinel.copy() for _ in range(2)]
    for x, e, msg in zip(xs, ref_e, ref_msgs):
        for s, f, c, xp, ep in zip(segments, fmts, cols, places(x),
                                   residuals(e) if residual else [None] * len(segments)):
            nk.compress_topk(xp, s.k, index_dtype=index_dtype, residual=ep, out=msg[c])
    ref_merged = sentinel.copy()
    for s, f, c in zip(segments, fmts, cols):
        nk.merge_topk(Payload(f, ref_msgs[0][c]), Payload(f, ref_msgs[1][c]), s.k,
                      out=ref_merged[c])

    def decode_reference(selected, sent, e):
        out = np.full(size, np.nan, np.float32)
        for s, f, c, place in zip(segments, fmts, cols, places(out)):
            if e is not None:
                nk.restore_unselected(e[s.residual_offset:s.residual_offset + s.length],
                                      Payload(f, sent[c]), Payload(f, selected[c]))
            nk.scale_topk_values(Payload(f, selected[c]), factor)
            nk.decompress(Payload(f, selected[c]), out=place)
        return out
    ref_sel, ref_e0 = ref_merged.copy(), copy(ref_e[0])
    ref_out = decode_reference(ref_sel, ref_msgs[0], ref_e0)
    ref_alone, ref_e_alone = ref_msgs[0].copy(), copy(ref_e[0])
    ref_out_alone = decode_reference(ref_alone, ref_alone, ref_e_alone)

    to_device = (lambda a: None if a is None else cuda.to_device(a))       # noqa: E731
    for place, put in (("host", copy), ("device", to_device)):
        launches = []
        got_e, got_msgs = [put(e) for e in es], [put(sentinel) for _ in range(2)]
        for x, e, msg in zip(xs, got_e, got_msgs):
            before = nk.launch_count()
            nk.compress_topk_segments(put(x), segments, msg, index_dtype, residual=e)
            launches.append(nk.launch_count() - before)
        for r in range(2):
            _same(ref_msgs[r], got_msgs[r], f"{place} message of rank {r}: {what}")
            if residual:
                _same(ref_e[r], got_e[r], f"{place} residual of rank {r}: {what}")
        merged = put(sentinel)
        before = nk.launch_count()
        nk.merge_topk_segments(got_msgs[0], got_msgs[1], segments, merged, index_dtype)
        launches.append(nk.launch_count() - before)
        _same(ref_merged, merged, f"{place} merge: {what}")
        got_out = put(np.full(size, np.nan, np.float32))
        before = nk.launch_count()
        nk.decompress_topk_segments(merged, segments, got_out, index_dtype, factor=factor,
                                    residual=got_e[0] if residual else None,
                                    sent=got_msgs[0] if residual else None)
        launches.append(nk.launch_count() - before)
        _same(ref_out, got_out, f"{place} decode: {what}")
        _same(ref_sel, merged, f"{place} selected values scaled in place: {what}")
        if residual:
            _same(ref_e0, got_e[0], f"{place} residual restored: {what}")
        alone, alone_e = put(ref_msgs[0]), put(ref_e[0])
        got_out = put(np.full(size, np.nan, np.float32))
        nk.decompress_topk_segments(alone, segments, got_out, index_dtype, factor=factor,
                                    residual=alone_e if residual else None,
                                    sent=alone if residual else None)
        _same(ref_out_alone, got_out, f"{place} decode of the sent message itself: {what}")
        if residual:
            _same(ref_e_alone, alone_e, f"{place} residual, one rank: {what}")
        if place == "device" and one_launch:
            assert launches == [1, 1, 1, 1], f"launches {launches}: {what}"
