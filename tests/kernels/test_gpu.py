"""The device checks on a real CUDA GPU (marker ``gpu``), at realistic sizes.

Skipped, with the reason, where no GPU is present: CI has none.  Run on a GPU
machine with ``python -m pytest tests/kernels -m gpu`` and record the result.
"""
import numpy as np
import pytest
from numba import config

pytestmark = pytest.mark.gpu


def _gpu_reason():
    if config.ENABLE_CUDASIM:
        return "NUMBA_ENABLE_CUDASIM is set: the simulator is not a GPU"
    try:
        from numba import cuda
        if cuda.is_available():
            return None
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"no CUDA GPU present (numba.cuda failed: {exc})"
    return "no CUDA GPU present (numba.cuda.is_available() is False)"


REASON = _gpu_reason()
needs_gpu = pytest.mark.skipif(REASON is not None, reason=REASON or "")
F32, F64 = np.float32, np.float64
BIG = 10**6 + 3


@pytest.fixture(scope="module")
def dc():
    import device_checks
    return device_checks


@needs_gpu
def test_casts(dc):
    dc.check_casts([(n, kind, dt) for n in (0, 1, 33, 1025, BIG) for kind in ("fp16", "bf16")
                    for dt in (F32, F64)])
    dc.check_cast_codes(every=True)


@needs_gpu
def test_minmax(dc):
    # 1, 2 and 4 bits: words from lane groups (warp shuffles); 3: the warp's shared words;
    # 8: bytes; a warp per chunk up to SEGMENT (4096) elements, several chunks a block
    dc.check_minmax([(n, bits, chunk, dt, res) for n in (1, 33, 1025, BIG)
                     for bits in (1, 2, 3, 4, 8)
                     for chunk in (32, 1024) for dt in (F32, F64) for res in (False, True)])
    dc.check_minmax([(BIG, 8, 1 << 20, F32, True), (BIG, 4, 8192, F64, True),
                     (BIG, 8, 4096, F32, False), (BIG, 5, 4096, F32, True),
                     (BIG, 7, 2048, F64, True), (BIG, 6, 96, F32, False)])
    dc.check_signed_zero_minimum()


@needs_gpu
def test_minmax_nan_and_infinities(dc):
    """One NaN in each of 32 chunks of 1024, last in lane c's fold in chunk c (lane l folds l,
    l + 32, ..., l + 992), and at a chunk's first, middle and last (partial chunk) element;
    long chunks (three kernels); infinities; the segmented encoder: the GPU's bytes are the
    CPU twin's, its NaN parameters stored as 0x7FC00000, not its arithmetic's 0x7FFFFFFF."""
    positions = [c * 1024 + 992 + c for c in range(32)] + [32 * 1024, 33 * 1024 + 517,
                                                           35 * 1024 + 299]
    dc.check_minmax_nan(35 * 1024 + 300, 1024, positions,
                        [(bits, dt, res) for bits in (1, 2, 3, 4, 8) for dt in (F32, F64)
                         for res in (False, True)], many=True)
    dc.check_minmax_nan(BIG, 8192, [0, 4095, 8192 + 4096, BIG - 1], [(5, F32, True),
                                                                     (8, F64, False)])
    for bits in (1, 3, 8):
        dc.check_minmax_infinities(bits)
        dc.check_minmax_infinities(bits, chunk=1024)
    dc.check_minmax_segments([(3000, 3), (1290, 1), (10000, 8), (640, 2), (450, 4)], 2, True,
                             1024, nans=[(0, 0), (1, 645 + 640), (2, 9999), (3, 319)])


@needs_gpu
def test_qsgd(dc):
    dc.check_qsgd([(n, levels, chunk, dt, True) for n in (1, 1025, BIG) for levels in (1, 127)
                   for chunk in (100, 1023, 1024, 1 << 20) for dt in (F32, F64)])


@needs_gpu
def test_onebit(dc):
    dc.check_onebit([(n, chunk, scale, dt, True) for n in (1, 1025, BIG)
                     for chunk in (32, 4096, 1 << 20) for scale in ("l2", "mean_abs")
                     for dt in (F32, F64)])


@needs_gpu
def test_row_forms(dc):
    """C_LP_S's batched encode and decode at bucket sizes: n = 1..4 partitions, every codec,
    and a tensor n - 1 elements short of n equal partitions (read as zero padding)."""
    dc.check_rows([(name, kw, rows, part, res, short)
                   for name, kw in [("minmax", {"bits": 8, "chunk": 1024}),
                                    ("minmax", {"bits": 3, "chunk": 96}),
                                    ("qsgd", {"levels": 127, "chunk": 1024}),
                                    ("onebit", {"chunk": 4096, "scale": "l2"}),
                                    ("onebit", {"chunk": 1 << 20, "scale": "l2"})]
                   for rows in (1, 2, 3, 4) for part in (1025, BIG // 4 + 1)
                   for res in (False, True)
                   for short in ({0, rows - 1} if part == 1025 else {0})])


@needs_gpu
def test_topk(dc):
    sizes = ((1, 1), (1025, 10), (BIG, 1000), (BIG, 10**5))
    cases = [(n, k, kind, dt, method, res) for n, k in sizes
             for kind in ("normal", "ties") for dt in (F32, F64)
             for method in ("exact", "approx", "randk") for res in (False, True)]
    dc.check_topk(cases)
    dc.check_approx_path(10**7, 10**4)


@needs_gpu
def test_merge(dc):
    dc.check_merge([(1, 1, "normal"), (1025, 40, "ties"), (BIG, 1000, "normal"),
                    (BIG, 1000, "ties")])


@needs_gpu
def test_torch_cuda_tensors_and_streams():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    import numba_kernels as nk
    x = torch.randn(BIG, device="cuda")
    e = torch.zeros_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())   # the fills above, on the default stream
    with torch.cuda.stream(stream):
        # ~50 ms before the add: a kernel launched on any other stream reads x before it
        torch.cuda._sleep(100_000_000)
        x.add_(1.0)
        p = nk.compress_minmax(x, bits=8, residual=e, stream=stream)
        out = torch.empty_like(x)
        nk.decompress(p, out=out, stream=stream)
    stream.synchronize()
    host = nk.compress_minmax(x.cpu().numpy(), bits=8)
    np.testing.assert_array_equal(p.buffer.copy_to_host(), host.buffer)
    torch.testing.assert_close(out + e, x, rtol=0, atol=1e-5)


@needs_gpu
def test_topk_of_more_than_2_31_tied_zeros():
    """Top-k over 2^31 + 2^16 zeros (8.6 GB): every key ties at a threshold of zero, so the
    grid selection's tie offsets pass 2^31; both methods keep the first k positions. Where the
    offsets wrapped, the compaction wrote before its output (an illegal address) or over kept
    entries."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    free, _ = torch.cuda.mem_get_info()
    n = 2**31 + 2**16
    if free < 4 * n + (1 << 30):
        pytest.skip(f"needs {4 * n + (1 << 30)} bytes of free device memory, has {free}")
    import numba_kernels as nk
    x = torch.zeros(n, device="cuda")
    try:
        for method in ("exact", "approx"):
            p = nk.compress_topk(x, 1000, index_dtype="int64", method=method)
            v = p.format.views(p.buffer.copy_to_host())
            assert v["indices"].tolist() == list(range(1000)), method
            assert not v["values"].any(), method
    finally:
        del x
        torch.cuda.empty_cache()
