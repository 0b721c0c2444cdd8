"""Kernel launches and host reads of every format, counted under Numba's CUDA simulator.

Not collected by the normal run (the simulator must be enabled before numba.cuda
is imported): ``test_simulator.py`` runs this file in its simulator subprocess,
next to ``sim_kernels.py``.  The formats and their compressors come from
``numba_kernels.registry``; the count each call must make is the one its
docstring documents ("Device launches: N ..."), so the documentation the
library's host-overhead accounting relies on cannot drift from the code.
Launch counts do not depend on the block size, so they hold on a real GPU too.
"""
import inspect
import re

import numpy as np
import pytest
from numba import config

if not config.ENABLE_CUDASIM:
    pytest.skip("run with NUMBA_ENABLE_CUDASIM=1 (see test_simulator.py)", allow_module_level=True)

from numba import cuda  # noqa: E402

import numba_kernels as nk  # noqa: E402
from numba_kernels import _sparse_rules  # noqa: E402
from numba_kernels._cuda import select  # noqa: E402
from numba_kernels.registry import CODECS  # noqa: E402
from numba_kernels.wire import Payload  # noqa: E402

N = 1000
# Values for compressor parameters that have no default (k of top-k and random-k).
REQUIRED = {"k": 10}
CALLS = [(codec, compress) for codec in CODECS for compress in codec.compressors]


def documented_launches(fn):
    """N of the "Device launches: N" line in fn's docstring."""
    found = re.search(r"Device launches: (\d+)", inspect.getdoc(fn) or "")
    assert found, f"{fn.__module__}.{fn.__qualname__} does not document its device launches"
    return int(found.group(1))


def required_arguments(compress):
    after_x = list(inspect.signature(compress).parameters.values())[1:]
    return {p.name: REQUIRED[p.name] for p in after_x if p.default is inspect.Parameter.empty}


def device_data(n=N, seed=0):
    return cuda.to_device(np.random.default_rng(seed).standard_normal(n).astype(np.float32))


HOST_READS = []   # one entry per copy of device memory to the host or synchronisation


def counts():
    """(kernel launches, host reads of the device) since the test's start."""
    return nk.launch_count(), len(HOST_READS)


@pytest.fixture(autouse=True)
def zeroed_counters(warm_scratch, monkeypatch):
    """Count every way the host could wait for the device: copies to the host and explicit
    synchronisation (the simulator's, which the library would call on a GPU)."""
    from numba.cuda.simulator import api
    from numba.cuda.simulator.cudadrv import devicearray

    def counting(name, original):
        def wrapper(*args, **kwargs):
            HOST_READS.append(name)
            return original(*args, **kwargs)
        return wrapper

    for owner, name in ((devicearray.FakeCUDAArray, "copy_to_host"), (api, "synchronize"),
                        (api.stream, "synchronize")):
        monkeypatch.setattr(owner, name, counting(name, getattr(owner, name)))
    nk.reset_launch_count()
    HOST_READS.clear()
    yield


@pytest.fixture(scope="module")
def warm_scratch():
    warm()


def warm():
    """The grid selection's scratch arrays, allocated at the largest size the tests ask for:
    only a thread's first selection on a grid allocates (and zeroes its state and histogram,
    2-3 launches), and the counts below are those of every later call."""
    saved = _sparse_rules.APPROX_MIN_N, select.ONE_BLOCK_KEYS
    _sparse_rules.APPROX_MIN_N, select.ONE_BLOCK_KEYS = 1000, 0
    try:
        nk.compress_topk(device_data(2000), 20, method="approx")
        a, b = nk.compress_topk(device_data(seed=1), 10), nk.compress_topk(device_data(seed=2), 10)
        nk.merge_topk(a, b)
    finally:
        _sparse_rules.APPROX_MIN_N, select.ONE_BLOCK_KEYS = saved


def test_the_documented_one_block_limit():
    """The docstrings give ONE_BLOCK_KEYS as 32,768 on a GPU and 4,096 here: 8 tiles of
    THREADS x ITEMS keys, THREADS being 256 on a GPU and 32 under the simulator."""
    from numba_kernels._cuda.geometry import ITEMS, THREADS
    assert (THREADS, ITEMS) == (32, 16)
    assert select.ONE_BLOCK_KEYS == 8 * THREADS * ITEMS == 4096
    assert 8 * 256 * ITEMS == 32768
    assert select.one_block(4096) and not select.one_block(4097)
    for fn in (nk.compress_topk, nk.merge_topk):
        doc = " ".join(inspect.getdoc(fn).split())
        assert "32,768" in doc and "4,096 under the simulator" in doc, fn.__name__


@pytest.mark.parametrize("codec, compress", CALLS, ids=[fn.__name__ for _, fn in CALLS])
def test_each_call_launches_what_its_docstring_says(codec, compress):
    encode = documented_launches(compress)
    decode = documented_launches(codec.decode_device)
    x = device_data()
    kwargs = required_arguments(compress)
    assert counts() == (0, 0)
    p = compress(x, **kwargs)
    assert isinstance(p.format, codec.format)
    assert counts() == (encode, 0)
    compress(x, out=p.buffer, **kwargs)              # every call adds the same again
    assert counts() == (2 * encode, 0)
    out = cuda.device_array(N, np.float32)
    nk.decompress(p, out=out)
    assert counts() == (2 * encode + decode, 0)
    nk.decompress(p, out=out)
    assert counts() == (2 * (encode + decode), 0)
    assert nk.device_allocations() == 1      # p's buffer: the one call given no out=
    nk.reset_launch_count()
    assert counts() == (0, 0)


# The documented variants of the calls above (the numbers after the first in the docstrings).

@pytest.mark.parametrize("compress", [
    lambda x: nk.compress_minmax(x, bits=4, chunk=4128),
    lambda x: nk.compress_qsgd(x, chunk=4100),
    lambda x: nk.compress_onebit(x, chunk=4128),
], ids=["minmax", "qsgd", "onebit"])
def test_chunks_longer_than_a_segment_take_three_launches(compress):
    compress(device_data(5000))
    assert counts() == (3, 0)


def test_residual_and_padding_of_the_sparse_formats():
    """One block adds the residual inside its one launch; padding (int64 indices, odd k)
    takes a launch of its own."""
    x, e = device_data(), cuda.to_device(np.zeros(N, np.float32))
    for method in ("exact", "approx"):
        nk.reset_launch_count()
        nk.compress_topk(x, 10, residual=e, method=method)
        assert counts() == (1, 0)
    nk.reset_launch_count()
    nk.compress_topk(x, 11, index_dtype="int64", residual=e)   # 11 * 12 bytes: 4 of padding
    assert counts() == (1 + 1, 0)
    nk.reset_launch_count()
    nk.compress_randk(x, 11, index_dtype="int64", residual=e)
    assert counts() == (1 + 2, 0)
    nk.reset_launch_count()
    nk.compress_topk(x, 0, residual=e)
    assert counts() == (1, 0)


def test_residual_and_padding_of_a_grid_selection(grid_selection):
    """Above ONE_BLOCK_KEYS: the exact selection's 7 launches, +1 each for the residual and
    the padding."""
    x, e = device_data(), cuda.to_device(np.zeros(N, np.float32))
    nk.compress_topk(x, 10, residual=e)
    assert counts() == (7 + 1, 0)
    nk.reset_launch_count()
    nk.compress_topk(x, 11, index_dtype="int64")
    assert counts() == (7 + 1, 0)
    nk.reset_launch_count()
    nk.compress_topk(x, 11, index_dtype="int64", residual=e)
    assert counts() == (7 + 2, 0)


@pytest.mark.parametrize("one_block_entries", [None, 1],
                         ids=["small stack: one block", "large stack: a grid per row"])
def test_decoding_a_stack(monkeypatch, one_block_entries):
    """A dense format's stack decodes in one pass; a sparse one zeroes out and then scatters
    its rows with one block (1 more launch), or with a grid per row above
    ONE_BLOCK_ENTRIES (rows more)."""
    from numba_kernels._cuda import topk as kern
    if one_block_entries is not None:
        monkeypatch.setattr(kern, "ONE_BLOCK_ENTRIES", one_block_entries)
    x = device_data()
    for compress, rows, one_pass in [(nk.compress_minmax, 3, True),
                                     (lambda x: nk.compress_topk(x, 10), 3, False)]:
        scatters = 1 if one_block_entries is None else rows
        p = compress(x)
        host = np.stack([p.buffer.copy_to_host()] * rows)
        stack = cuda.to_device(host)
        mat = np.zeros((rows, 16 + p.nbytes + 8), np.uint8)   # the payloads at a column
        mat[:, 16:16 + p.nbytes] = host
        mat = cuda.to_device(mat)
        out = cuda.device_array(N, np.float32)
        HOST_READS.clear()
        nk.reset_launch_count()
        nk.decompress_many(stack, p.format, out=out)
        assert nk.launch_count() == (1 if one_pass else 1 + scatters)
        nk.reset_launch_count()
        nk.decompress_many(stack, p.format, out=out, accumulate=True)
        assert nk.launch_count() == (1 if one_pass else scatters)
        nk.reset_launch_count()
        nk.decompress_many(stack, p.format, out=out, factor=0.5)   # dense: in the decode
        assert nk.launch_count() == (1 if one_pass else 1 + scatters + 1)
        nk.reset_launch_count()
        nk.decompress_many(stack[:0], p.format, out=out)
        assert nk.launch_count() == 1                 # no rows: zero out
        # payloads at a column of wider rows are read in place: the same launches, no copy
        nk.reset_launch_count()
        nk.decompress_many(mat, p.format, out=out, col=16)
        assert nk.launch_count() == (1 if one_pass else 1 + scatters)
        assert not HOST_READS


@pytest.mark.parametrize("plan", ["sample holds", "too few candidates", "too many"])
def test_the_approximate_method_never_waits_for_the_host(monkeypatch, grid_selection, plan):
    """12 launches and no host read whichever way the device goes (it decides by itself
    whether to select among the candidates or over the whole array), and no allocation."""
    from numba_kernels._cuda import topk as dev_topk
    monkeypatch.setattr(_sparse_rules, "APPROX_MIN_N", 1000)
    m, ks, cap = _sparse_rules.sample_plan(2000, 20)
    forced = {"sample holds": (m, ks, cap), "too few candidates": (m, 1, cap),
              "too many": (m, ks, 20)}[plan]
    monkeypatch.setattr(dev_topk, "sample_plan", lambda n, k: forced)
    out = cuda.device_array(nk.TopKFormat(2000, 20).nbytes, np.uint8)
    nk.compress_topk(device_data(2000, seed=11), 20, method="approx", out=out)
    assert counts() == (12, 0)
    assert nk.device_allocations() == 0


def test_merge_restore_and_scale():
    a, b = nk.compress_topk(device_data(seed=1), 10), nk.compress_topk(device_data(seed=2), 10)
    nk.reset_launch_count()
    merged = nk.merge_topk(a, b)
    assert counts() == (documented_launches(nk.merge_topk), 0) == (1, 0)
    nk.reset_launch_count()
    nk.restore_unselected(cuda.device_array(N, np.float32), a, merged)
    assert counts() == (documented_launches(nk.restore_unselected), 0)
    nk.reset_launch_count()
    nk.scale_topk_values(Payload(merged.format, merged.buffer), 0.5)
    assert counts() == (documented_launches(nk.scale_topk_values), 0)
    nk.reset_launch_count()
    stack = cuda.to_device(np.stack([a.buffer.copy_to_host(), b.buffer.copy_to_host()] * 2))
    HOST_READS.clear()
    nk.scale_topk_stack(stack, a.format, 0.5)     # four rows, one launch
    assert counts() == (documented_launches(nk.scale_topk_stack), 0)
    assert nk.device_allocations() == 0           # since the merge, whose result was counted


def test_merge_on_a_grid(grid_selection):
    """Above ONE_BLOCK_KEYS entries in the union: prefill (2), union, the selection's 7."""
    a, b = nk.compress_topk(device_data(seed=1), 10), nk.compress_topk(device_data(seed=2), 10)
    out = cuda.device_array(a.format.nbytes, np.uint8)
    nk.reset_launch_count()
    nk.merge_topk(a, b, out=out)
    assert counts() == (10, 0)
    assert nk.device_allocations() == 0



ROW_CODECS = [codec for codec in CODECS if codec.compress_rows is not None]


@pytest.mark.parametrize("codec", ROW_CODECS, ids=[c.format.__name__ for c in ROW_CODECS])
@pytest.mark.parametrize("rows", [1, 4])
def test_row_forms_launch_what_their_docstrings_say_whatever_the_rows(codec, rows):
    """C_LP_S's phase-1 encode and final decode of n partitions: one launch each, not n."""
    encode = documented_launches(codec.compress_rows)
    decode = documented_launches(codec.decode_rows_device)
    assert (encode, decode) == (1, 1)
    x, e = device_data(rows * 250), cuda.to_device(np.zeros(rows * 250, np.float32))
    mat = cuda.device_array((rows, 8 + 1024), np.uint8)   # wide enough for 250 elements
    assert counts() == (0, 0)
    fmt = codec.compress_rows(x, mat, 8, residual=e)
    assert isinstance(fmt, codec.format) and fmt.n == 250
    assert counts() == (encode, 0)
    codec.compress_rows(x, mat, 8)
    assert counts() == (2 * encode, 0)
    nk.decompress_rows(mat, fmt, out=cuda.device_array(rows * 250, np.float32), col=8)
    assert counts() == (2 * encode + decode, 0)


@pytest.mark.parametrize("compress", [
    lambda x, m: nk.compress_minmax_rows(x, m, bits=4, chunk=4128),
    lambda x, m: nk.compress_qsgd_rows(x, m, chunk=4100),
    lambda x, m: nk.compress_onebit_rows(x, m, chunk=4128),
], ids=["minmax", "qsgd", "onebit"])
def test_row_forms_of_chunks_longer_than_a_segment_take_three_launches(compress):
    compress(device_data(2 * 4200), cuda.device_array((2, 8 * 1024), np.uint8))
    assert counts() == (3, 0)


def test_scratch_arrays_are_kept_per_thread_and_stream_and_grow(monkeypatch):
    """A thread's calls on one stream reuse one array per name (a view of the largest asked
    for); another thread, or another stream, gets its own, since its launches could interleave;
    another device too (the simulator has one: its id stands in)."""
    import threading

    from numba_kernels import _device
    from numba_kernels._cuda.scratch import scratch

    def pointer(arr):   # the simulator's device arrays wrap NumPy arrays
        return arr._ary.__array_interface__["data"][0]

    first = scratch("test.a", 100, np.int64, 0)
    assert nk.device_allocations() == 1
    smaller = scratch("test.a", (5, 2), np.int64, 0)
    assert smaller.shape == (5, 2) and pointer(smaller) == pointer(first)
    assert nk.device_allocations() == 1
    scratch("test.a", 101, np.int64, 0)                   # larger: a new array
    assert nk.device_allocations() == 2
    other = {}
    thread = threading.Thread(target=lambda: other.update(a=scratch("test.a", 10, np.int64, 0)))
    thread.start()
    thread.join()
    assert pointer(other["a"]) != pointer(scratch("test.a", 10, np.int64, 0))
    assert pointer(scratch("test.a", 10, np.int64, cuda.stream())) != pointer(first)
    assert pointer(scratch("test.a", 10, np.float32, 0)) != pointer(first)
    assert nk.device_allocations() == 5
    monkeypatch.setattr(_device, "current_device_id", lambda: 1)   # the same thread on GPU 1
    assert pointer(scratch("test.a", 10, np.int64, 0)) != pointer(first)
    assert nk.device_allocations() == 6
    monkeypatch.undo()
    nk.release_scratch()                                  # dropped: allocated again
    scratch("test.a", 10, np.int64, 0)
    assert nk.device_allocations() == 7
    warm()                                                # for the tests that may follow
