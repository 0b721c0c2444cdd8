"""fp16/bf16 casts: CPU twin against NumPy (and torch for bf16), error feedback."""
import numpy as np
import pytest

import numba_kernels as nk
from conftest import assert_ef_identity, data
from kernel_refs import DTYPES, SIZES, bf16_bits, fp16_bits, pad8

REFS = {"fp16": fp16_bits, "bf16": bf16_bits}


def special_values():
    vals = [0.0, -0.0, 1.0, 65504.0, 65519.996, 65520.0, 65536.0, 2.0**-14, 2.0**-24, 2.0**-25,
            2.0**-25 * (1 + 2**-20), 3 * 2.0**-26, 1e-30, 3.4e38, np.inf, -np.inf, np.nan,
            1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 2.0**-126, 2.0**-149]
    v = np.array(vals, np.float32)
    return np.concatenate([v, -v])


def random_bit_patterns(n, seed=7):
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    return bits.view(np.float32)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_numpy(kind, dtype, n, rng):
    x = data(rng, n, dtype, scale=300.0)
    p = nk.compress_cast(x, kind)
    ref = REFS[kind](x)
    np.testing.assert_array_equal(p.buffer, pad8(ref.view(np.uint8)))
    back = nk.decompress(p)
    expect = ref.view(np.float16).astype(np.float32) if kind == "fp16" else \
        (ref.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(back, expect)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_special_values_and_all_exponents(kind):
    x = np.concatenate([special_values(), random_bit_patterns(1 << 18)])
    got = nk.compress_cast(x, kind).views()["half"]
    ref = REFS[kind](x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], ref[~nan])
    halves = got[nan]
    if kind == "fp16":
        assert ((halves & 0x7C00) == 0x7C00).all() and ((halves & 0x0200) != 0).all()
    else:
        assert ((halves & 0x7F80) == 0x7F80).all() and ((halves & 0x0040) != 0).all()


def test_bf16_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.concatenate([special_values(), random_bit_patterns(1 << 16, seed=3)])
    x = x[~np.isnan(x)]
    ours = nk.compress_cast(x, "bf16").views()["half"]
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 1025, 10**6])
def test_error_feedback_identity(kind, dtype, n, rng):
    x = data(rng, n, dtype, scale=10.0)
    e_old = data(rng, n, dtype, scale=0.01)
    e = e_old.copy()
    xhat = nk.decompress(nk.compress_cast(x, kind, residual=e))
    assert_ef_identity(x, e_old, xhat, e)
    assert not np.array_equal(e, e_old)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_every_16_bit_code_decodes_exactly(kind):
    """All 65536 codes widen to float32 bit for bit, through ``sum_halves`` and the codec's
    decoder: fp16 as NumPy converts it, a NaN keeping its sign and payload; bf16 as the code
    in the top half of the word."""
    codes = np.arange(1 << 16, dtype=np.uint16)
    wide = codes.astype(np.uint32)
    if kind == "fp16":
        expect = codes.view(np.float16).astype(np.float32).view(np.uint32)
        nan = ((wide & 0x7C00) == 0x7C00) & ((wide & 0x3FF) != 0)
        expect[nan] = ((wide[nan] & 0x8000) << 16) | 0x7F800000 | ((wide[nan] & 0x3FF) << 13)
    else:
        expect = wide << 16
    out = np.empty(codes.size, np.float32)
    nk.sum_halves(codes[None, :], out, kind)
    np.testing.assert_array_equal(out.view(np.uint32), expect)
    fmt = nk.CastFormat(codes.size, kind)
    row = np.zeros((1, fmt.nbytes), np.uint8)
    row[0, :fmt.used_nbytes] = codes.view(np.uint8)
    np.testing.assert_array_equal(nk.decompress_many(row, fmt).view(np.uint32), expect)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("out_dtype", [np.float32, np.float64])
def test_sum_halves_decodes_and_adds_rows_in_order(kind, out_dtype, rng):
    """Three rows over several of the decoder's blocks and a part of one, summed in row order
    in ``out``'s dtype; the first elements are sums that float32 and float64 round apart."""
    n = 2 * 4096 + 1001
    rows = np.stack([REFS[kind](data(rng, n, np.float32, scale=300.0)) for _ in range(3)])
    rows[:, :2] = REFS[kind](np.array([[60000.0, -60000.0], [2.0**-14, 1.0], [2.0**-13, 2.0**-14]],
                                      np.float32))
    decoded = (rows.view(np.float16).astype(out_dtype) if kind == "fp16"
               else (rows.astype(np.uint32) << 16).view(np.float32).astype(out_dtype))
    expect = (decoded[0] + decoded[1]) + decoded[2]  # out's dtype, row order
    assert (np.float32(expect[:2]) != expect[:2]).all() or out_dtype == np.float32
    out = np.full(n, np.nan, out_dtype)
    assert nk.sum_halves(rows, out, kind) is out
    np.testing.assert_array_equal(out, expect)


def test_sum_halves_refuses_mismatched_shapes():
    with pytest.raises(nk.LayoutError, match="rows of 4 values"):
        nk.sum_halves(np.zeros((2, 4), np.uint16), np.zeros(5, np.float32))
    with pytest.raises(nk.KernelTypeError, match="uint16"):
        nk.sum_halves(np.zeros((2, 4), np.float32), np.zeros(4, np.float32))
