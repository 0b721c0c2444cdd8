"""Min-max quantization: CPU twin against the NumPy reference, error bounds, feedback."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_kernels as nk
from conftest import assert_ef_identity, data
from kernel_refs import DTYPES, SIZES, minmax_decode, minmax_payload


def check_against_reference(x, bits, chunk):
    p = nk.compress_minmax(x, bits=bits, chunk=chunk)
    ref, _ = minmax_payload(x, bits, chunk)
    np.testing.assert_array_equal(p.buffer, ref)
    np.testing.assert_array_equal(nk.decompress(p), minmax_decode(ref, x.size, bits, chunk))
    return p


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_8bit_matches_numpy(n, dtype, rng):
    check_against_reference(data(rng, n, dtype), 8, 1024)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n, chunk", [(1, 32), (33, 32), (1025, 96), (1023, 1024)])
def test_all_widths_match_numpy(bits, n, chunk, rng):
    check_against_reference(data(rng, n, np.float32), bits, chunk)


def test_long_chunks_match_numpy(rng):
    # chunks longer than one 4096-element segment take the multi-kernel path on a GPU
    check_against_reference(data(rng, 20000, np.float32), 5, 8192)


@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_error_at_most_half_a_step(bits, dtype, rng):
    x = data(rng, 10**5 + 7, dtype, scale=50.0)
    p = nk.compress_minmax(x, bits=bits, chunk=256)
    _, scale = minmax_payload(x, bits, 256)
    err = np.abs(x.astype(np.float32).astype(np.float64) - nk.decompress(p))
    # half a step, plus float32 rounding of the reconstruction
    bound = scale / 2 + 4 * np.finfo(np.float32).eps * np.abs(x).max()
    assert (err <= bound).all()
    # the bound is tight: some element of a 2**b-level grid lands near half a step
    assert (err > 0.4 * scale).any()


def test_zero_minimum_is_positive_zero():
    # -0.0 and +0.0 compare equal; the chunk minimum is stored as +0.0 on every target
    p = nk.compress_minmax(np.array([-0.0, 0.0, 1.0], np.float32), bits=8, chunk=32)
    assert p.views()["params"].view(np.uint32)[0] == 0


def test_constant_chunk_is_exact():
    x = np.full(100, -2.5, np.float32)
    p = nk.compress_minmax(x, bits=3, chunk=64)
    assert (p.views()["params"][1::2] == 0).all()
    np.testing.assert_array_equal(nk.decompress(p), x)


@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 33, 1025, 10**6])
def test_error_feedback_identity(bits, dtype, n, rng):
    x = data(rng, n, dtype)
    e_old = data(rng, n, dtype, scale=0.1)
    e = e_old.copy()
    p = nk.compress_minmax(x, bits=bits, chunk=512, residual=e)
    assert_ef_identity(x, e_old, nk.decompress(p), e)
    # the payload is that of c = x + e_old
    ref, _ = minmax_payload(x + e_old, bits, 512)
    np.testing.assert_array_equal(p.buffer, ref)


def test_out_buffer_is_used_and_padding_zeroed(rng):
    x = data(rng, 1001, np.float32)
    fmt = nk.MinMaxFormat(1001, 8, 64)
    out = np.full(fmt.nbytes, 0xAB, np.uint8)
    p = nk.compress_minmax(x, bits=8, chunk=64, out=out)
    assert p.buffer is out
    assert (out[fmt.used_nbytes:] == 0).all()
    with pytest.raises(nk.PayloadError, match="shape"):
        nk.compress_minmax(x, bits=8, chunk=64, out=np.zeros(fmt.nbytes - 8, np.uint8))


def test_minmax_errors_rejects_bad_widths_and_chunks():
    x = np.ones(10, np.float32)
    with pytest.raises(nk.KernelParameterError, match="bits"):
        nk.minmax_errors(x, [0, 4])
    with pytest.raises(nk.KernelParameterError, match="chunk"):
        nk.minmax_errors(x, [4], chunk=100)
    assert nk.minmax_errors(np.zeros(0, np.float32), [2, 4]).tolist() == [0.0, 0.0]


# decodes of widths 1, 2 and 4 whose codes end in the first word of a two-word span, in a
# fresh process that compiles the CPU twins with bounds checks (into its own cache folder)
BOUNDS_CHECKED = """
import numpy as np
import numba_kernels as nk
from kernel_refs import minmax_decode
rng = np.random.default_rng(5)
for bits in (1, 2, 4):
    for n, chunk in ((32, 32), (64, 32), (96, 32), (8, 64), (72, 64), (1000, 96)):
        x = rng.standard_normal(n).astype(np.float32)
        p = nk.compress_minmax(x, bits=bits, chunk=chunk)
        want = minmax_decode(p.buffer, n, bits, chunk)
        assert np.array_equal(nk.decompress(p), want), (bits, n, chunk)
        rows = np.stack([p.buffer] * 3)
        assert np.array_equal(nk.decompress_rows(rows, p.format), np.tile(want, 3))
print("ok")
"""


def test_packed_decode_reads_no_word_past_its_codes(tmp_path):
    """The 1/2/4-bit decoders read two words at a time; where a chunk's codes end in the first
    word they must not read the second, which past the last chunk of a row lies outside it."""
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", BOUNDS_CHECKED], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


# ---- non-finite values -----------------------------------------------------------------------
# A NaN anywhere in a chunk makes the chunk's range NaN: its (mn, scale) are stored as the quiet
# NaN 0x7FC00000, its codes are 0 and every element decodes to NaN, so that an averaged gradient
# holding a NaN stays non-finite (a loss scaler then skips the step); the other chunks are
# untouched. The range used to drop a NaN on the host (min() under fast math's nnan) and keep it
# on some lanes of a warp only on a GPU.

NAN_BITS = 0x7FC00000
NAN_N, NAN_CHUNK = 3000, 1024
# one NaN at: a chunk's first element, one in its middle, the last element of lane 0 (992) and
# of lane 31 (1023) of the warp that encodes a 1024-element chunk on a GPU (lane l folds l,
# l + 32, ..., l + 992: a NaN last in a lane's fold is the one that lane kept), the next
# chunk's first, the middle and the last element of the last chunk (952 elements: partial)
NAN_POSITIONS = [0, 517, 992, 1023, 1024, 2500, 2999]


def with_nan(x, pos):
    y = x.copy()
    y[pos] = np.nan
    return y


def nan_chunk_mask(n, chunk, positions):
    """True for the elements of the chunks that hold one of ``positions``."""
    ci = np.arange(n) // chunk
    return np.isin(ci, np.asarray(positions) // chunk)


def check_nan_chunks(x, positions, bits, chunk, e_old=None, **kw):
    """compress_minmax of x with a NaN at each of ``positions`` (and the residual e_old): the
    payload is the NumPy reference's; the chunks holding a NaN store NaN parameters and decode
    (and leave a residual) all NaN; every other chunk's payload, decode and residual are those
    of x without the NaNs, byte for byte."""
    y = x.copy()
    y[list(positions)] = np.nan
    runs = []
    for data_ in (x, y):
        e = None if e_old is None else e_old.copy()
        p = nk.compress_minmax(data_, bits=bits, chunk=chunk, residual=e, **kw)
        runs.append((p, nk.decompress(p), e))
    (clean, clean_out, clean_e), (p, out, e) = runs
    ref, _ = minmax_payload(y if e_old is None else y + e_old, bits, chunk)
    np.testing.assert_array_equal(p.buffer, ref)
    params = p.views()["params"].view(np.uint32).reshape(-1, 2)
    bad = sorted({pos // chunk for pos in positions})
    assert (params[bad] == NAN_BITS).all(), params[bad]
    good = np.setdiff1d(np.arange(len(params)), bad)
    np.testing.assert_array_equal(params[good], clean.views()["params"].view(np.uint32)
                                  .reshape(-1, 2)[good])
    mask = nan_chunk_mask(x.size, chunk, positions)
    assert np.isnan(out[mask]).all() and not np.isnan(out[~mask]).any()
    np.testing.assert_array_equal(out[~mask], clean_out[~mask])
    np.testing.assert_array_equal(out, minmax_decode(ref, x.size, bits, chunk))
    if e_old is not None:
        assert np.isnan(e[mask]).all()
        np.testing.assert_array_equal(e[~mask], clean_e[~mask])
    return p


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("pos", NAN_POSITIONS)
def test_one_nan_makes_its_chunk_decode_to_nan(pos, bits, residual, rng):
    x = data(rng, NAN_N, np.float32)
    e_old = data(rng, NAN_N, np.float32, scale=0.1) if residual else None
    check_nan_chunks(x, [pos], bits, NAN_CHUNK, e_old)


@pytest.mark.parametrize("residual", [False, True])
def test_a_nan_in_float64_data_and_in_several_chunks(residual, rng):
    x = data(rng, NAN_N, np.float64)
    e_old = data(rng, NAN_N, np.float64, scale=0.1) if residual else None
    check_nan_chunks(x, [992], 8, NAN_CHUNK, e_old)
    check_nan_chunks(x, [0, 2047, 2999], 4, NAN_CHUNK, e_old)


def test_a_nan_in_the_residual_alone(rng):
    """c = x + e: a NaN of the error memory makes its chunk NaN as a NaN of x does."""
    x = data(rng, NAN_N, np.float32)
    e_old = with_nan(data(rng, NAN_N, np.float32, scale=0.1), 1500)
    e = e_old.copy()
    p = nk.compress_minmax(x, bits=2, chunk=NAN_CHUNK, residual=e)
    np.testing.assert_array_equal(p.buffer, minmax_payload(x + e_old, 2, NAN_CHUNK)[0])
    out = nk.decompress(p)
    assert np.isnan(out[1024:2048]).all() and np.isnan(e[1024:2048]).all()
    assert not np.isnan(out[:1024]).any() and not np.isnan(out[2048:]).any()


@pytest.mark.parametrize("pos", [0, 4095, 4096, 8191, 12000, 19999])
def test_one_nan_in_long_chunks(pos, rng):
    """Chunks longer than a 4096-element segment (three kernels on a GPU: segment ranges,
    chunk parameters, segment encoding): a NaN in any segment makes the whole chunk NaN."""
    check_nan_chunks(data(rng, 20000, np.float32), [pos], 5, 8192,
                     data(rng, 20000, np.float32, scale=0.1))


@pytest.mark.parametrize("residual", [False, True])
def test_a_nan_in_the_row_form(residual, rng):
    """compress_minmax_rows: the partition holding the NaN has its chunk NaN, byte for byte the
    per-partition call's; the other partitions are as without the NaN."""
    rows, n, bits, chunk = 3, 2990, 4, 256      # partitions of 997: the last ends 1 short
    x = with_nan(data(rng, n, np.float32), 1500)
    part = -(-n // rows)
    e_old = data(rng, rows * part, np.float32, scale=0.1) if residual else None
    fmt = nk.MinMaxFormat(part, bits, chunk)
    mat = np.zeros((rows, fmt.nbytes), np.uint8)
    e = None if e_old is None else e_old.copy()
    nk.compress_minmax_rows(x, mat, bits=bits, chunk=chunk, residual=e)
    padded = np.concatenate([x, np.zeros(rows * part - n, np.float32)])
    c = padded if e_old is None else padded + e_old
    for k in range(rows):
        ref, _ = minmax_payload(c[k * part:(k + 1) * part], bits, chunk)
        np.testing.assert_array_equal(mat[k], ref, err_msg=f"row {k}")
    out = nk.decompress_rows(mat, fmt)
    k, i = divmod(1500, part)       # the NaN's partition, and its place there
    mask = np.zeros(out.size, bool)
    mask[k * part + i // chunk * chunk:k * part + min(part, (i // chunk + 1) * chunk)] = True
    assert np.isnan(out[mask]).all() and not np.isnan(out[~mask]).any()


def test_infinities_decode_to_nan_with_the_same_bytes(rng):
    """An infinity in a chunk gives an infinite scale (a NaN one where the chunk holds only
    infinities of one sign, stored as 0x7FC00000), codes 0 and a NaN decode."""
    x = data(rng, 4 * 256 + 100, np.float32)
    x[5] = np.inf                   # chunk 0: a +inf
    x[300] = -np.inf                # chunk 1: a -inf
    x[600], x[700] = -np.inf, np.inf    # chunk 2: both
    x[1024:] = np.inf               # chunk 4 (partial): only +inf
    for bits in (1, 3, 8):
        p = nk.compress_minmax(x, bits=bits, chunk=256)
        ref, _ = minmax_payload(x, bits, 256)
        np.testing.assert_array_equal(p.buffer, ref)
        params = p.views()["params"].view(np.uint32).reshape(-1, 2)
        assert params[4, 1] == NAN_BITS
        out = nk.decompress(p)
        assert np.isnan(out[:768]).all() and np.isnan(out[1024:]).all()
        assert np.isfinite(out[768:1024]).all()


def test_range_keeps_a_nan_whatever_the_order():
    """``range_min`` / ``range_max`` as compiled for the CPU twins (LLVM's NaN-keeping
    intrinsics) give the rule's value (``range_min_py``: the select the device compiles) for
    every pair of special values, a NaN in either operand giving NaN; the twins' chunk range
    is (NaN, NaN) for a NaN at every position of a chunk, and the exact range without one."""
    from numba_kernels._scalar import range_max, range_max_py, range_min, range_min_py
    from numba_kernels.minmax import value_range
    special = np.array([np.nan, -np.inf, -1.5, -0.0, 0.0, 2.0, np.inf], np.float32)
    for a in special:
        for b in special:
            for cpu, rule in ((range_min, range_min_py), (range_max, range_max_py)):
                got, want = cpu(a, b), rule(a, b)
                assert np.isnan(got) == np.isnan(want) == (np.isnan(a) or np.isnan(b))
                assert np.isnan(got) or got == want, (a, b, got, want)
    x = np.random.default_rng(3).standard_normal(96).astype(np.float32)
    assert value_range(x) == (x.min(), x.max())
    for pos in range(x.size):
        assert np.isnan(value_range(with_nan(x, pos))).all(), pos


def test_no_kernel_is_compiled_with_fast_math():
    """The NaN tests of the range fold (``a != a``; the CPU's intrinsics) would be assumed away
    by fast math's nnan flag: no CPU twin or kernel of numba_kernels may take fast math (the
    PTX check, ``test_simulator.py``, also refuses it in every recorded launch)."""
    root = Path(nk.__file__).parent
    found = [f"{path.relative_to(root)}:{i}" for path in sorted(root.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if "fastmath" in line]
    assert not found, found
