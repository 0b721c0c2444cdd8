"""Adasum: Horovod's adaptive summation, as an allreduce over a communicator (through its
transport's point-to-point exchange).

Two vectors combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is ``a + b`` when they are orthogonal and their mean when they are parallel. A zero
vector gets coefficient 1, so the result is the other vector (Horovod's C++ core treats
``|a|^2 < 1e-8`` as zero; here only an exact zero is, so the combination does not depend on
the scale of the inputs: ``adasum(c a, c b) = c adasum(a, b)`` at every magnitude).

Over 2^k ranks the combination is a binary tree in rank order (ranks r and r^1 first, then the
pairs {0,1} and {2,3}, ...), computed as Horovod computes it: vector halving, distance doubling.
At level ``l = 1, 2, 4, ...`` the partner is ``rank ^ l``: the rank with bit ``l`` clear keeps
the first half of its current range (``floor(n/2)`` elements), the other the second half; each
sends the half it gives up and combines the half it keeps with the partner's copy of it. The
dot product and squared norms of the *whole* vectors are the sums of the slices' over the 2l
ranks that hold the two vectors (the ranks sharing ``rank // 2l``): a recursive-doubling
allreduce of the partial sums among them (every rank gets bit-identical sums, so every slice
of the result uses the same coefficients). The halves then travel back in reverse order
(distance halving) until every rank holds the whole result.

``counts`` splits the flat buffer into segments (the tensors of a grouped allreduce): each
segment gets its own coefficients, as Horovod computes them per tensor of a fused buffer.

Numerics: partial sums are float64 and carried as (value, power-of-two exponent) pairs, so that
float64 inputs near 1e+-300, whose squares overflow or underflow float64, still combine right;
float32 data is converted to float64 for the sums (its squares always fit). The combination
itself runs in the buffer's dtype; callers reduce 16-bit floats in a float32 buffer.

Only power-of-two rank counts: other counts raise ``NotImplementedError``, as Horovod does
(``horovod/torch/mpi_ops.py``: "Running Adasum with non-power of 2 ranks is not supported
yet."; its C++ core, ``horovod/common/ops/adasum/adasum.h``, refuses them as well).

The vectors stay where they live, and the halves travel through the transport. A host buffer
is combined in NumPy (the fastest on a CPU: torch's per-call cost made small and grouped calls
1.5x slower). A CUDA tensor is combined with torch's arithmetic on its device, and its halves go
over NCCL or a CUDA-aware MPI where the backend has them (staged through pinned host memory
otherwise); what goes to the host is one small table per level, each segment's dot product and
squared norms (one wait for the device per level), for the bookkeeping of their exponents and
the coefficients. There a segment whose squared norm is zero, subnormal-small or not finite
takes the host's exact sums (``_partials``), the rare case that needs the rescaling. The torch
form runs on CPU tensors too (``adasum_allreduce_`` with a tensor), which is how CI checks it.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import consistency, transport
from ..buffers import FLOATING, as_tensor, dtype_name, empty_like

TAG = 0xADA  # point-to-point tags on the operation's communicator: data halves
_SUM_TAG = TAG + 1  # partial sums of the dot products and norms

# the exponent of an exact zero: far below any float64, so aligning to it shifts to 0
_ZERO_EXP = -float(1 << 40)
# |x|^2 at or above this needs no rescaling: the squares of elements that matter are normal
_TINY = 2.0 ** -960


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_size(size: int) -> None:
    """Horovod's rule: Adasum needs a power-of-two number of ranks."""
    if not is_power_of_two(size):
        raise NotImplementedError(f"Running Adasum with non-power of 2 ranks is not supported "
                                  f"yet (as in Horovod): this communicator has {size} ranks")


# -- partial sums --------------------------------------------------------------------------------

def _scaled(x: np.ndarray):
    """``(x', e, |x'|^2)`` with ``x = x' * 2^e`` and ``|x'|^2`` free of overflow and harmful
    underflow; ``e`` is ``None`` for an exact zero vector. ``x`` is float64."""
    with np.errstate(over="ignore", under="ignore"):
        nn = float(np.dot(x, x))
    if math.isfinite(nn) and nn >= _TINY:
        return x, 0, nn
    if nn == 0.0 and not x.any():
        return x, None, 0.0
    m = float(np.max(np.abs(x)))
    if not math.isfinite(m):  # inf/nan in the input: let it propagate
        return x, 0, nn
    e = math.frexp(m)[1]
    xs = np.ldexp(x, -e)
    return xs, e, float(np.dot(xs, xs))


def _partials(a: np.ndarray, b: np.ndarray) -> list[float]:
    """``[a.b, |a|^2, |b|^2, their three exponents]`` of two slices (value * 2^exponent)."""
    if a.dtype != np.float64:
        a, b = a.astype(np.float64), b.astype(np.float64)
    a, ea, na = _scaled(a)
    b, eb, nb = _scaled(b)
    if ea is None or eb is None:
        dot, ed = 0.0, _ZERO_EXP
    else:
        dot, ed = float(np.dot(a, b)), float(ea + eb)
    return [dot, na, nb, ed, _ZERO_EXP if ea is None else 2.0 * ea,
            _ZERO_EXP if eb is None else 2.0 * eb]


def _add_scaled(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Sum of two (n, 6) tables of (values, exponents): aligned to the larger exponent.
    Symmetric in x and y, so both partners of an exchange get the same bits."""
    ex, ey = x[:, 3:], y[:, 3:]
    e = np.maximum(ex, ey)
    shift_x = np.maximum(ex - e, -4000.0).astype(np.int64)
    shift_y = np.maximum(ey - e, -4000.0).astype(np.int64)
    return np.concatenate([np.ldexp(x[:, :3], shift_x) + np.ldexp(y[:, :3], shift_y), e], axis=1)


def _group_sum(wire: transport.Transport, rank: int, level: int,
               table: np.ndarray) -> np.ndarray:
    """Sum ``table`` over the 2*level ranks sharing ``rank // (2*level)`` (recursive
    doubling with partners rank^1, rank^2, ..., rank^level)."""
    other = np.empty_like(table)
    step = 1
    while step <= level:
        peer = rank ^ step
        wire.exchange(table, [other], [peer], tag=_SUM_TAG)
        table = _add_scaled(table, other)
        step <<= 1
    return table


def _scale_by_coefficient(x, dot: float, dot_exp: float, normsq: float,
                          norm_exp: float) -> None:
    """``x *= 1 - a.b / (2 |x|^2)`` from scaled sums (nothing for a zero vector, whose
    coefficient is 1), in ``x``'s dtype (NumPy array or tensor; the coefficient is rounded to
    that dtype first by either). A coefficient too large for that dtype (the two vectors' norms
    hundreds of orders of magnitude apart) is applied as mantissa, then as powers of two small
    enough for it: exact steps, where one factor of ``2**exp`` would be inf and turn zeros into
    NaN."""
    if normsq == 0.0:
        return
    mantissa, exp = math.frexp(0.5 * dot / normsq)  # the ratio is mantissa * 2^exp
    exp += int(max(min(dot_exp - norm_exp, 1e4), -1e4))
    if mantissa == 0.0 or exp < -54:
        return  # coefficient 1 to the last bit (orthogonal, or a negligible ratio)
    if exp <= 64:
        x *= 1.0 - math.ldexp(mantissa, exp)
        return
    x *= -mantissa  # |1 - ratio| == |ratio| to the last bit here
    while exp > 0:
        step = min(exp, 64)
        x *= 2.0 ** step
        exp -= step


def _partials_table(a, b, starts, ends) -> np.ndarray:
    """``_partials`` of the segments ``[starts[i], ends[i])`` of ``a`` and ``b``, as an (n, 6)
    float64 host table. NumPy arrays: ``_partials`` itself. Tensors: float64 dot products on
    their device, brought over in one copy; a segment whose squared norm is zero, below
    ``_TINY`` or not finite is redone on the host by ``_partials`` (its exact rescaling)."""
    if isinstance(a, np.ndarray):
        return np.array([_partials(a[s:e], b[s:e]) for s, e in zip(starts, ends)],
                        dtype=np.float64).reshape(len(starts), 6)
    sums = []
    for s, e in zip(starts, ends):
        a_seg, b_seg = a[s:e].double(), b[s:e].double()
        sums.append(torch.stack([torch.dot(a_seg, b_seg), torch.dot(a_seg, a_seg),
                                 torch.dot(b_seg, b_seg)]))
    table = np.zeros((len(starts), 6), dtype=np.float64)
    table[:, :3] = torch.stack(sums).cpu().numpy() if sums else 0.0
    for row, s, e in zip(table, starts, ends):
        norms = row[1:3]
        if not (np.isfinite(norms).all() and (norms >= _TINY).all()):
            row[:] = _partials(a[s:e].double().cpu().numpy(), b[s:e].double().cpu().numpy())
    return table


# -- the allreduce ---------------------------------------------------------------------------

def adasum_allreduce_(buf, comm, counts=None):
    """Adasum of every rank's ``buf`` (a 1-D contiguous float32/float64 NumPy array, combined
    in NumPy, or torch tensor, combined by torch on its device; same size and ``counts`` on
    every rank), in place; returns ``buf``.

    ``counts``: element counts of consecutive segments, each combined with its own
    coefficients (default: one segment). ``comm``: an mpi4py intracommunicator, or a
    ``Transport`` over one, whose size is a power of two (else ``NotImplementedError``). The
    halves and the partial sums travel through the transport's point-to-point exchange, on the
    carrier the backend gives their memory (the sums' tables are host arrays).
    """
    wire = transport.of(comm)
    size, rank = wire.Get_size(), wire.Get_rank()
    check_size(size)
    view = as_tensor(buf)
    if view.dim() != 1 or view.dtype not in (torch.float32, torch.float64) \
            or not view.is_contiguous():
        raise TypeError(f"adasum_allreduce_ needs a 1-D contiguous float32/float64 array, got "
                        f"{view.dtype} with shape {tuple(view.shape)}")
    _combine(buf, wire, rank, size, counts)
    return buf


def _combine(buf, wire: transport.Transport, rank: int, size: int, counts) -> None:
    """``adasum_allreduce_`` on a checked buffer (see the module docstring for the steps)."""
    n = len(buf)
    counts = [n] if counts is None else [int(c) for c in counts]
    if sum(counts) != n:
        raise ValueError(f"segment counts {counts} do not add up to the buffer's {n} elements")
    if size == 1:
        return
    bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    scratch = empty_like(buf, shape=((n + 1) // 2,))
    lo, hi = 0, n
    given = []  # (start, end, partner) of the half given away at each level
    level = 1
    while level < size:
        peer = rank ^ level
        mid = lo + (hi - lo) // 2
        lower = not (rank & level)  # holds the lower group's vector ("a")
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        mine = buf[keep[0]:keep[1]]
        theirs = scratch[:keep[1] - keep[0]]
        wire.exchange(buf[give[0]:give[1]], [theirs], [peer], tag=TAG)
        # the kept range's piece of each segment, in local offsets
        starts = np.clip(bounds[:-1], keep[0], keep[1]) - keep[0]
        ends = np.clip(bounds[1:], keep[0], keep[1]) - keep[0]
        a_part, b_part = (mine, theirs) if lower else (theirs, mine)
        table = _partials_table(a_part, b_part, starts, ends)
        table = _group_sum(wire, rank, level, table)
        for (s, e), (dot, na, nb, ed, ea, eb) in zip(zip(starts, ends), table):
            if s == e:
                continue
            _scale_by_coefficient(a_part[s:e], dot, ed, na, ea)
            _scale_by_coefficient(b_part[s:e], dot, ed, nb, eb)
        mine += theirs
        given.append((give[0], give[1], peer))
        lo, hi = keep
        level <<= 1
    for start, end, peer in reversed(given):
        wire.exchange(buf[lo:hi], [buf[start:end]], [peer], tag=TAG)
        lo, hi = min(lo, start), max(hi, end)


# -- the collectives' entry point -------------------------------------------------------------

_HOST = torch.device("cpu")


def _wire(dt: str) -> torch.dtype:
    """The dtype Adasum computes ``dt`` in: float64 stays, the rest in float32."""
    return torch.float64 if dt == "float64" else torch.float32


def _flat_view(x, wire: torch.dtype) -> torch.Tensor | None:
    """A 1-D view of ``x``'s memory when it is contiguous and of dtype ``wire``."""
    t = as_tensor(x)
    return t.reshape(-1) if t.dtype == wire and t.is_contiguous() else None


def _device_of(tensors) -> torch.device:
    """Where a fused buffer of ``tensors`` is combined: their device when they share one, else
    the host. (The grouping is by dtype alone, so every rank fuses the same segments wherever
    its own tensors live.)"""
    found = {x.device if isinstance(x, torch.Tensor) else _HOST for x in tensors}
    return found.pop() if len(found) == 1 else _HOST


def _load(work: torch.Tensor, x) -> None:
    """work[:] = x, cast to work's dtype on work's device (the tensor's own)."""
    work.copy_(as_tensor(x).reshape(-1))


def _store(out, work: torch.Tensor) -> None:
    """out[...] = work, cast to out's dtype."""
    as_tensor(out).copy_(work.reshape(as_tensor(out).shape))


def allreduce_run(comm, tensors, outs, prescale: float, postscale: float, check=None,
                  grouped: bool = False):
    """``(run, describe)`` of an Adasum allreduce of ``tensors`` into ``outs`` (the same objects
    for in place), each tensor combined on its own: ``outs[i] = post * adasum(pre * t_i)``.

    Arguments are checked here, in the caller: floating dtypes only (``TypeError``), a
    power-of-two communicator (``NotImplementedError``). ``run()`` returns ``outs[0]`` (or
    the list when ``grouped``). Same tensors of every rank as the other allreduces, same
    agreement check record (joined ranks cannot take part: they get ``JoinedRankError``).
    """
    dts = [dtype_name(t) for t in tensors]
    bad = sorted({dt for dt in dts if dt not in FLOATING})
    if bad:
        raise TypeError(f"op=Adasum needs floating tensors (float16, bfloat16, float32, "
                        f"float64), got {', '.join(bad)}")
    check_size(comm.Get_size())
    shapes = tuple(tuple(t.shape) for t in tensors)
    if grouped:
        signature = ("grouped_allreduce", ("op", "Adasum"), ("dtypes", tuple(dts)),
                     ("shapes", shapes))
        describe = ("grouped_allreduce", "Adasum", len(tensors))
    else:
        signature = ("allreduce", ("op", "Adasum"), ("dtype", dts[0]), ("shape", shapes[0]))
        describe = ("allreduce", "Adasum", dts[0], shapes[0])
    groups: dict = {}  # one fused buffer per wire dtype, as the other grouped allreduces
    for i, dt in enumerate(dts):
        groups.setdefault(_wire(dt), []).append(i)
    sizes = [math.prod(s) for s in shapes]

    def run():
        if consistency._enabled if check is None else check:
            consistency.verify(comm, signature)
        for wire, idx in groups.items():
            total = sum(sizes[i] for i in idx)
            if total == 0:
                continue
            view = None
            if len(idx) == 1 and (view := _flat_view(outs[idx[0]], wire)) is not None:
                work = view  # reduce in the output's own memory
                if outs[idx[0]] is not tensors[idx[0]]:
                    _load(work, tensors[idx[0]])
            else:
                # (a prototype of the buffer's dtype and device: empty_like allocates a large
                # host buffer through NumPy, for its huge pages)
                work = empty_like(torch.empty(0, dtype=wire,
                                              device=_device_of(tensors[i] for i in idx)),
                                  shape=(total,))
                offset = 0
                for i in idx:
                    _load(work[offset:offset + sizes[i]], tensors[i])
                    offset += sizes[i]
            if prescale != 1.0:
                work.mul_(prescale)
            # NumPy's arithmetic on the host (see the module docstring), torch's on a device
            adasum_allreduce_(work.numpy() if work.device.type == "cpu" else work, comm,
                              [sizes[i] for i in idx])
            if postscale != 1.0:
                work.mul_(postscale)
            if work is not view:
                offset = 0
                for i in idx:
                    _store(outs[i], work[offset:offset + sizes[i]])
                    offset += sizes[i]
        return outs if grouped else outs[0]

    return run, describe
