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
