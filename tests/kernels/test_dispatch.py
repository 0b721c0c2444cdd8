"""The public entry points: where data lives, torch views, stacks of payloads, errors."""
import subprocess
import sys

import numpy as np
import pytest

import numba_kernels as nk
from conftest import data
from numba_kernels.errors import KernelParameterError, PayloadError
from numba_kernels.registry import CODECS, codec_for
from numba_kernels.wire import FORMATS
from row_refs import at_column, payload_stack, registry_cases

COMPRESSORS = {
    "cast": lambda x, **kw: nk.compress_cast(x, "bf16", **kw),
    "minmax": lambda x, **kw: nk.compress_minmax(x, bits=4, chunk=64, **kw),
    "qsgd": lambda x, **kw: nk.compress_qsgd(x, levels=15, chunk=100, seed=3, **kw),
    "onebit": lambda x, **kw: nk.compress_onebit(x, chunk=64, **kw),
    "topk": lambda x, **kw: nk.compress_topk(x, 17, **kw),
}


def test_the_registry_covers_every_format():
    assert [codec.format for codec in CODECS] == list(FORMATS)
    assert codec_for(nk.TopKFormat(10, 2)).compressors == (nk.compress_topk, nk.compress_randk)


def test_import_does_not_load_numba_cuda():
    code = "import sys, numba_kernels; sys.exit('numba.cuda' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("name", COMPRESSORS)
def test_decompress_many_sums_rows_in_order(name, rng):
    n, rows = 1000, 4
    compress = COMPRESSORS[name]
    payloads = [compress(data(rng, n, np.float32)) for _ in range(rows)]
    stack = np.stack([p.buffer for p in payloads])
    expect = np.zeros(n, np.float32)
    for p in payloads:
        expect = expect + nk.decompress(p)
    np.testing.assert_array_equal(nk.decompress_many(stack, payloads[0].format), expect)
    # a flat receive buffer works too, and accumulate adds on top of out
    out = np.full(n, 2.0, np.float32)
    nk.decompress_many(stack.reshape(-1), payloads[0].format, out=out, accumulate=True)
    acc = np.full(n, 2.0, np.float32)
    for p in payloads:
        acc = acc + nk.decompress(p)
    np.testing.assert_array_equal(out, acc)
    # no rows: zero, or out untouched when accumulating
    empty = np.empty((0, payloads[0].nbytes), np.uint8)
    assert (nk.decompress_many(empty, payloads[0].format) == 0).all()


COLUMN_CASES = registry_cases()


def test_the_column_cases_cover_every_format_of_the_registry():
    formats = {type(payload_stack(fn, kw, 100, 1, 0)[0]) for _, fn, kw in COLUMN_CASES}
    assert formats == {codec.format for codec in CODECS}


def _bits(a):
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


@pytest.mark.parametrize("_, compress, kw", COLUMN_CASES, ids=[c[0] for c in COLUMN_CASES])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("col", [0, 8, 24])
def test_decompress_many_reads_payloads_at_a_column_of_wider_rows(_, compress, kw, rows, col):
    """The payloads at byte column ``col`` of wider rows of random bytes (different data in
    each row) decode, read in place, to exactly the bytes of the contiguous stack's decode."""
    n = 1000
    fmt, stack = payload_stack(compress, kw, n, rows, seed=[rows, col])
    mat = at_column(stack, col, seed=col + 1)
    before = mat.copy()
    want = nk.decompress_many(stack, fmt)
    np.testing.assert_array_equal(_bits(nk.decompress_many(mat, fmt, col=col)), _bits(want))
    out = np.full(n, np.nan, np.float32)
    assert nk.decompress_many(mat, fmt, out=out, col=col) is out
    np.testing.assert_array_equal(_bits(out), _bits(want))
    for dtype in (np.float32, np.float64):          # accumulate adds on top of out
        base = np.random.default_rng(7).standard_normal(n).astype(dtype)
        want_acc, got_acc = base.copy(), base.copy()
        nk.decompress_many(stack, fmt, out=want_acc, accumulate=True)
        nk.decompress_many(mat, fmt, out=got_acc, accumulate=True, col=col)
        np.testing.assert_array_equal(_bits(got_acc), _bits(want_acc))
    assert np.array_equal(mat, before)               # read, not written


def test_decompress_many_checks_the_column_as_the_row_form_does():
    fmt = nk.MinMaxFormat(100, 8, 32)
    width = 8 + fmt.nbytes
    mat = np.zeros((2, width), np.uint8)
    for bad in (4, 16):            # misaligned; aligned but the payload runs past the width
        for decode in (lambda m, c: nk.decompress_many(m, fmt, col=c),
                       lambda m, c: nk.decompress_rows(m, fmt, col=c)):
            with pytest.raises(PayloadError, match=f"column {bad} must start at a multiple of 8"):
                decode(mat, bad)
    with pytest.raises(PayloadError, match="column"):
        nk.decompress_many(mat, fmt, col=width)
    with pytest.raises(PayloadError, match="column"):
        nk.decompress_many(mat, fmt, col=-8)
    with pytest.raises(PayloadError, match="rows, width"):      # a flat buffer has no columns
        nk.decompress_many(np.zeros(width, np.uint8), fmt, col=8)
    with pytest.raises(PayloadError, match="multiple of 8"):
        nk.decompress_many(np.zeros((2, width + 4), np.uint8), fmt, col=8)
    with pytest.raises(PayloadError, match="C-contiguous"):
        nk.decompress_many(np.zeros((2, 2 * width), np.uint8)[:, ::2], fmt, col=8)
    for bad in (8.0, True, "8"):
        with pytest.raises(KernelParameterError, match="col must be an integer"):
            nk.decompress_many(mat, fmt, col=bad)
    with pytest.raises(KernelParameterError, match="col must be an integer"):
        nk.decompress_many(mat[:, :fmt.nbytes].copy(), fmt, col=False)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_torch_cpu_tensors_are_viewed_not_copied(name, rng):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(data(rng, 1000, np.float32))
    e = torch.zeros(1000)
    out_bytes = torch.zeros(COMPRESSORS[name](x.numpy()).nbytes, dtype=torch.uint8)
    p = COMPRESSORS[name](x, residual=e, out=out_bytes)
    assert np.shares_memory(p.buffer, out_bytes.numpy())
    assert float(e.abs().sum()) > 0          # the residual was updated in place
    target = torch.empty(1000, dtype=torch.float64)
    nk.decompress(p, out=target)
    np.testing.assert_allclose(target.numpy() + e.numpy(), x.numpy(), rtol=0, atol=1e-5)


def test_input_errors_name_the_problem(rng):
    x = data(rng, 100, np.float32)
    with pytest.raises(nk.KernelTypeError, match="int64"):
        nk.compress_minmax(np.arange(100))
    with pytest.raises(nk.LayoutError, match="contiguous"):
        nk.compress_minmax(np.ones((10, 20), np.float32)[:, ::2])
    with pytest.raises(nk.LayoutError, match="residual must match"):
        nk.compress_minmax(x, residual=np.zeros(99, np.float32))
    with pytest.raises(nk.LayoutError, match="residual must match"):
        nk.compress_minmax(x, residual=np.zeros(100, np.float64))
    with pytest.raises(nk.KernelTypeError, match="list"):
        nk.compress_minmax([1.0, 2.0])
    p = nk.compress_minmax(x)
    with pytest.raises(nk.LayoutError, match="99"):
        nk.decompress(p, out=np.zeros(99, np.float32))
    with pytest.raises(nk.LayoutError, match="accumulate"):
        nk.decompress(p, accumulate=True)
    with pytest.raises(nk.PayloadError, match="Payload"):
        nk.decompress(p.buffer)
    with pytest.raises(nk.PayloadError, match="shape"):
        nk.decompress_many(np.zeros(p.nbytes + 1, np.uint8), p.format)
    assert issubclass(nk.LayoutError, nk.KernelError) and issubclass(nk.KernelError, RuntimeError)


def test_multidimensional_inputs_are_flattened(rng):
    x = data(rng, 600, np.float32).reshape(20, 30)
    p = nk.compress_minmax(x, chunk=64)
    assert p.format.n == 600
    np.testing.assert_array_equal(p.buffer, nk.compress_minmax(x.reshape(-1), chunk=64).buffer)


def test_decompress_many_scales_the_sum_by_a_factor(rng):
    """``factor``: the decoded sum times the float32 factor, as a separate multiply gives; it
    replaces out, so with accumulate it is refused, naming both."""
    x = rng.standard_normal((3, 500)).astype(np.float32)
    payloads = [nk.compress_minmax(row, bits=8, chunk=128) for row in x]
    stack = np.stack([p.buffer for p in payloads])
    fmt = payloads[0].format
    expected = nk.decompress_many(stack, fmt) * np.float32(0.3)
    np.testing.assert_array_equal(nk.decompress_many(stack, fmt, factor=0.3), expected)
    with pytest.raises(nk.KernelParameterError, match="factor=0.3.*accumulate"):
        nk.decompress_many(stack, fmt, out=np.zeros(500, np.float32), accumulate=True,
                           factor=0.3)


def test_a_cuda_tensor_that_requires_grad_is_taken_detached(monkeypatch):
    """A CUDA tensor that requires grad (a model's parameter) goes to the kernels detached, as a
    CPU one does: torch's __cuda_array_interface__ raises RuntimeError for it, which escaped
    as torch's error. A stand-in with torch's behaviour (no GPU here) and a recording
    as_cuda_array."""
    from numba_kernels import _device

    class CudaTensor:
        is_cuda = True

        def __init__(self, requires_grad):
            self.requires_grad = requires_grad

        @property
        def __cuda_array_interface__(self):
            if self.requires_grad:
                raise RuntimeError("Can't get __cuda_array_interface__ on Variable that "
                                   "requires grad. Use var.detach()...")
            return {}

        def detach(self):
            return CudaTensor(False)

    given = []
    monkeypatch.setattr(_device, "cuda", lambda: type("Cuda", (), {
        "as_cuda_array": staticmethod(lambda obj: given.append(obj) or obj)}))
    param = CudaTensor(True)
    assert _device.is_device(param) and _device.is_device(CudaTensor(False))
    array, on_device = _device.as_array(param, "x")
    assert on_device and given == [array] and array is not param and not array.requires_grad
    plain = CudaTensor(False)
    assert _device.as_array(plain, "x")[0] is plain   # no detach where none is needed
