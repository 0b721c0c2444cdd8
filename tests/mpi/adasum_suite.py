"""Adasum (``op=hvd.Adasum``) against an independent NumPy simulation of all ranks.

Run by every rank under mpiexec (tests/test_adasum_mpi.py); each check reports on its own line
(tests/mpi/checks.py). The simulation (``simulate.adasum_all``) combines whole vectors in a
binary tree over ranks in extended precision; bagua_mpi distributes the work by vector halving,
so the two share the formula and nothing else.

Adasum needs a power-of-two number of ranks (Horovod's rule). With 2^k ranks the checks run on
the global set; with any other count they run on a process set of the first 2^k ranks (the
others skip them), and ``non_power_of_two`` checks that the global set refuses.
"""
import contextlib
import sys

import numpy as np
import torch

import bagua_mpi as hvd
from bagua_mpi.exceptions import MisuseError
from checks import run_checks
from dispatch_count import DispatchCount, cuda_kernels
from simulate import TORCH_DTYPES, adasum_all, as_f64, reduce_all

SEED = 20261124
# relative to the largest element of the expected result
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-12}
FLOATS = ("float16", "bfloat16", "float32", "float64")

SETS = {}  # "math": where Adasum runs (power-of-two size); "odd": a set of 3 ranks, if any


def member():
    """(process set, rank in it, its size) for a rank of the math set, else None."""
    ps = SETS["math"]
    if not ps.included():
        return None
    return ps, ps.rank(), ps.size()


def inp(tag, r, shape, dtype="float32", scale=1.0):
    """Rank r's input for ``tag`` (every rank can build every rank's), rounded to ``dtype``."""
    rng = np.random.default_rng([SEED, r, sum(map(ord, tag))])
    return torch.from_numpy(rng.standard_normal(shape) * scale).to(TORCH_DTYPES[dtype])


def close(got, inputs, what, pre=1.0, post=1.0, expected=None, tol=None):
    """``got`` (tensor or array) against the simulation of ``inputs``, to ``tol`` (TOL of its
    dtype by default)."""
    if isinstance(got, np.ndarray):
        got = torch.from_numpy(got)
    dtype = str(inputs[0].dtype).replace("torch.", "")
    assert got.dtype == inputs[0].dtype, f"{what}: dtype {got.dtype} != {inputs[0].dtype}"
    assert tuple(got.shape) == tuple(inputs[0].shape), f"{what}: shape {tuple(got.shape)}"
    want = adasum_all(inputs, pre, post) if expected is None else np.asarray(expected)
    have = as_f64(got)
    scale = np.max(np.abs(want)) if want.size else 0.0
    if scale == 0.0:
        assert not np.any(have), f"{what}: expected zeros, got {have}"
        return
    err = np.max(np.abs(have - want)) / scale
    tol = TOL[dtype] if tol is None else tol
    assert np.all(np.isfinite(have)) and err <= tol, (
        f"{what}: relative error {err:.3g} > {tol} (largest |expected| {scale:.3g})")


def expect(exc, fn, needle):
    try:
        fn()
    except exc as e:
        assert needle in str(e), f"{exc.__name__} without {needle!r}: {e}"
        return e
    raise AssertionError(f"expected {exc.__name__} ({needle!r})")


# -- the checks ----------------------------------------------------------------------------------

def random_vs_simulation(rank, size):
    m = member()
    if m is None:
        return
    ps, r, n = m
    for dtype in ("float32", "float64"):
        for shape in ((0,), (1,), (2,), (7,), (5, 33), (100_003,)):
            what = f"{dtype} {shape}"
            xs = [inp("random" + what, q, shape, dtype) for q in range(n)]
            mine = xs[r].clone()
            close(hvd.allreduce(mine, op=hvd.Adasum, process_set=ps), xs, what)
            assert torch.equal(mine, xs[r]), f"{what}: input modified"
            assert hvd.allreduce_(mine, op=hvd.Adasum, process_set=ps) is mine
            close(mine, xs, what + " in place")
            arr = xs[r].numpy().copy()
            got = hvd.allreduce(arr, op=hvd.Adasum, process_set=ps)
            assert isinstance(got, np.ndarray)
            close(got, xs, what + " numpy")
    xs = [inp("hier", q, (70,), "float64") for q in range(n)]  # flat either way
    close(hvd.allreduce(xs[r], op=hvd.Adasum, process_set=ps, hierarchical=True), xs,
          "hierarchical=True")
    # a non-contiguous view, in place
    xs = [inp("strided", q, (9, 4), "float64") for q in range(n)]
    mine = xs[r].clone().t()
    hvd.allreduce_(mine, op="adasum", process_set=ps)
    close(mine.t(), xs, "non-contiguous in place")


def dtypes(rank, size):
    """float16/bfloat16 computed in float32 and rounded once; float32/float64 as they are."""
    m = member()
    if m is None:
        return
    ps, r, n = m
    for dtype in FLOATS:
        xs = [inp("dtype" + dtype, q, (1000,), dtype) for q in range(n)]
        got = hvd.allreduce(xs[r], op=hvd.Adasum, process_set=ps)
        close(got, xs, dtype)
        if dtype != "bfloat16":  # NumPy has no bfloat16
            got = hvd.allreduce(xs[r].numpy(), op=hvd.Adasum, process_set=ps)
            assert got.dtype == xs[r].numpy().dtype
            close(got, xs, dtype + " numpy")
    # Compression.fp16: float16 on the wire (Adasum of the rounded inputs), float32 back
    xs = [inp("fp16wire", q, (300,), "float32") for q in range(n)]
    got = hvd.allreduce(xs[r], op=hvd.Adasum, process_set=ps, compression=hvd.Compression.fp16)
    assert got.dtype == torch.float32
    close(got.half(), [x.half() for x in xs], "Compression.fp16")


def orthogonal_is_sum(rank, size):
    m = member()
    if m is None:
        return
    ps, r, n = m
    for dtype in ("float32", "float64"):
        xs = []
        for q in range(n):  # rank q's values only in block q: orthogonal at every level
            x = torch.zeros(n, 5, dtype=TORCH_DTYPES[dtype])
            x[q] = inp("orth", q, (5,), dtype)
            xs.append(x)
        got = hvd.allreduce(xs[r], op=hvd.Adasum, process_set=ps)
        assert torch.equal(got, sum(xs)), f"{dtype}: {got} != plain sum {sum(xs)}"


def parallel_is_mean(rank, size):
    m = member()
    if m is None:
        return
    ps, r, n = m
    for dtype in ("float32", "float64"):
        v = inp("parallel", 0, (257,), dtype)
        got = hvd.allreduce(v.clone(), op=hvd.Adasum, process_set=ps)
        close(got, [v] * n, f"{dtype} identical", expected=as_f64(v))
        xs = [v * (q + 1) for q in range(n)]  # parallel, different lengths: their mean
        mean = as_f64(v) * (n + 1) / 2
        close(hvd.allreduce(xs[r], op=hvd.Adasum, process_set=ps), xs, f"{dtype} scaled",
              expected=mean)


def magnitudes(rank, size):
    """Squared norms beyond the dtype's range (float32 at 1e+-30, float64 at 1e+-300), and
    norms hundreds of orders of magnitude apart (float64)."""
    m = member()
    if m is None:
        return
    ps, r, n = m
    cases = [("float32", 1e30), ("float32", 1e-30), ("float64", 1e300), ("float64", 1e-300),
             ("float64", 1e-310)]  # the last: subnormal inputs
    for dtype, scale in cases:
        what = f"{dtype} at {scale:g}"
        xs = [inp("mag" + what, q, (301,), dtype, scale) for q in range(n)]
        close(hvd.allreduce(xs[r], op=hvd.Adasum, process_set=ps), xs, what)
        v = inp("magpar" + what, 0, (64,), dtype, scale)
        close(hvd.allreduce(v.clone(), op=hvd.Adasum, process_set=ps), [v] * n,
              what + " parallel", expected=as_f64(v))
    spread = [10.0 ** (300 - 600 * q / max(n - 1, 1)) for q in range(n)]
    xs = [inp("spread", q, (99,), "float64", spread[q]) for q in range(n)]
    close(hvd.allreduce(xs[r], op=hvd.Adasum, process_set=ps), xs, f"norms {spread}")


def zero_vector(rank, size):
    m = member()
    if m is None:
        return
    ps, r, n = m
    for dtype in ("float16", "float32", "float64"):
        xs = [inp("zero" + dtype, q, (50,), dtype) for q in range(n)]
        xs[0] = torch.zeros_like(xs[0])
        close(hvd.allreduce(xs[r], op=hvd.Adasum, process_set=ps), xs, f"{dtype} rank 0 zero")
        only = [x if q == n - 1 else torch.zeros_like(x) for q, x in enumerate(xs)]
        got = hvd.allreduce(only[r], op=hvd.Adasum, process_set=ps)
        assert torch.equal(got, only[-1]), f"{dtype}: one nonzero rank must give its vector"
        got = hvd.allreduce(torch.zeros_like(xs[0]), op=hvd.Adasum, process_set=ps)
        assert not got.any(), f"{dtype}: all zero must give zero"


def prescale_postscale(rank, size):
    m = member()
    if m is None:
        return
    ps, r, n = m
    xs = [inp("scale", q, (40,), "float64") for q in range(n)]
    got = hvd.allreduce(xs[r], op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0,
                        process_set=ps)
    close(got, xs, "pre 0.5 post 3", pre=0.5, post=3.0)
    ys = [inp("scale16", q, (40,), "float16") for q in range(n)]
    got = hvd.allreduce(ys[r], op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25,
                        process_set=ps)
    close(got, ys, "float16 pre 2 post 0.25", pre=2.0, post=0.25)


def async_variants(rank, size):
    m = member()
    if m is None:
        return
    ps, r, n = m
    xs = [inp("async", q, (3, 11), "float32") for q in range(n)]
    ys = [inp("async2", q, (20,), "float64") for q in range(n)]
    h1 = hvd.allreduce_async(xs[r], name="ada.out", op=hvd.Adasum, process_set=ps)
    mine = ys[r].clone()
    h2 = hvd.allreduce_async_(mine, name="ada.in", op=hvd.Adasum, postscale_factor=2.0,
                              process_set=ps)
    close(hvd.synchronize(h1), xs, "allreduce_async")
    assert hvd.synchronize(h2) is mine
    close(mine, ys, "allreduce_async_", post=2.0)
    assert hvd.poll(h1) and hvd.poll(h2)


def grouped_variants(rank, size):
    """Each tensor of a group is combined on its own (Horovod's per-tensor coefficients)."""
    m = member()
    if m is None:
        return
    ps, r, n = m
    shapes = [((4, 3), "float32"), ((1,), "float32"), ((0,), "float32"), ((25,), "float64"),
              ((6,), "float16"), ((2, 2, 2), "float32")]
    per_rank = [[inp(f"grouped{i}", q, s, dt) for i, (s, dt) in enumerate(shapes)]
                for q in range(n)]
    # one tensor zero on rank 0 only: its coefficients must not leak into the others'
    per_rank[0][0] = torch.zeros_like(per_rank[0][0])
    expected = [[per_rank[q][i] for q in range(n)] for i in range(len(shapes))]

    def verify(outs, what):
        assert len(outs) == len(shapes), what
        for i, out in enumerate(outs):
            close(out, expected[i], f"{what} tensor {i}")

    mine = per_rank[r]
    verify(hvd.grouped_allreduce(mine, op=hvd.Adasum, process_set=ps), "grouped_allreduce")
    copies = [t.clone() for t in mine]
    outs = hvd.grouped_allreduce_(copies, op=hvd.Adasum, process_set=ps)
    assert all(o is c for o, c in zip(outs, copies))
    verify(copies, "grouped_allreduce_")
    h = hvd.grouped_allreduce_async(mine, op=hvd.Adasum, process_set=ps)
    verify(hvd.synchronize(h), "grouped_allreduce_async")
    copies = [t.clone() for t in mine]
    h = hvd.grouped_allreduce_async_(copies, op=hvd.Adasum, process_set=ps)
    hvd.synchronize(h)
    verify(copies, "grouped_allreduce_async_")
    # fusing is invisible: the same as one allreduce per tensor
    for i, t in enumerate(mine):
        close(hvd.allreduce(t, op=hvd.Adasum, process_set=ps), expected[i], f"single {i}")


def autograd(rank, size):
    """As Horovod's: the gradient of allreduce(op=Adasum) is the Adasum of the gradients."""
    m = member()
    if m is None:
        return
    ps, r, n = m
    xs = [inp("ag_x", q, (12,), "float64") for q in range(n)]
    ws = [inp("ag_w", q, (12,), "float64") for q in range(n)]
    x = xs[r].clone().requires_grad_()
    y = hvd.allreduce(x, op=hvd.Adasum, process_set=ps)
    close(y.detach(), xs, "forward")
    (y * ws[r]).sum().backward()
    close(x.grad, ws, "backward")


def _model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 2)).double()


def _batch(q, step):
    rng = np.random.default_rng([SEED, q, step, 99])
    return torch.from_numpy(rng.standard_normal((8, 6))), torch.from_numpy(
        rng.standard_normal((8, 2)))


def optimizer_matches_simulation(rank, size):
    """Horovod's delta optimizer: each rank steps its own optimizer (its own momentum) on its
    own gradients; the parameters become start + Adasum of the ranks' deltas, per parameter."""
    m = member()
    if m is None:
        return
    ps, r, n = m
    makers = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
              "adam": lambda p: torch.optim.Adam(p, lr=0.01)}
    for name, make_opt in makers.items():
        model = _model()
        opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       op=hvd.Adasum, process_set=ps)
        assert isinstance(opt, hvd.DistributedOptimizer) and opt.op is hvd.Adasum
        for step in range(3):
            x, y = _batch(r, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        # the simulation: one replica (model + optimizer state) per rank
        replicas = [_model() for _ in range(n)]
        ropts = [make_opt(rep.parameters()) for rep in replicas]
        theta = [p.detach().clone() for p in _model().parameters()]
        for step in range(3):
            deltas = []
            for q in range(n):
                with torch.no_grad():
                    for p, t in zip(replicas[q].parameters(), theta):
                        p.copy_(t)
                ropts[q].zero_grad()
                x, y = _batch(q, step)
                torch.nn.functional.mse_loss(replicas[q](x), y).backward()
                ropts[q].step()
                deltas.append([p.detach() - t for p, t in zip(replicas[q].parameters(), theta)])
            theta = [t + torch.from_numpy(adasum_all([d[i] for d in deltas]))
                     for i, t in enumerate(theta)]
        # Three optimizer steps carry the last-bit differences between the library's Adasum
        # sums and NumPy's (whose order depends on the CPU's vector width) through Adam's
        # division by sqrt(v), which is small in the first steps: 1.0e-11 was seen on an AMD
        # EPYC (1e-12 held on another machine). A wrong combination is off by far more.
        for (pname, p), t in zip(model.named_parameters(), theta):
            close(p.detach(), [t], f"{name} {pname} after 3 steps", expected=t.numpy(),
                  tol=1e-9)


def reducescatter_raises(rank, size):
    """As Horovod, whose reducescatter takes Sum/Average only (HorovodInternalError there)."""
    t = inp("rs", rank, (size * 2, 3))
    calls = {
        "reducescatter": lambda: hvd.reducescatter(t, op=hvd.Adasum),
        "reducescatter_async": lambda: hvd.reducescatter_async(t, op=hvd.Adasum),
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter([t, t], op=hvd.Adasum),
        "grouped_reducescatter_async": lambda: hvd.grouped_reducescatter_async(
            [t], op=hvd.Adasum),
        "positional op": lambda: hvd.reducescatter(t, hvd.Adasum),
        "autograd": lambda: hvd.reducescatter(t.clone().requires_grad_(), op=hvd.Adasum),
    }
    for what, call in calls.items():
        e = expect(hvd.HorovodInternalError, call, "Adasum")
        assert isinstance(e, RuntimeError), what
    # nothing was left in flight: the next collective still pairs up
    hvd.barrier()


def other_ops_unchanged(rank, size):
    for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average), ("min", hvd.Min),
                        ("max", hvd.Max), ("product", hvd.Product)):
        xs = [inp("ops" + op_name, q, (2 * size, 3), "float64") for q in range(size)]
        want = reduce_all(xs, op_name)
        torch.testing.assert_close(hvd.allreduce(xs[rank], op=op), want, rtol=1e-12,
                                   atol=1e-12)
        if op_name in ("sum", "average"):  # reducescatter takes these (Horovod: Sum, Average)
            got = hvd.reducescatter(xs[rank], op=op)
            torch.testing.assert_close(got, want[2 * rank:2 * rank + 2], rtol=1e-12,
                                       atol=1e-12)
    expect(ValueError, lambda: hvd.sparse_allreduce_async(
        torch.zeros(3, 2).to_sparse(), op=hvd.Adasum), "Average and Sum")


def non_power_of_two(rank, size):
    """Horovod's rule: NotImplementedError, raised at the call on every rank of the set."""
    ps = hvd.global_process_set if size & (size - 1) else SETS.get("odd")
    if ps is None or not ps.included():
        return
    t = inp("odd", rank, (6,))
    calls = {
        "allreduce": lambda: hvd.allreduce(t, op=hvd.Adasum, process_set=ps),
        "allreduce_": lambda: hvd.allreduce_(t.clone(), op=hvd.Adasum, process_set=ps),
        "allreduce_async": lambda: hvd.allreduce_async(t, op=hvd.Adasum, process_set=ps),
        "allreduce_async_": lambda: hvd.allreduce_async_(t.clone(), op=hvd.Adasum,
                                                         process_set=ps),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([t], op=hvd.Adasum, process_set=ps),
        "grouped_allreduce_": lambda: hvd.grouped_allreduce_([t.clone()], op=hvd.Adasum,
                                                             process_set=ps),
        "grouped_allreduce_async": lambda: hvd.grouped_allreduce_async([t], op=hvd.Adasum,
                                                                       process_set=ps),
        "grouped_allreduce_async_": lambda: hvd.grouped_allreduce_async_(
            [t.clone()], op=hvd.Adasum, process_set=ps),
        "compressed": lambda: hvd.allreduce(t, op=hvd.Adasum, process_set=ps,
                                            compression=hvd.Compression.fp16),
        "autograd": lambda: hvd.allreduce(t.clone().requires_grad_(), op=hvd.Adasum,
                                          process_set=ps),
        "DistributedOptimizer": lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(_model().parameters(), lr=0.1), op=hvd.Adasum, process_set=ps),
    }
    for what, call in calls.items():
        expect(NotImplementedError, call, "non-power of 2")
    hvd.barrier(process_set=ps)  # nothing was left in flight


def bad_arguments(rank, size):
    """Refused at the call, on every rank, before anything is sent."""
    m = member()
    if m is None:
        return
    ps, r, n = m
    for dtype in ("int32", "int64", "uint8", "bool"):
        t = torch.zeros(4, dtype=TORCH_DTYPES[dtype])
        expect(TypeError, lambda: hvd.allreduce(t, op=hvd.Adasum, process_set=ps), "floating")
        expect(TypeError, lambda: hvd.grouped_allreduce([torch.zeros(2), t], op=hvd.Adasum,
                                                        process_set=ps), "floating")
    expect(ValueError, lambda: hvd.allreduce(torch.zeros(2), op=hvd.Adasum, process_set=ps,
                                             prescale_factor=float("nan")), "prescale")
    model = _model()
    expect(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum, process_set=ps,
        gradient_predivide_factor=2.0), "gradient_predivide_factor")
    expect(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum, process_set=ps,
        algorithm="qsgd"), "algorithm")
    hvd.barrier(process_set=ps)


def unfrozen_after_wrapping_raises(rank, size):
    """A layer frozen when the delta optimizer was wrapped has no Adasum exchange: unfreezing it
    raises MisuseError at step() (after the closure), naming it, before anything is stepped."""
    m = member()
    if m is None:
        return
    ps, r, n = m
    model = _model()
    first = next(model.parameters())
    first.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   process_set=ps)
    first.requires_grad_(True)
    x, y = _batch(r, 0)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    before = [p.detach().clone() for p in model.parameters()]
    e = expect(MisuseError, lambda: opt.step(closure), f"rank {rank}: 1 parameter(s)")
    assert "when the optimizer was wrapped" in str(e), e
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "stepped"


def replaces_earlier_optimizer(rank, size):
    """The delta optimizer wrapped over parameters a bucketed DistributedOptimizer still
    hooks closes it: backward leaves each rank its own gradients (the earlier hooks would
    have averaged them) and the step matches the simulation; the earlier optimizer's step()
    raises MisuseError naming its successor."""
    m = member()
    if m is None:
        return
    ps, r, n = m
    model = _model()
    earlier = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), process_set=ps)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   process_set=ps)
    x, y = _batch(r, 0)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = _model()
    torch.nn.functional.mse_loss(local(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), local.parameters()):
        assert torch.equal(p.grad, q.grad), f"{name}: the gradient was exchanged"
    opt.step()
    deltas = []
    for q in range(n):
        replica = _model()
        xq, yq = _batch(q, 0)
        torch.nn.functional.mse_loss(replica(xq), yq).backward()
        deltas.append([-0.1 * p.grad for p in replica.parameters()])
    for i, (p, start) in enumerate(zip(model.parameters(), _model().parameters())):
        want = start.detach() + torch.from_numpy(adasum_all([d[i] for d in deltas]))
        close(p.detach(), [want], f"parameter {i}", expected=want.numpy(), tol=1e-12)
    e = expect(MisuseError, earlier.step,
               "the AdasumDistributedOptimizer wrapped later over its parameters")
    assert f"rank {rank}: step()" in str(e), e


def exchanges_take_the_transport(rank, size):
    """Adasum's halves and partial sums travel through the transport, on the backend's host
    carrier (gloo under BAGUA_MPI_BACKEND=gloo, else MPI), and nothing else moves them."""
    from bagua_mpi import backends, transport

    m = member()
    if m is None or m[2] < 2:
        return
    ps, r, n = m
    carrier = backends.host_carrier(backends.resolve(None))
    before = dict(transport.carried)
    xs = [inp("carrier", q, (301,)) for q in range(n)]
    close(hvd.allreduce(xs[r], op=hvd.Adasum, process_set=ps), xs, f"through {carrier}")
    moved = {k: v - before.get(k, 0) for k, v in transport.carried.items()
             if v != before.get(k, 0)}
    # each level: one exchange of halves, one per partial-sum step; then the halves back
    levels = n.bit_length() - 1
    want = levels + levels * (levels + 1) // 2 + levels
    assert moved == {carrier: want}, f"transport calls {moved}, want {{{carrier!r}: {want}}}"


@contextlib.contextmanager
def device_sum_sizes(piece=None, batch=None, large=None):
    """The torch form's piece, batch and "large" sizes set for the block (None keeps one)."""
    from bagua_mpi.primitives import adasum

    saved = adasum._PIECE, adasum._BATCH, adasum._LARGE
    adasum._PIECE, adasum._BATCH, adasum._LARGE = (
        v if v is not None else old for v, old in zip((piece, batch, large), saved))
    try:
        yield
    finally:
        adasum._PIECE, adasum._BATCH, adasum._LARGE = saved


def torch_form_matches_simulation(rank, size):
    """The torch form of the combination (what CUDA tensors take; ``adasum_allreduce_`` with a
    tensor runs it on a CPU tensor here) against the simulation and the NumPy form, segment by
    segment: ordinary values, an all-zero segment, an empty one, norms beyond float64's range
    (1e+-300: the host's rescaled sums) and float32's squares, and norms hundreds of orders of
    magnitude apart across ranks (a coefficient applied in power-of-two steps). Once as it
    runs (every segment small: segmented sums), once with pieces of 100, batches of 700 and
    segments of 1,500 elements or more "large" (dot products of their own), so that segments
    span pieces and batches and both kinds meet in one buffer."""
    from bagua_mpi.primitives import adasum

    m = member()
    if m is None:
        return
    ps, r, n = m
    spread = [10.0 ** (300 - 600 * q / max(n - 1, 1)) for q in range(n)]
    cases = [("float32", [1.0] * n), ("float32", [1e30] * n), ("float64", [1.0] * n),
             ("float64", [1e300] * n), ("float64", [1e-300] * n), ("float64", spread)]
    counts = [1000, 0, 377, 64, 2049]
    sizes = {"as it runs": (None, None, None), "in small pieces": (100, 700, 1500)}
    for label, (piece, batch, large) in sizes.items():
        with device_sum_sizes(piece, batch, large):
            for dtype, scales in cases:
                what = f"{label}, {dtype} x{scales[0]:g}..{scales[-1]:g}"
                per_rank = [[inp(f"torch{dtype}{k}{scales[0]}", q, (c,), dtype,
                                 scale=scales[q]) for k, c in enumerate(counts)]
                            for q in range(n)]
                for row in per_rank:
                    row[3] = row[3] * 0
                mine = torch.cat(per_rank[r])
                by_torch = adasum.adasum_allreduce_(mine.clone(), ps.comm, counts)
                by_numpy = adasum.adasum_allreduce_(mine.clone().numpy(), ps.comm, counts)
                start = 0
                for k, c in enumerate(counts):
                    inputs = [per_rank[q][k] for q in range(n)]
                    for got, form in ((by_torch, "torch"), (torch.from_numpy(by_numpy), "numpy")):
                        close(got[start:start + c], inputs, f"{form}, {what}, segment {k}")
                    start += c


def torch_form_random_layouts(rank, size):
    """The torch form on 24 random layouts of segments (the same on every rank: empty ones,
    ones of a single element, runs of "large" ones between small ones, sizes on and off the
    boundaries of pieces and batches), with small pieces, batches and large sizes, against the
    simulation segment by segment. One all-zero segment per layout on one rank."""
    from bagua_mpi.primitives import adasum

    m = member()
    if m is None:
        return
    ps, r, n = m
    rng = np.random.default_rng([SEED, 7])
    for layout in range(24):
        piece = int(rng.choice([1, 7, 64, 100]))
        batch = int(piece * rng.choice([1, 3, 8]))
        large = int(rng.choice([2, 300, 1500]))
        counts = [int(c) for c in rng.choice([0, 1, piece, piece + 1, 2 * piece - 1, 299, 300,
                                              1499, 1500, 2049], size=int(rng.integers(1, 12)))]
        zero_at = (int(rng.integers(len(counts))), int(rng.integers(n)))
        per_rank = [[inp(f"layout{layout}.{k}", q, (c,)) for k, c in enumerate(counts)]
                    for q in range(n)]
        per_rank[zero_at[1]][zero_at[0]] = per_rank[zero_at[1]][zero_at[0]] * 0
        with device_sum_sizes(piece, batch, large):
            got = adasum.adasum_allreduce_(torch.cat(per_rank[r]), ps.comm, counts)
        start = 0
        for k, c in enumerate(counts):
            close(got[start:start + c], [per_rank[q][k] for q in range(n)],
                  f"layout {layout} (counts {counts}, pieces of {piece}, batches of {batch}, "
                  f"large from {large}), segment {k}")
            start += c


def device_form_launches_do_not_grow(rank, size):
    """The torch form dispatches as many operations that compute or copy (each a kernel launch
    or more on a GPU) for a buffer of 256 segments as for one of 16 with the same elements:
    each level sums all segments at once and scales them in one foreach call."""
    from bagua_mpi.primitives import adasum

    m = member()
    if m is None:
        return
    ps, r, n = m
    elements = 1 << 14
    counted = {}
    for segments in (16, 256):
        data = inp(f"launches{segments}", r, (elements,))
        with DispatchCount() as count:
            adasum.adasum_allreduce_(data, ps.comm, [elements // segments] * segments)
        counted[segments] = count.launches
    assert counted[256] == counted[16], f"operations per call by segments: {counted}"


def optimizer_launches_do_not_grow(rank, size):
    """A step of the Adasum delta optimizer (foreach SGD inside) dispatches as many operations
    that compute or copy for 64 parameter tensors as for 4 of the same elements: the snapshot,
    the deltas, the fused buffer, the results and the update are a few foreach operations or
    cats, not one per parameter."""
    m = member()
    if m is None:
        return
    ps, r, n = m
    counted = {}
    for tensors in (4, 64):
        params = [torch.nn.Parameter(inp(f"optlaunch{tensors}.{i}", 0, (1024 // tensors,)))
                  for i in range(tensors)]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, foreach=True),
                                       named_parameters=[(f"p{i}", p)
                                                         for i, p in enumerate(params)],
                                       op=hvd.Adasum, process_set=ps)
        for i, p in enumerate(params):
            p.grad = inp(f"optlaunchgrad{tensors}.{i}", r, p.shape)
        opt.step()  # the first step checks more than the steady state
        with DispatchCount() as count:
            opt.step()
        counted[tensors] = (count.launches, count.names)
    assert counted[64][0] == counted[4][0], (
        f"operations per step: {counted[4][0]} for 4 tensors, {counted[64][0]} for 64 "
        f"({counted[64][1]})")


def cuda_tensors_stay_on_device(rank, size):
    """(``--cuda`` only: needs a GPU.) A CUDA tensor is combined on its device: the result is
    a CUDA tensor close to the simulation, and the halves went by the backend's device carrier
    (staged MPI, a CUDA-aware MPI or NCCL), where they once were copied to the host and went by
    MPI on host memory; only the small tables of sums take the host carrier. A grouped call of
    45 tensors is combined on the device too."""
    from bagua_mpi import backends, transport

    m = member()
    if m is None or m[2] < 2:
        return
    ps, r, n = m
    backend = backends.resolve(None)
    device, host = backends.device_carrier(backend), backends.host_carrier(backend)
    for dtype in FLOATS:
        xs = [inp("cuda" + dtype, q, (100_003,), dtype) for q in range(n)]
        before = dict(transport.carried)
        got = hvd.allreduce(xs[r].cuda(), op=hvd.Adasum, process_set=ps)
        moved = {k: v - before.get(k, 0) for k, v in transport.carried.items()
                 if v != before.get(k, 0)}
        assert got.is_cuda, f"{dtype}: the result came back on {got.device}"
        close(got.cpu(), xs, f"{dtype} on the device")
        levels = n.bit_length() - 1
        want = {device: 2 * levels, host: levels * (levels + 1) // 2}
        assert moved == want, f"{dtype}: transport calls {moved}, want {want}"
    # a grouped call of many tensors (the segmented sums, the dot products of a large one and
    # the foreach multiply on the device), one of them zero on rank 0; then again in small
    # pieces and batches
    sizes = [7, 40_000, 0, 1, 300_001] + [1000 + 37 * i for i in range(40)]
    per_rank = [[inp(f"cudagroup{i}", q, (c,), "float32") for i, c in enumerate(sizes)]
                for q in range(n)]
    per_rank[0][1] = torch.zeros_like(per_rank[0][1])
    for piece, batch, large in ((None, None, None), (1000, 50_000, 100_000)):
        with device_sum_sizes(piece, batch, large):
            outs = hvd.grouped_allreduce([t.cuda() for t in per_rank[r]], op=hvd.Adasum,
                                         process_set=ps)
        for i, out in enumerate(outs):
            assert out.is_cuda, f"grouped tensor {i} came back on {out.device}"
            close(out.cpu(), [per_rank[q][i] for q in range(n)],
                  f"grouped on the device, pieces of {piece or 'the default'}, tensor {i}")


def grouped_cuda_launches_do_not_grow(rank, size):
    """(``--cuda`` only: needs a GPU.) A grouped allreduce of CUDA tensors, Adasum and Sum,
    launches for 256 tensors at most one kernel per 8 tensors more than for 16 of the same
    elements (foreach operations split long lists; a copy each way per tensor, and Adasum's
    sums and scaling per tensor and level, made it grow by two or more per tensor). The kernels
    are torch's profiler's count, on this GPU."""
    m = member()
    if m is None or m[2] < 2:
        return
    ps, r, n = m
    for op in (hvd.Adasum, hvd.Sum):
        kernels = {}
        for tensors in (16, 256):
            xs = [inp(f"cudalaunch{tensors}.{i}", r, (4096 // tensors,)).cuda()
                  for i in range(tensors)]
            hvd.grouped_allreduce(xs, op=op, process_set=ps)  # the first call allocates
            kernels[tensors] = cuda_kernels(
                lambda: hvd.grouped_allreduce(xs, op=op, process_set=ps))
        assert kernels[256] - kernels[16] <= (256 - 16) // 8, (
            f"{op}: CUDA kernels by tensors {kernels}")


def mismatch_raises(rank, size):
    """Ranks that disagree (Adasum here, Sum there) get MismatchError, not a hang."""
    m = member()
    if m is None or m[2] < 2:
        return
    ps, r, n = m
    op = hvd.Adasum if r == 0 else hvd.Sum
    expect(hvd.MismatchError, lambda: hvd.allreduce(torch.ones(3), op=op, process_set=ps),
           "Adasum")


CHECKS = {f.__name__: f for f in (
    random_vs_simulation, dtypes, orthogonal_is_sum, parallel_is_mean, magnitudes, zero_vector,
    prescale_postscale, async_variants, grouped_variants, autograd,
    optimizer_matches_simulation, reducescatter_raises, other_ops_unchanged, non_power_of_two,
    bad_arguments, unfrozen_after_wrapping_raises, replaces_earlier_optimizer, mismatch_raises,
    exchanges_take_the_transport, torch_form_matches_simulation, torch_form_random_layouts,
    device_form_launches_do_not_grow, optimizer_launches_do_not_grow)}


# run only with --cuda (on a GPU: tests/test_gpu_primitives.py)
CUDA_CHECKS = {f.__name__: f for f in (cuda_tensors_stay_on_device,
                                          grouped_cuda_launches_do_not_grow)}


def main():
    hvd.init()
    size = hvd.size()
    if size & (size - 1):  # Adasum runs on the first 2^k ranks
        SETS["math"] = hvd.add_process_set(list(range(1 << (size.bit_length() - 1))))
    else:
        SETS["math"] = hvd.global_process_set
    if size >= 4:
        SETS["odd"] = hvd.add_process_set([0, 1, 2])
    argv = [a for a in sys.argv if a != "--cuda"]
    failures = run_checks(dict(CHECKS, **CUDA_CHECKS) if "--cuda" in sys.argv else CHECKS, argv)
    if hvd.rank() == 0 and not failures:
        print(f"adasum suite OK on {size} ranks", flush=True)
    hvd.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
