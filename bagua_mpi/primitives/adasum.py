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
squared norms (one wait for the device per level for that table; MPI carriers wait for the
halves as well), for the bookkeeping of their exponents and
the coefficients. Its launches per level do not grow with the number of segments: the sums of
every segment come from a few segmented sums over batches of the buffer (``_device_sums``), and
the coefficients are applied to every segment in one ``torch._foreach_mul_``. A segment whose
squared norm is subnormal-small, not finite, or zero in float64 data (where that may be
underflow) takes the host's exact sums (``_partials``), the rare case that needs the rescaling.
The torch form runs on CPU tensors too (``adasum_allreduce_`` with a tensor), which is how CI
checks it.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import consistency, transport
from ..buffers import FLOATING, as_tensor, copy_split, dtype_name, empty_like, flatten_into

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


def _coefficient_factors(dot: float, dot_exp: float, normsq: float,
                         norm_exp: float) -> list[float]:
    """The factors that make ``x *= 1 - a.b / (2 |x|^2)`` from scaled sums, applied in order
    in ``x``'s dtype (each rounded to it first, by NumPy or torch alike): none for a zero
    vector (coefficient 1) or a negligible ratio, one in the usual case. A coefficient too
    large for the dtype (the two vectors' norms hundreds of orders of magnitude apart) is the
    mantissa, then powers of two small enough for it: exact steps, where one factor of
    ``2**exp`` would be inf and turn zeros into NaN."""
    if normsq == 0.0:
        return []
    mantissa, exp = math.frexp(0.5 * dot / normsq)  # the ratio is mantissa * 2^exp
    exp += int(max(min(dot_exp - norm_exp, 1e4), -1e4))
    if mantissa == 0.0 or exp < -54:
        return []  # coefficient 1 to the last bit (orthogonal, or a negligible ratio)
    if exp <= 64:
        return [1.0 - math.ldexp(mantissa, exp)]
    factors = [-mantissa]  # |1 - ratio| == |ratio| to the last bit here
    while exp > 0:
        factors.append(2.0 ** min(exp, 64))
        exp -= 64
    return factors


def _scale_segments(x, starts, ends, factors) -> None:
    """``x[starts[i]:ends[i]] *= f`` for each ``f`` of ``factors[i]`` in order. A tensor's
    segments take their first factors in one ``torch._foreach_mul_`` (a few launches on a GPU,
    however many segments), the rare further steps one by one."""
    if isinstance(x, np.ndarray):
        for s, e, fs in zip(starts, ends, factors):
            for f in fs:
                x[s:e] *= f
        return
    firsts = [(x[s:e], fs[0]) for s, e, fs in zip(starts, ends, factors) if fs and s < e]
    if firsts:
        torch._foreach_mul_([seg for seg, _ in firsts], [f for _, f in firsts])
    for s, e, fs in zip(starts, ends, factors):
        for f in fs[1:]:
            x[s:e] *= f


def _partials_table(a, b, starts, ends) -> np.ndarray:
    """``_partials`` of the segments ``[starts[i], ends[i])`` of ``a`` and ``b`` (consecutive:
    ``ends[i] == starts[i + 1]``), as an (n, 6) float64 host table. NumPy arrays: ``_partials``
    itself. Tensors: ``_device_sums``, then the exponents from what the sums say of each vector
    (``_exponents``); a segment whose sums cannot say is redone on the host by ``_partials``
    (its exact rescaling), the rare case."""
    if isinstance(a, np.ndarray):
        return np.array([_partials(a[s:e], b[s:e]) for s, e in zip(starts, ends)],
                        dtype=np.float64).reshape(len(starts), 6)
    table = np.zeros((len(starts), 6), dtype=np.float64)
    table[:, :3] = _device_sums(a, b, starts, ends)
    # where a squared norm of 0 means zeros (see _exponents): empty segments, and float32 data
    exact_zeros = (np.asarray(ends) == np.asarray(starts)) | (a.dtype != torch.float64)
    for i in np.flatnonzero(~_exponents(table, exact_zeros)):
        s, e = starts[i], ends[i]
        table[i] = _partials(a[s:e].double().cpu().numpy(), b[s:e].double().cpu().numpy())
    return table


# A segment of _LARGE elements or more takes three dot products of its own (their launches
# are small beside its memory traffic, and they keep no buffer of products), as does a small one
# with no small neighbour to share launches with. The other small ones are cut into pieces of
# at most _PIECE elements (one thread block each in the device's segmented sum: enough blocks
# to fill a GPU), summed in batches of about _BATCH elements (the float64 copies and products
# of a batch take 40 bytes an element on the device).
_LARGE = 1 << 20
_PIECE = 1 << 15
_BATCH = 1 << 22


def _device_sums(a: torch.Tensor, b: torch.Tensor, starts, ends) -> np.ndarray:
    """Each segment's ``[a.b, |a|^2, |b|^2]`` (an (n, 3) host array), in float64 on the tensors'
    device, with launches that do not grow with the number of small segments:

    1. a segment of ``_LARGE`` elements or more, or a small one between large ones (or alone):
       three dot products of its float64 copies;
    2. the other small ones: cut into pieces of at most ``_PIECE`` elements, and per batch of
       consecutive pieces the float64 products side by side in one buffer, summed into three
       sums per piece by one segmented sum (``torch.segment_reduce``, deterministic);
    3. one copy of all these rows to the host (the one wait for the device), where each segment
       adds up its own rows in order.
    """
    lengths = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
    rows, owners = [], []  # device tensors of (k, 3) sums, and the segment of each row
    for first, last in _runs(lengths >= _LARGE):
        if lengths[first] >= _LARGE or last - first == 1:
            for seg in range(first, last):
                lo, hi = int(starts[seg]), int(ends[seg])
                a64, b64 = a[lo:hi].double(), b[lo:hi].double()
                rows.append(torch.stack([torch.dot(a64, b64), torch.dot(a64, a64),
                                         torch.dot(b64, b64)]).reshape(1, 3))
                owners.append([seg])
            continue
        pieces_of = -(-lengths[first:last] // _PIECE)  # per segment; none for an empty one
        first_piece = np.concatenate([[0], np.cumsum(pieces_of)[:-1]]).astype(np.int64)
        owner = np.repeat(np.arange(first, last), pieces_of)
        index_in_segment = np.arange(len(owner)) - first_piece[owner - first]
        piece_lengths = np.minimum(_PIECE, lengths[owner] - index_in_segment * _PIECE)
        piece_starts = int(starts[first]) + np.concatenate(
            [[0], np.cumsum(piece_lengths)]).astype(np.int64)
        for p0, p1 in _runs((piece_starts[:-1] - piece_starts[0]) // _BATCH):
            lo, hi = int(piece_starts[p0]), int(piece_starts[p1])
            a64, b64 = a[lo:hi].double(), b[lo:hi].double()
            products = torch.empty((3, hi - lo), dtype=torch.float64, device=a.device)
            torch.mul(a64, b64, out=products[0])
            torch.mul(a64, a64, out=products[1])
            torch.mul(b64, b64, out=products[2])
            rows.append(torch.segment_reduce(
                products.reshape(-1), "sum", unsafe=True,
                lengths=_on(a.device, np.tile(piece_lengths[p0:p1], 3))
            ).reshape(3, p1 - p0).t())
            owners.append(owner[p0:p1])
    sums = np.zeros((len(lengths), 3), dtype=np.float64)
    if rows:
        owner = np.concatenate(owners).astype(np.int64)  # nondecreasing: rows in buffer order
        segs, first_row = np.unique(owner, return_index=True)
        sums[segs] = np.add.reduceat(torch.cat(rows).cpu().numpy(), first_row, axis=0)
    return sums


def _runs(keys: np.ndarray):
    """``(first, last)`` of each run of equal consecutive ``keys``."""
    edges = np.flatnonzero(np.diff(keys)) + 1
    bounds = np.concatenate([[0], edges, [len(keys)]]).astype(np.int64)
    return [(int(f), int(l)) for f, l in zip(bounds[:-1], bounds[1:]) if l > f]


def _on(device: torch.device, values: np.ndarray) -> torch.Tensor:
    """``values`` as a tensor on ``device``, without waiting for the device: a CUDA copy goes
    from pinned memory. (``segment_reduce``'s own check of the lengths would wait twice, so its
    callers pass ``unsafe=True``: the lengths are right by construction.)"""
    tensor = torch.from_numpy(values)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _exponents(table: np.ndarray, exact_zeros: np.ndarray) -> np.ndarray:
    """Fill the exponent columns of ``table`` (rows ``[a.b, |a|^2, |b|^2, ...]`` of unscaled
    float64 sums) as ``_partials`` would, where the sums suffice; returns the rows that do.

    A vector whose squared norm is finite and at least ``_TINY`` needs no rescaling (exponent
    0). One whose squared norm is 0 is an exact zero vector where ``exact_zeros`` says so for
    its row (an empty segment, or float32 data: the float64 square of its smallest nonzero
    value is far above 0), and takes ``_ZERO_EXP``, as its dot product does. Anything else (a
    float64 norm that may have underflowed, or a non-finite one) needs ``_partials`` on the
    host."""
    norms = table[:, 1:3]
    with np.errstate(invalid="ignore"):
        normal = np.isfinite(norms) & (norms >= _TINY)
    zero = (norms == 0.0) & np.asarray(exact_zeros)[:, None]
    ok = (normal | zero).all(axis=1)
    table[:, 4:6] = np.where(zero, _ZERO_EXP, 0.0)
    either_zero = zero.any(axis=1)
    table[:, 3] = np.where(either_zero, _ZERO_EXP, 0.0)
    table[either_zero, 0] = 0.0
    return ok


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
        _scale_segments(a_part, starts, ends,
                        [_coefficient_factors(dot, ed, na, ea) for dot, na, _, ed, ea, _ in table])
        _scale_segments(b_part, starts, ends,
                        [_coefficient_factors(dot, ed, nb, eb) for dot, _, nb, ed, _, eb in table])
        mine += theirs
        given.append((give[0], give[1], peer))
        lo, hi = keep
        level <<= 1
    for start, end, peer in reversed(given):
        wire.exchange(buf[lo:hi], [buf[start:end]], [peer], tag=TAG)
        lo, hi = min(lo, start), max(hi, end)


# -- the collectives' entry point -------------------------------------------------------------

def _wire(dt: str) -> torch.dtype:
    """The dtype Adasum computes ``dt`` in: float64 stays, the rest in float32."""
    return torch.float64 if dt == "float64" else torch.float32


def _flat_view(x, wire: torch.dtype) -> torch.Tensor | None:
    """A 1-D view of ``x``'s memory when it is contiguous and of dtype ``wire``."""
    t = as_tensor(x)
    return t.reshape(-1) if t.dtype == wire and t.is_contiguous() else None


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
                    work.copy_(as_tensor(tensors[idx[0]]).reshape(-1))
            else:
                # on the tensors' one device (the caller's rule); a prototype of the buffer's
                # dtype there, since empty_like allocates a large host buffer through NumPy,
                # for its huge pages
                device = as_tensor(tensors[idx[0]]).device
                work = empty_like(torch.empty(0, dtype=wire, device=device), shape=(total,))
                flatten_into(work, [tensors[i] for i in idx])
            if prescale != 1.0:
                work.mul_(prescale)
            # NumPy's arithmetic on the host (see the module docstring), torch's on a device
            adasum_allreduce_(work.numpy() if work.device.type == "cpu" else work, comm,
                              [sizes[i] for i in idx])
            if postscale != 1.0:
                work.mul_(postscale)
            if work is not view:
                copy_split(work, [as_tensor(outs[i]) for i in idx])
        return outs if grouped else outs[0]

    return run, describe
