"""The primitives on real CUDA tensors (marker ``gpu``; skipped with the reason elsewhere).

World size 1 (``MPI.COMM_SELF``): every step of the device paths still runs (kernels,
partitioning, staging or device MPI buffers, decode), and the result must be the host path's
bytes. The staged runs must copy payloads only (``accounting.staging``): no dense tensor
leaves the device. ``tests/gpu/run.sh`` runs these with the multi-rank training check.
"""
import pytest
import torch

from mpi_harness import skip_unless_mpi_cuda_aware

pytestmark = pytest.mark.gpu


def _reason():
    try:
        from numba import cuda
        if not torch.cuda.is_available() or not cuda.is_available():
            return "no CUDA GPU (torch and numba.cuda must both see one)"
    except Exception as exc:  # noqa: BLE001
        return f"numba.cuda unusable: {exc}"
    return None


REASON = _reason()
needs_gpu = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(params=["staged", "aware"])
def mode(request):
    from bagua_mpi import cuda as bcuda
    if request.param == "aware":
        if REASON is None:
            skip_unless_mpi_cuda_aware()
        bcuda.set_cuda_aware(True)
    else:
        bcuda.set_cuda_aware(False)
    yield request.param
    bcuda.set_cuda_aware(None)


def _comm():
    from mpi4py import MPI
    return MPI.COMM_SELF


@needs_gpu
@pytest.mark.parametrize("codec_name", ["minmax", "qsgd", "onebit"])
def test_clps_on_device_matches_host(codec_name, mode):
    from bagua_mpi.accounting import staging
    from bagua_mpi.primitives import MinMaxCodec, OneBitCodec, QSGDCodec
    from bagua_mpi.primitives.lowprec import Segment, packed_compressed_allreduce_
    codec = {"minmax": MinMaxCodec(8, 1024), "qsgd": QSGDCodec(127, 1024),
             "onebit": OneBitCodec(4096)}[codec_name]
    g = torch.Generator().manual_seed(1)
    sizes = [1_000_003, 4096, 77]
    host = [torch.randn(n, generator=g) for n in sizes]
    dev = [h.cuda() for h in host]
    he = [torch.zeros(n) for n in sizes]
    de = [e.cuda() for e in he]
    hs = [torch.zeros(n) for n in sizes]
    ds = [e.cuda() for e in hs]
    for step in range(3):
        packed_compressed_allreduce_([Segment(x, codec, w, s, seed=step) for x, w, s in
                                      zip(host, he, hs)], _comm(), scale=0.5)
        staging.reset()
        packed_compressed_allreduce_([Segment(x, codec, w, s, seed=step) for x, w, s in
                                      zip(dev, de, ds)], _comm(), scale=0.5)
        torch.cuda.synchronize()
        snap = staging.snapshot()
        for a, b in zip(host + he + hs, dev + de + ds):
            assert torch.equal(a, b.cpu())
        assert snap["dense_d2h_bytes"] == 0, snap
        assert snap["largest_d2h"] < 1_000_003 * 4 // 3, snap  # payloads only
        if mode == "aware":
            assert snap["d2h_bytes"] == 0, snap


@needs_gpu
def test_minmax_layers_in_common_memory_take_four_launches(mode):
    """L-GreCo's min-max exchange on CUDA tensors: layers at their own widths, their gradients
    views of one bucket and their error memories end to end, run in 4 launches for all of them
    (``lowprec._Together``), where each layer takes 4 of its own; the host path's bytes."""
    from bagua_mpi.primitives import MinMaxCodec
    from bagua_mpi.primitives.lowprec import (Segment, packed_compressed_allreduce_,
                                              padded_length, partition_length)
    sizes, widths = [300_001, 4096, 77, 1, 20_000], [4, 8, 3, 2, 6]
    offsets = [sum(sizes[:j]) + 8 * j for j in range(len(sizes))]   # gaps between the layers
    g = torch.Generator().manual_seed(3)
    bucket = torch.randn(offsets[-1] + sizes[-1], generator=g)
    worker = torch.zeros(sum(padded_length(n, 1) for n in sizes))
    server = torch.zeros(sum(partition_length(n, 1) for n in sizes))

    def layers(flat, w, s):
        wat = [sum(padded_length(n, 1) for n in sizes[:j]) for j in range(len(sizes))]
        sat = [sum(partition_length(n, 1) for n in sizes[:j]) for j in range(len(sizes))]
        return [Segment(flat[o:o + n], MinMaxCodec(b, 1024), w[wa:wa + padded_length(n, 1)],
                        s[sa:sa + partition_length(n, 1)])
                for o, n, b, wa, sa in zip(offsets, sizes, widths, wat, sat)]
    _device_as_host(lambda *memories: packed_compressed_allreduce_(layers(*memories), _comm(),
                                                                   scale=0.5),
                    (bucket, worker, server), launches=4)


@needs_gpu
def test_topk_layers_in_common_memory_take_two_launches(mode):
    """L-GreCo's top-k exchange on CUDA tensors: layers with their own k, their gradients views
    of one bucket and their residuals end to end, selected in 1 launch and decoded in 1 for all
    of them at world size 1 (``numba_kernels.topk_segments``), where each layer took 5 of its
    own (select, restore, scale, zero fill, scatter); the host path's bytes."""
    from bagua_mpi.primitives.sparse import SparseSegment, packed_gtopk_allreduce_
    sizes, ks = [20_000, 4096, 77, 1, 32_768], [200, 4096, 3, 1, 33]
    offsets = [sum(sizes[:j]) + 8 * j for j in range(len(sizes))]   # gaps between the layers
    g = torch.Generator().manual_seed(4)
    bucket = torch.randn(offsets[-1] + sizes[-1], generator=g)
    residual = torch.randn(sum(sizes), generator=g) * 0.1

    def layers(flat, res):
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        return [SparseSegment(flat[o:o + n], k, res[r:r + n])
                for o, n, k, r in zip(offsets, sizes, ks, starts)]
    _device_as_host(lambda *memories: packed_gtopk_allreduce_(layers(*memories), _comm(),
                                                              scale=0.5),
                    (bucket, residual), launches=2)


def _device_as_host(exchange, memories, launches, steps=3):
    """``exchange(*memories)`` on copies of the host tensors and on CUDA copies, ``steps``
    times: the same bytes in every memory after each step, and ``launches`` kernel launches a
    step on the device."""
    import numba_kernels as nk
    host = tuple(t.clone() for t in memories)
    dev = tuple(t.cuda() for t in memories)
    for step in range(steps):
        exchange(*host)
        before = nk.launch_count()
        exchange(*dev)
        assert nk.launch_count() - before == launches, nk.launch_count() - before
        torch.cuda.synchronize()
        for a, b in zip(host, dev):
            assert torch.equal(a, b.cpu()), step


@needs_gpu
def test_topk_gtopk_powersgd_on_device_match_host(mode):
    from bagua_mpi.accounting import staging
    from bagua_mpi.primitives import (LowRankSegment, gtopk_allreduce_, initial_q,
                                      powersgd_allreduce_, topk_allgather_)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200_000, generator=g)
    for fn in (topk_allgather_, gtopk_allreduce_):
        a, b = x.clone(), x.clone().cuda()
        ra, rb = torch.zeros_like(a), torch.zeros_like(b)
        staging.reset()
        for _ in range(2):
            fn(a, _comm(), 500, ra, scale=1.0)
            fn(b, _comm(), 500, rb, scale=1.0)
        assert torch.equal(a, b.cpu()) and torch.equal(ra, rb.cpu()), fn.__name__
        assert staging.snapshot()["dense_d2h_bytes"] == 0, (fn.__name__, staging.snapshot())
    m = torch.randn(512 * 300, generator=g)
    q = initial_q(300, 4, 0)
    a, b = m.clone(), m.clone().cuda()
    ea, eb = torch.zeros_like(a), torch.zeros_like(b)
    qa, qb = q.clone(), q.clone().cuda()
    staging.reset()
    powersgd_allreduce_([LowRankSegment(a, 512, 4, qa, ea)], _comm())
    powersgd_allreduce_([LowRankSegment(b, 512, 4, qb, eb)], _comm())
    # torch's CUDA and CPU matrix products round differently: close, not equal
    torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(qb.cpu(), qa, rtol=1e-4, atol=1e-5)
    snap = staging.snapshot()
    assert snap["dense_d2h_bytes"] == 0 and snap["largest_d2h"] <= 512 * 4 * 4, snap


@needs_gpu
@pytest.mark.parametrize("aware", ["0", "1"], ids=["staged", "cuda-aware"])
def test_adasum_combines_cuda_tensors_on_the_device(aware):
    """``op=Adasum`` on CUDA tensors at 2 ranks sharing the GPU: the halves go by the device
    carrier, the result is a CUDA tensor, and a grouped call's kernels do not grow with its
    tensors (``tests/mpi/adasum_suite.py --cuda``)."""
    from mpi_harness import assert_check_passed, run_mpi
    if aware == "1":
        skip_unless_mpi_cuda_aware()
    checks = ["cuda_tensors_stay_on_device", "grouped_cuda_launches_do_not_grow"]
    result = run_mpi("adasum_suite.py", 2, "--cuda",
                     *(arg for check in checks for arg in ("--check", check)),
                     env={"BAGUA_MPI_CUDA_AWARE": aware, "BAGUA_MPI_BACKEND": "mpi"})
    for check in checks:
        assert_check_passed(result, check)


@needs_gpu
def test_onebit_adam_update_launches_do_not_grow_on_the_device():
    """1-bit Adam's compressed-stage update of CUDA parameters (foreach lists): close to the
    expression a parameter at a time (the foreach kernels may contract differently), and for
    256 tensors at most one kernel per 8 tensors more than for 16 of the same elements, where a
    parameter at a time launched four per tensor (torch's profiler's count)."""
    from bagua_mpi.algorithms.onebit_adam import _frozen_variance_updates_
    from dispatch_count import cuda_kernels

    kernels = {}
    for tensors in (16, 256):
        g = torch.Generator().manual_seed(tensors)
        slices = [tuple(t.cuda() for t in (torch.randn(4096 // tensors, generator=g),
                                             torch.randn(4096 // tensors, generator=g),
                                             torch.rand(4096 // tensors, generator=g)))
                  for _ in range(tensors)]
        want = [p.add(m / (v.sqrt() + 1e-8), alpha=-1e-3) for p, m, v in slices]
        kernels[tensors] = cuda_kernels(lambda: _frozen_variance_updates_(slices, 1e-3, 1e-8))
        for (p, _, _), w in zip(slices, want):
            torch.testing.assert_close(p, w, rtol=1e-6, atol=1e-7)
    assert kernels[256] - kernels[16] <= (256 - 16) // 8, f"CUDA kernels by tensors {kernels}"


@needs_gpu
def test_powersgd_exchange_kernels_grow_only_by_the_layers_products(mode):
    """``powersgd_allreduce_`` of CUDA layers (error feedback on): 64 layers launch at most
    the kernels of 56 layers' four matrix products (counted alone, on the same shapes) more
    than 8 do, where each layer took three more operations besides before (its error sum,
    and the warm start's select and copy). Torch's profiler counts every thread's kernels."""
    from bagua_mpi.primitives import LowRankSegment, initial_q, powersgd_allreduce_
    from dispatch_count import cuda_kernels

    rows, cols, rank = 96, 80, 4
    m = torch.randn(rows, cols, device="cuda")
    q = torch.randn(cols, rank, device="cuda")
    p = torch.randn(rows, rank, device="cuda")
    products = cuda_kernels(lambda: (torch.mm(m, q), torch.mm(m.t(), p),
                                     m.addmm_(p, q.t(), alpha=-1.0), torch.mm(p, q.t())))
    kernels = {}
    for layers in (8, 64):
        g = torch.Generator().manual_seed(layers)
        segments = [LowRankSegment(torch.randn(rows * cols, generator=g).cuda(), rows, rank,
                                   initial_q(cols, rank, j).cuda(),
                                   torch.zeros(rows * cols, device="cuda"))
                    for j in range(layers)]
        powersgd_allreduce_(segments, _comm())  # the layout's index maps made, memory cached
        kernels[layers] = cuda_kernels(lambda: powersgd_allreduce_(segments, _comm()))
    assert kernels[64] - kernels[8] <= products * 56, (
        f"CUDA kernels by layers {kernels}; one layer's products alone: {products}")


@needs_gpu
def test_powersgd_alike_layers_in_common_memory_take_their_products_as_one_batch(mode):
    """CUDA layers of one shape and rank whose matrices, Q's and gradients each lie at one
    stride (as PowerSGD lays out a bucket's): as many CUDA kernels for 32 such layers as for 4
    (a batched GEMM each product), and the results, Q's and error memories of each layer's own
    products (the same layers cloned into memory of their own), to float32 roundoff."""
    from bagua_mpi.primitives import powersgd_allreduce_
    from dispatch_count import cuda_kernels
    from powersgd_suite import common_memory_layers, each_in_own_memory

    kernels = {}
    for layers in (4, 32):
        segments = common_memory_layers(layers, 0, 5, device="cuda")
        powersgd_allreduce_(segments, _comm())  # the layout's index maps made, memory cached
        kernels[layers] = cuda_kernels(lambda: powersgd_allreduce_(segments, _comm()))
    assert kernels[32] == kernels[4], f"CUDA kernels by alike layers {kernels}"
    batched = common_memory_layers(8, 0, 6, device="cuda")
    alone = each_in_own_memory(batched)
    for segments in (batched, alone):
        powersgd_allreduce_(segments, _comm())
    for a, b in zip(batched, alone):
        for what in ("flat", "q", "error"):
            torch.testing.assert_close(getattr(a, what), getattr(b, what), rtol=1e-5,
                                       atol=1e-5)
