"""CUDA kernels under Numba's simulator against the CPU twins (small sizes).

Not collected by the normal run (the simulator must be enabled before
numba.cuda is imported): ``test_simulator.py`` runs this file in a subprocess
with NUMBA_ENABLE_CUDASIM=1.  With NUMBA_KERNELS_RECORD=<path> the argument
types of every kernel launch are written there, so that the launches can be
compiled to PTX for a real GPU (see ``ptx_compile.py``).
"""
import contextlib
import json
import os
import sys
import time

import numpy as np
import pytest
from numba import config

if not config.ENABLE_CUDASIM:
    pytest.skip("run with NUMBA_ENABLE_CUDASIM=1 (see test_simulator.py)", allow_module_level=True)

from numba import cuda  # noqa: E402

import device_checks as dc  # noqa: E402
import numba_kernels._cuda  # noqa: E402,F401 - installs the simulator's counting swap
from row_refs import registry_cases  # noqa: E402
from sim_swap_helpers import leaves_first, own_lane, stays_longer  # noqa: E402

F32, F64 = np.float32, np.float64


@pytest.fixture(scope="module", autouse=True)
def record_launches():
    path = os.environ.get("NUMBA_KERNELS_RECORD")
    if not path:
        yield
        return
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    seen = set()
    original = FakeCUDAKernel.__call__

    def spec(arg):
        arr = getattr(arg, "_ary", arg)
        if isinstance(arr, np.ndarray):
            return ["array", arr.dtype.str, arr.ndim, bool(arr.flags.c_contiguous)]
        if isinstance(arr, (bool, np.bool_)):
            return ["bool"]
        if isinstance(arr, np.generic):
            return ["scalar", arr.dtype.str]
        return ["int" if isinstance(arr, int) else "float"]

    def recording(self, *args):
        if not self._device and self.fn.__module__.startswith("numba_kernels."):
            seen.add(json.dumps([self.fn.__module__, self.fn.__name__, [spec(a) for a in args]]))
        return original(self, *args)

    FakeCUDAKernel.__call__ = recording
    yield
    FakeCUDAKernel.__call__ = original
    with open(path, "w") as fh:
        json.dump(sorted(json.loads(s) for s in seen), fh)


# decompress_many (a few launches per case) runs on one case per format only,
# to keep the simulator run short.

def test_casts():
    dc.check_casts([(0, "fp16", F32), (1, "fp16", F32), (1025, "fp16", F64), (300, "bf16", F64)],
                   many=False)
    dc.check_casts([(33, "bf16", F32), (1027, "fp16", F32)])
    dc.check_cast_codes()


def test_minmax():
    # widths 1, 2 and 4 pack their words from lane groups, 3 and 5 through shared memory
    dc.check_minmax([(0, 8, 32, F32, True), (1, 8, 32, F32, True), (1025, 8, 256, F32, True),
                     (1023, 5, 256, F64, False), (700, 1, 96, F32, True),
                     (300, 4, 64, F32, True), (77, 2, 32, F64, True)], many=False)
    dc.check_minmax([(100, 3, 32, F32, True)])
    dc.check_signed_zero_minimum()


def test_minmax_long_chunks():
    dc.check_minmax([(4200, 7, 4160, F32, True)], many=False)


# One NaN a chunk of 1024: at its first element, in its middle, last in lane 0's and in lane
# 31's fold (a team's lane l folds l, l + 32, ..., l + 992: the NaN some lanes of a warp kept
# and others dropped), and the last element of a partial last chunk; chunk 4 has none
MINMAX_NAN_POSITIONS = [0, 1024 + 517, 2048 + 992, 3072 + 1023, 5 * 1024 + 499]


def test_minmax_nan_and_infinities():
    """A NaN makes its chunk's range NaN on both targets, whatever its place and the order of
    the reductions (lane folds, warp butterfly or shared memory, block tree of long chunks):
    the payload, residual and decode are the CPU twin's, byte for byte; infinities too."""
    dc.check_minmax_nan(5 * 1024 + 500, 1024, MINMAX_NAN_POSITIONS,
                        [(8, F32, True), (1, F32, False), (2, F32, True), (4, F32, True),
                         (3, F64, False)], many=True)
    # chunks longer than a segment (three kernels): a NaN last in segment 0, and in segment 1
    dc.check_minmax_nan(2 * 4160 + 100, 4160, [4095, 4160 + 4096 + 3], [(5, F32, True)])
    dc.check_minmax_infinities(8)
    dc.check_minmax_infinities(3)


def test_minmax_segments_with_a_nan():
    """The segmented encoder (one launch for every segment): a NaN at a chunk's first element,
    last in lane 0's fold, a partition's last element, as the host's bytes."""
    dc.check_minmax_segments([(300, 3), (129, 1), (1000, 8), (64, 2), (45, 4)], 2, True, 64,
                             nans=[(0, 0), (1, 65 + 32), (2, 999), (3, 63)])


def test_qsgd():
    dc.check_qsgd([(1, 127, 32, F32, True), (33, 127, 32, F32, False), (1025, 127, 256, F32, True)],
                  many=False)
    # chunks of a multiple of 4 decode by words of four codes; others element by element
    dc.check_qsgd([(300, 5, 100, F64, True), (45, 3, 7, F32, True)])


def test_qsgd_long_chunks():
    dc.check_qsgd([(4200, 31, 4100, F32, True)], many=False)


def test_onebit():
    dc.check_onebit([(1, 32, "l2", F32, True), (33, 32, "mean_abs", F32, True),
                     (1025, 256, "l2", F32, True)], many=False)
    dc.check_onebit([(300, 96, "mean_abs", F64, False)])


def test_onebit_long_chunks():
    dc.check_onebit([(4200, 4128, "l2", F32, True)], many=False)


# The row forms (C_LP_S's batched compress and decode): every codec, with and without error
# feedback, n = 1 and 3 partitions whose length is not a multiple of the chunk; one packed width
# and one case per codec of chunks longer than a segment (the three-kernel path). The simulator
# runs every thread in Python, so the cases stay few and small: tests/kernels/test_rows.py
# covers n = 1..4 and more lengths on the CPU twins, which share the device functions' code.
ROW_CODECS = [("minmax", {"bits": 8, "chunk": 32}, 45),
              ("qsgd", {"levels": 127, "chunk": 32}, 45),
              ("onebit", {"chunk": 32, "scale": "l2"}, 45)]
ROW_CASES = [(name, kw, rows, part, res) for name, kw, part in ROW_CODECS
             for rows in (1, 3) for res in (False, True)]


def test_row_forms_equal_the_per_partition_calls():
    dc.check_rows(ROW_CASES)
    dc.check_rows([("minmax", {"bits": 3, "chunk": 96}, 3, 200, True),
                   ("onebit", {"chunk": 32, "scale": "mean_abs"}, 2, 45, False),
                   ("qsgd", {"levels": 5, "chunk": 40}, 2, 1, True),
                   ("qsgd", {"levels": 9, "chunk": 30}, 2, 45, True)])
    dc.check_rows([("minmax", {"bits": 8, "chunk": 32}, 2, 45, True),
                   ("qsgd", {"levels": 127, "chunk": 32}, 2, 45, False),
                   ("onebit", {"chunk": 32, "scale": "l2"}, 2, 45, True)], dtype=F64)


def test_minmax_segments_equal_the_per_tensor_calls():
    """Many tensors at their own code widths in one launch per stage (L-GreCo's min-max
    exchange): every width, lengths the rows do not divide, an empty tensor and a one-element
    one, with and without error feedback. Runs in the GPU's shapes too (the warp code of the
    team encoder)."""
    dc.check_minmax_segments([(45, 3), (1, 8), (0, 4), (200, 1), (31, 5), (64, 2)], 2, True, 32)
    dc.check_minmax_segments([(45, 7), (97, 6), (300, 4)], 3, False, 96)
    dc.check_minmax_segments([(70, 8), (5, 3)], 1, True, 64)


def test_row_forms_long_chunks_of_minmax_segments():
    """Chunks longer than a segment: the segments run one by one, the same bytes."""
    dc.check_minmax_segments([(4130, 4), (9, 2)], 1, True, 4128)


def test_row_forms_of_a_tensor_the_rows_do_not_divide():
    """The tensor ends 1 to rows - 1 elements short of rows equal partitions (down to a
    partition wholly past its end): read as zeros, decoded up to its end."""
    dc.check_rows([("minmax", {"bits": 3, "chunk": 32}, 3, 45, True, 2),
                   ("minmax", {"bits": 8, "chunk": 32}, 4, 2, False, 3),
                   ("qsgd", {"levels": 127, "chunk": 32}, 3, 45, True, 1),
                   ("qsgd", {"levels": 5, "chunk": 32}, 4, 2, True, 3),
                   ("onebit", {"chunk": 32, "scale": "l2"}, 3, 45, False, 2),
                   ("onebit", {"chunk": 32, "scale": "mean_abs"}, 4, 2, True, 3)])
    dc.check_rows([("minmax", {"bits": 8, "chunk": 32}, 2, 45, True, 1)], dtype=F64)


def test_row_forms_long_chunks():
    dc.check_rows([("minmax", {"bits": 4, "chunk": 4128}, 1, 4130, True),
                   ("qsgd", {"levels": 31, "chunk": 4100}, 1, 4130, True),
                   ("onebit", {"chunk": 4128, "scale": "l2"}, 1, 4130, False),
                   ("minmax", {"bits": 8, "chunk": 4128}, 2, 4130, False, 1)])


def test_row_forms_in_gpu_shapes():
    """The run in the GPU's shapes (``NUMBA_KERNELS_GPU_SHAPES=1``, slow) takes these instead of
    the row tests above: each codec at 3 partitions with error feedback, 3-bit min-max (codes
    across words) and chunks longer than a segment."""
    dc.check_rows([(name, kw, 3, 45, True) for name, kw, _ in ROW_CODECS])
    dc.check_rows([("minmax", {"bits": 3, "chunk": 96}, 3, 200, True),
                   ("onebit", {"chunk": 4128, "scale": "l2"}, 1, 4130, True)])


def test_decompress_many_at_a_column_every_format():
    """C_LP_S's server decode: the payloads read in place at a byte column of the message rows
    (every format and compressor of the registry), as the contiguous stack's host decode."""
    dc.check_decode_at_column(registry_cases(), n=70, rows=2, col=24)


def test_sparse_stacks_too_large_for_one_block_take_a_grid_per_row(monkeypatch):
    """Top-k and random-k stacks of more than ONE_BLOCK_ENTRIES (row, entry) pairs are
    scattered by a grid per row, not by one block: the same bytes as the host (the other
    tests' stacks are small and take the one block)."""
    from numba_kernels._cuda import topk as kern
    monkeypatch.setattr(kern, "ONE_BLOCK_ENTRIES", 1)
    sparse = [c for c in registry_cases() if c[0].startswith(("compress_topk", "compress_randk"))]
    assert sparse
    dc.check_decode_at_column(sparse, n=70, rows=3, col=24)


# Up to ONE_BLOCK_KEYS elements (all of these) one block selects; the grid's path runs them
# with the limit patched to 0 (sim_launches.py checks the limit itself)
EXACT_TOPK = [(1, 1, "normal", F32, "exact", True), (33, 0, "normal", F32, "exact", True),
              (1025, 10, "normal", F64, "exact", True), (200, 200, "ties", F32, "exact", True)]


def test_misaligned_device_payload_buffers_raise():
    """A device buffer that does not start at a multiple of 8 bytes is refused before any
    launch, as a host one is (``test_alignment.py``): on a GPU the launch would stop the CUDA
    context at the first 64-bit load. Every compressor of the registry, on device data."""
    import numba_kernels as nk
    from numba_kernels.wire import data_address

    x = cuda.to_device(np.random.default_rng(0).standard_normal(300).astype(F32))
    for name, compress, kw in registry_cases():
        nbytes = compress(x, **kw).nbytes
        raw = cuda.to_device(np.zeros(nbytes + 16, np.uint8))
        start = -data_address(raw) % 8
        for offset in (4, 1):
            with pytest.raises(nk.PayloadError, match=f"{offset} bytes past a multiple of 8"):
                compress(x, **kw, out=raw[start + offset:start + offset + nbytes])
        compress(x, **kw, out=raw[start:start + nbytes])


def test_topk_exact_and_randk():
    dc.check_topk(EXACT_TOPK, many=False)
    dc.check_topk([(33, 5, "ties", F32, "exact", False)])
    dc.check_topk([(33, 7, "normal", F32, "randk", True),
                   (300, 100, "normal", F64, "randk", False)], many=False)


def test_topk_exact_on_a_grid(grid_selection):
    dc.check_topk(EXACT_TOPK, many=False)


def test_tile_scan_counts_past_2_31():
    """The grid selection's scan turns the tiles' counts into offsets in int64: ties past 2^31
    (a zero threshold over a mostly zero tensor of 3e9 elements ties every zero) give offsets
    past 2^31 and take at most r of them. Hand-made counts stand in for such a tensor."""
    from numba_kernels._cuda import select
    from numba_kernels._cuda.geometry import THREADS
    many = 2**31 + 7
    counts = np.array([[3, many], [0, 2**32 + 1], [2, 5]], np.int64)
    state = np.zeros(select.STATE_SLOTS, np.int64)
    state[select.R] = 4
    d_counts, d_state = cuda.to_device(counts), cuda.to_device(state)
    select._scan[1, THREADS](d_counts, len(counts), d_state)
    assert d_counts.copy_to_host().tolist() == [[0, 0], [3, many], [3, many + 2**32 + 1]]
    assert int(d_state.copy_to_host()[select.TAKEN]) == 5 + 4


def test_topk_approx(grid_selection):
    """The approximate method runs above ONE_BLOCK_KEYS only (below it one block selects
    exactly); with the limit at 0 it runs on these small tensors."""
    dc.check_topk([(1200, 12, "normal", F32, "approx", True),
                   (1200, 300, "ties", F64, "approx", True)], approx_min_n=1000, many=False)
    dc.check_approx_path(2000, 20)


# (1000, 400): a union of several tiles; (200, 20) again: the union's scratch then holds the
# entries of a longer union, which the prefill must clear
MERGES = [(1, 1, "normal"), (200, 20, "ties"), (1025, 40, "normal"), (1000, 400, "normal"),
          (200, 20, "ties")]


def test_merge_and_restore():
    dc.check_merge(MERGES)


def test_merge_on_a_grid(grid_selection):
    dc.check_merge(MERGES)


def test_scale_topk_stack():
    """Every row's k values scaled in one pass, as the host's; a stack at a column of wider
    rows too, whose other bytes stay as they were."""
    dc.check_scale_topk_stack(n=300, k=17, rows=3)


def test_scale_and_fill_as_the_primitives_launch_them():
    """C_LP_S's device path scales the merged partition and zero-pads with these two kernels
    (float32 array, float32 scalar): recorded here so the PTX compilation covers them."""
    from numba import cuda

    from numba_kernels._cuda.common import fill, scale
    x = np.linspace(-3, 3, 1000, dtype=F32)
    d = cuda.to_device(x)
    scale(d, F32(0.25))
    assert np.array_equal(d.copy_to_host(), x * F32(0.25))
    fill(d[100:], F32(0))
    got = d.copy_to_host()
    assert np.array_equal(got[:100], x[:100] * F32(0.25)) and not got[100:].any()


# The GPU's shapes (NUMBA_KERNELS_GPU_SHAPES=1): test_simulator.py runs the tests named
# *gpu_shapes* and the per-format ones in a process of their own with it; the others skip them.

@cuda.jit
def _warp_calls(x, xor, bal):
    t = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x
    v = x[t]
    cuda.syncwarp(0xFFFFFFFF)
    xor[t] = cuda.shfl_xor_sync(0xFFFFFFFF, v, (t % 32) % 7 + 1)
    bal[t] = cuda.ballot_sync(0xFFFFFFFF, v > 0)


@cuda.jit
def _one_lane_away(x):
    if cuda.threadIdx.x != 3:
        x[cuda.threadIdx.x] = cuda.shfl_xor_sync(0xFFFFFFFF, x[cuda.threadIdx.x], 1)


@cuda.jit
def _half_warps_differ(x):
    if cuda.threadIdx.x < 16:
        cuda.syncwarp(0xFFFFFFFF)
    else:
        x[cuda.threadIdx.x] = cuda.ballot_sync(0xFFFFFFFF, True)


def _gpu_shapes():
    from numba_kernels._cuda import geometry
    if geometry.SIM_SHAPES:
        pytest.skip("needs NUMBA_KERNELS_GPU_SHAPES=1 (test_simulator.py's run in the GPU's "
                    "shapes selects it)")
    return geometry


def test_gpu_shapes_are_the_gpus():
    geometry = _gpu_shapes()
    from numba_kernels._cuda import common
    assert (geometry.THREADS, geometry.WARP, geometry.TEAMS) == (256, 32, 8)
    assert "shfl_xor_sync" in common.warp_range.py_func.__code__.co_names


def test_simulated_warp_intrinsics_in_gpu_shapes():
    """syncwarp, shfl_xor_sync (a partner that differs by lane) and ballot_sync, 2 blocks of 3
    warps each, against NumPy on values that differ per thread."""
    _gpu_shapes()
    x = np.random.default_rng(5).integers(-100, 100, 192).astype(np.int32)
    xor, bal = np.zeros_like(x), np.zeros(192, np.uint32)
    _warp_calls[2, 96](x, xor, bal)
    t = np.arange(192)
    partner = (t - t % 32) + ((t % 32) ^ ((t % 32) % 7 + 1))
    assert np.array_equal(xor, x[partner])
    words = [sum(1 << j for j in range(32) if x[w * 32 + j] > 0) for w in range(6)]
    assert np.array_equal(bal, np.repeat(np.array(words, np.uint32), 32))


def test_divergent_warp_calls_are_errors_in_gpu_shapes(monkeypatch):
    """A lane that skips a shuffle (undefined on a GPU, often a hang) and lanes of one warp in
    different warp calls fail with WarpDivergence naming the warp, not a hang."""
    _gpu_shapes()
    from numba_kernels import _simulator_warps as warps
    monkeypatch.setattr(warps, "TIMEOUT", 1.0)
    with pytest.raises(warps.WarpDivergence, match="shfl_xor_sync in block .*warp 0.*arrived"):
        _one_lane_away[1, 32](np.zeros(32, np.int32))
    with pytest.raises(warps.WarpDivergence, match="different warp calls"):
        _half_warps_differ[1, 32](np.zeros(32, np.uint32))


# The shared-memory race check (NUMBA_KERNELS_RACECHECK=1, on in test_simulator.py's runs):
# each kernel below has two warps of 32; ``how`` picks what stands between the accesses.

@cuda.jit
def _neighbour_read(out, how):
    """Thread t writes sh[t], then reads sh[t ^ 1] (its warp) and sh[t ^ 32] (the other)."""
    sh = cuda.shared.array(64, np.int32)
    t = cuda.threadIdx.x
    sh[t] = t
    if how == 1:
        cuda.syncthreads()
    elif how == 2:
        cuda.syncwarp(0xFFFFFFFF)
    out[t] = sh[t ^ 1]
    if how != 2:
        out[t] += sh[t ^ 32]


@cuda.jit
def _counting(out, how):
    """Every thread adds 1 to one shared counter that thread 0 zeroed."""
    sh = cuda.shared.array(1, np.int32)
    if cuda.threadIdx.x == 0:
        sh[0] = 0
    if how >= 1:
        cuda.syncthreads()
    if how == 2:
        sh[0] += 1          # a plain read-modify-write: a race
    else:
        cuda.atomic.add(sh, 0, 1)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        out[0] = sh[0]


def _race_check():
    import os

    from numba_kernels import _simulator_races as races
    if os.environ.get("NUMBA_KERNELS_RACECHECK") != "1":
        pytest.skip("needs NUMBA_KERNELS_RACECHECK=1 (test_simulator.py sets it)")
    return races


def test_race_check_orders_by_barriers_and_warp_calls():
    """A block barrier orders accesses across warps; a warp call orders them within a warp
    only; nothing between them is a race; atomics do not race with each other."""
    races = _race_check()
    out = np.zeros(64, np.int32)
    _neighbour_read[1, 64](out, 1)
    t = np.arange(64)
    assert np.array_equal(out, (t ^ 1) + (t ^ 32))
    _neighbour_read[1, 64](out, 2)
    assert np.array_equal(out, t ^ 1)
    with pytest.raises(races.MemoryRace, match=r"sim_kernels.py:\d+, element \d+: "
                                                     r"(read|written) by thread \d+"):
        _neighbour_read[1, 64](out, 0)
    _counting[1, 64](out, 1)
    assert out[0] == 64


def test_race_check_finds_plain_accesses_among_atomics_and_missing_barriers():
    races = _race_check()
    out = np.zeros(1, np.int32)
    # thread 0's zeroing against the others' atomics (which comes first is the scheduler's)
    with pytest.raises(races.MemoryRace, match=r"written by thread 0 .*then updated atomically|"
                                               r"updated atomically by .*then written by thread 0"):
        _counting[1, 64](out, 0)
    with pytest.raises(races.MemoryRace):
        _counting[1, 64](out, 2)


@cuda.jit
def _blocks_write(out, how):
    """Every block writes out[0] and out[1 + its index]: its index, or the same value, or (one
    block) twice with a barrier between."""
    b = cuda.blockIdx.x
    if cuda.threadIdx.x == 0:
        out[1 + b] = b
        out[0] = b if how == 0 else 7
    if how == 2:
        cuda.syncthreads()
        if cuda.threadIdx.x == 1:
            out[0] = 9


def test_race_check_in_device_memory():
    """Blocks that write different values to one element race (the simulator's last block
    would win every time); equal values, and one block's writes ordered by a barrier, do not;
    the check works by byte, so a byte view of the same memory counts as well."""
    races = _race_check()
    out = np.zeros(5, np.int32)
    with pytest.raises(races.MemoryRace, match=r"_blocks_write: element \(0,\) of a int32\[5\] "
                                               r"device array: thread 0 of block \(0, 0, 0\)"):
        _blocks_write[4, 2](out, 0)
    _blocks_write[4, 2](out, 1)
    assert list(out) == [7, 0, 1, 2, 3]
    _blocks_write[1, 2](out, 2)
    assert out[0] == 9
    words = cuda.to_device(np.zeros(2, np.int32))
    with pytest.raises(races.MemoryRace, match=r"uint8\[8\] device array: thread 0 of block "
                                               r"\(0, 0, 0\) and thread 0 of block \(1, 0, 0\)"):
        _word_and_byte[2, 1](words, words.view(np.uint8))


@cuda.jit
def _word_and_byte(words, bytes_):
    """Block 0 writes word 0, block 1 its second byte through a byte view."""
    if cuda.blockIdx.x == 0:
        words[0] = 0x01020304
    else:
        bytes_[1] = 0x55


@cuda.jit
def _barrier_rounds(out, early, fail_at):
    """Three rounds of: post, barrier, read the next live thread's post, barrier. Threads
    below ``early`` return at once; thread ``fail_at`` indexes past ``out`` in round 1."""
    t = cuda.threadIdx.x
    if t < early:
        return
    posts = cuda.shared.array(64, np.int32)
    live = cuda.blockDim.x - early
    for r in range(3):
        posts[t] = 100 * r + t
        cuda.syncthreads()
        row = 3 if r == 1 and t == fail_at else r
        out[row, t] = posts[early + (t - early + 1) % live]
        cuda.syncthreads()


def test_block_barrier_opens_once_every_live_thread_waits():
    """``numba_kernels._simulator_blocks``' barrier (the simulator's, without its polling
    loop): every round reads the posts of that round; threads that returned do not hold it
    shut; a thread's exception ends the launch with it, naming the thread, and no hang."""
    for early in (0, 5):
        out = np.full((3, 64), -1, np.int32)
        _barrier_rounds[1, 64](out, early, -1)
        t = np.arange(early, 64)
        neighbour = early + (t - early + 1) % (64 - early)
        for r in range(3):
            assert np.array_equal(out[r, early:], 100 * r + neighbour), (early, r)
        assert (out[:, :early] == -1).all()
    with pytest.raises(IndexError, match=r"tid=\[9, 0, 0\]"):
        _barrier_rounds[1, 64](np.zeros((3, 64), np.int32), 0, 9)


def test_threads_asking_at_once_get_one_shared_array():
    """Two threads ask for a line's shared array and both make one before either stores it
    (the barrier holds each inside ``make``): both must get the array stored first. The
    simulator's own get-then-store gave each its own array, splitting the block's memory."""
    import threading

    from numba_kernels._simulator_compat import shared_array_of_line
    allocations, got = {}, [None, None]
    both_made = threading.Barrier(2)

    def make():
        both_made.wait(timeout=10)
        return object()

    def ask(slot):
        got[slot] = shared_array_of_line(allocations, ("kernel.py", 7), make)
    threads = [threading.Thread(target=ask, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got[0] is got[1] is allocations[("kernel.py", 7)]


@contextlib.contextmanager
def frequent_thread_switches():
    """The interpreter switching threads every microsecond instead of every 5 ms, so that the
    simulator's threads interleave as finely as a GPU's."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@cuda.jit
def _neighbour_in_shared(out):
    sh = cuda.shared.array(64, np.int32)
    t = cuda.threadIdx.x
    sh[t] = t
    cuda.syncthreads()
    out[t] = sh[(t + 1) % 64]


def test_shared_array_is_whole_under_frequent_thread_switches():
    """Each thread reads its neighbour's post through the kernel's shared array, with the
    interpreter switching threads every microsecond: 1-2% of launches read a post never made
    through their array when the simulator split it (every one of five runs failed then)."""
    with frequent_thread_switches():
        for launch in range(80):
            out = np.full(64, -1, np.int32)
            _neighbour_in_shared[1, 64](out)
            assert np.array_equal(out, (np.arange(64) + 1) % 64), (launch, out)


@cuda.jit
def _two_threads(out):
    t = cuda.threadIdx.x
    if t == 1:
        out[t] = leaves_first()
    else:
        time.sleep(0.01)       # enter after thread 1 has swapped sim_swap_helpers' cuda
        out[t] = stays_longer()


def test_two_threads_inside_one_modules_device_functions():
    """Thread 1 enters a device function of ``sim_swap_helpers`` and returns while thread 0,
    which entered another one of that module later, is still inside. The simulator alone put
    the real ``numba.cuda`` back on thread 1's return, and thread 0 failed on
    ``cuda.threadIdx``; ``numba_kernels._simulator_compat`` keeps the fake module in until the
    kernel ends.
    (The kernel sits in another module than the device functions, as qsgd's kernels do with
    ``common``'s: within the kernel's own module the launch's swap covers every thread.)"""
    out = np.full(2, -1, np.int64)
    _two_threads[1, 2](out)
    assert list(out) == [0, 1]


@cuda.jit
def _lanes_through_a_helper(out):
    out[cuda.threadIdx.x] = own_lane()


def test_threads_entering_a_module_at_once_all_find_the_fake_cuda():
    """A block's 64 threads make the launch's first calls into ``sim_swap_helpers`` together,
    the interpreter switching threads every microsecond. A module is swapped once per launch
    and recorded as swapped only after its ``cuda`` names are replaced, so every thread finds
    the fake module; the real one is back after each launch."""
    import sim_swap_helpers
    with frequent_thread_switches():
        for launch in range(40):
            out = np.full(64, -1, np.int64)
            _lanes_through_a_helper[1, 64](out)
            assert np.array_equal(out, np.arange(64)), (launch, out)
            assert sim_swap_helpers.cuda is cuda, launch


@cuda.jit
def _array_attributes(x, out, missing):
    out[0] = x.size
    out[1] = x.shape[1]
    out[2] = x.ndim
    out[3] = x[1].size          # a row: a device array of its own
    if missing:
        out[4] = x.no_such_attribute


def test_array_attributes_inside_a_kernel():
    """The simulator's attribute lookup on device arrays, replaced by one that reads the names
    from a set made once per array type: the NumPy array's attributes, of views too, and
    AttributeError for a name it lacks."""
    out = np.zeros(5, np.int64)
    _array_attributes[1, 1](np.zeros((2, 3), np.float32), out, False)
    assert list(out[:4]) == [6, 3, 2, 3]
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _array_attributes[1, 1](np.zeros((2, 3), np.float32), out, True)


def test_topk_segments_equal_the_per_tensor_calls():
    """Many tensors, each with its own k, one launch per stage (L-GreCo's top-k exchange):
    k of 0, 1, all and between, ties, an empty tensor, int64 indices with an odd k (padding),
    with and without a residual."""
    dc.check_topk_segments([(45, 3), (1, 1), (0, 0), (200, 0), (31, 31), (64, 7)], True)
    dc.check_topk_segments([(90, 5), (17, 3)], False, "int64", "ties")
    dc.check_topk_segments([(300, 30), (5, 2)], True, "int64", "ties")


def test_topk_segments_too_large_for_a_block(monkeypatch):
    """Segments above ONE_BLOCK_KEYS keys (patched to 40 here) take the per-tensor functions,
    beside the segments that one block does: the same bytes."""
    from numba_kernels._cuda import select
    monkeypatch.setattr(select, "ONE_BLOCK_KEYS", 40)
    dc.check_topk_segments([(45, 3), (30, 25), (12, 4), (100, 0)], True, one_launch=False)
    dc.check_topk_segments([(45, 3), (30, 15)], False, "int64", "ties", one_launch=False)
    dc.check_topk_segments([(45, 21), (41, 30)], True, one_launch=False)   # none fits a block
