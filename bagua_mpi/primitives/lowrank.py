"""PowerSGD (Vogels et al. 2019): rank-r approximation of gradient matrices in two allreduces.

Each segment is one matrix-shaped layer: rank i's gradient viewed as M_i (n x m), plus its
error-feedback memory e_i when it has one (M_i = G_i + e_i). With Q (m x r) the same on every
rank (``initial_q`` from a shared seed, then the previous step's averaged Q: the paper's warm
start, one step of power iteration per training step), for all segments at once:

1. P_i = M_i Q                                            (n x r, local)
2. ONE allreduce (sum) of every segment's P_i, packed into one float32 buffer: P = sum_i P_i
3. P^ = orthonormal columns of P: Gram-Schmidt in float64 on the summed P, which is the same
   on every rank, so every rank gets the same P^ without communicating it
4. Q_i = M_i^T P^                                         (m x r, local)
5. ONE allreduce (sum) of every segment's Q_i, packed; Q_avg = scale x sum_i Q_i
6. result: flat <- P^ Q_avg^T, i.e. scale x P^ P^T sum_i M_i (the projection of the summed
   matrices onto span(P^)); error: e_i <- M_i - P^ Q_i^T, what this rank's own contribution
   lost to the projection (before averaging, as in the paper's Algorithm 2)
7. Q <- Q_avg (warm start for the next step)

Each rank sends 2(P-1)/P x 4 x sum (n + m) r bytes instead of 2(P-1)/P x 4 x sum n m.

Rank-deficient P: a column of P that Gram-Schmidt finds (numerically) dependent on the earlier
ones becomes a zero column of P^ (never NaN); its Q_avg column is then zero too and the warm
start keeps that column's previous Q, since a zero column of Q would stay zero in every later
step (P = M Q) and the layer would silently lose that rank for good. A zero gradient thus
leaves Q unchanged.

Every rank must pass the same segment list (shapes, ranks, order): it decides the packed
buffers and so the collectives. An empty list makes no MPI call, which is consistent only when
it is empty on every rank. Float32 tensors, all on the host or all on one CUDA device (with
their Q and errors there): on a device every product runs there, the float64 Gram-Schmidt
too (``orthonormalize_packed_``: many P's at once), and only the packed P and Q move (through
the transport: NCCL or a CUDA-aware MPI on the device, else reused pinned host buffers).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch
from .. import transport
from ..accounting import WireStats
from ..buffers import FusedTensors, host_view

# A Gram-Schmidt residual at most this fraction of the column's own norm is roundoff of a
# column that lies in the span of the earlier ones: it is zeroed rather than normalized. P
# comes from float32 data, so genuine components are >= ~1e-7 relative; float64 roundoff of an
# exactly dependent column is ~1e-16 relative.
_DEPENDENT = 1e-10


@dataclass
class LowRankSegment:
    """One matrix-shaped layer of a packed PowerSGD exchange.

    ``flat``: contiguous 1-D float32 gradient (host or CUDA) of ``rows`` x cols elements (cols =
    ``flat.numel() // rows``), overwritten in place with the averaged rank-``rank``
    approximation. ``q``: (cols, r_max) float32 warm-start state with r_max >= ``rank``; its
    first ``rank`` columns are used and replaced by this step's averaged Q. ``error``:
    (rows x cols,) float32 error-feedback memory updated in place, or None (no feedback).
    """

    flat: torch.Tensor
    rows: int
    rank: int
    q: torch.Tensor
    error: torch.Tensor | None = None


def initial_q(cols: int, max_rank: int, seed: int) -> torch.Tensor:
    """(cols, max_rank) float32 standard normal from a generator seeded with ``seed``:
    identical on every rank (all ranks must start from the same Q)."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn(cols, max_rank, generator=gen, dtype=torch.float32)


def orthonormalize_packed_(packed: torch.Tensor, shapes: tuple,
                           batches: list | None = None) -> torch.Tensor:
    """``orthonormalize`` of every P in ``packed`` (P_k: a row-major ``shapes[k]`` = (n_k, r_k)
    block, one after another) in torch float64 where they live (a GPU), in place, many at
    once; returns which columns of the P^'s are nonzero, as one bool vector of sum_k r_k
    entries (P_0's columns, then P_1's...). ``batches``: ``packed_batches(shapes, device)``,
    which a caller running the same shapes every step makes once (made here when None).

    P's whose row counts have the same bit length form a batch (so padding at most doubles a
    P), and per batch:

    1. scatter its P's into a zero (B, n_max, r_max) float64 tensor (zero rows change no norm
       or dot product, and a zero column comes out zero, so padding changes no real entry);
    2. ``orthonormalize``'s steps, a column at a time for all of them, with the
       dependent-column test a select instead of a branch, so the host never waits for the
       device;
    3. gather the real entries back into ``packed``, and each P's live columns into the
       returned vector.

    Its launches grow with the batches and r_max, not with the number of P's, where a P at a
    time made about fifteen per column of every P. Every rank holds the same summed P's and
    runs the same batches, so every rank gets the same P^s."""
    wide = packed.to(torch.float64)
    lives = torch.empty(sum(r for _, r in shapes), dtype=torch.bool, device=packed.device)
    if batches is None:
        batches = packed_batches(shapes, packed.device)
    for src, dst, col_src, col_dst, batch_shape in batches:
        out = torch.zeros(batch_shape, dtype=torch.float64, device=packed.device)
        out.view(-1).index_copy_(0, dst, wide.index_select(0, src))
        for j in range(batch_shape[2]):
            col = out[:, :, j]  # (B, n_max), a view
            norm0 = torch.linalg.vector_norm(col, dim=1)
            if j:
                done = out[:, :, :j]
                for _ in range(2):
                    col -= torch.bmm(done, torch.bmm(done.transpose(1, 2),
                                                     col.unsqueeze(2))).squeeze(2)
            norm = torch.linalg.vector_norm(col, dim=1)
            keep = ((norm > 0.0) & (norm > _DEPENDENT * norm0)).unsqueeze(1)
            col.copy_(torch.where(keep, col / torch.where(keep, norm.unsqueeze(1), 1.0), 0.0))
        packed.index_copy_(0, src, out.view(-1).index_select(0, dst).to(packed.dtype))
        live = out.abs().amax(dim=1) > 0  # (B, r_max)
        lives.index_copy_(0, col_dst, live.view(-1).index_select(0, col_src))
    return lives


def packed_batches(shapes: tuple, device: torch.device) -> list[tuple]:
    """``orthonormalize_packed_``'s batches: (where their P's elements are in the packed
    buffer, where they go in the zero-padded (B, n_max, r_max) batch, where their P's columns
    are in the batch's (B, r_max) rows, where they go in the vector of live columns, the
    batch's shape), the positions as tensors on ``device``. A plan makes them once and keeps
    them (not a cache shared by every plan: a model with more buckets than such a cache held
    copied them to the device again every step, and a copy from ordinary host memory makes
    the host wait for the device)."""
    starts = np.concatenate([[0], np.cumsum([n * r for n, r in shapes])]).astype(np.int64)
    col_starts = np.concatenate([[0], np.cumsum([r for _, r in shapes])]).astype(np.int64)
    by_length: dict = {}
    for k, (n, _) in enumerate(shapes):
        by_length.setdefault(int(n).bit_length(), []).append(k)
    batches = []
    for members in by_length.values():
        n_max = max(shapes[k][0] for k in members)
        r_max = max(shapes[k][1] for k in members)
        src, dst, col_src, col_dst = [], [], [], []
        for row, k in enumerate(members):
            n, r = shapes[k]
            src.append(np.arange(starts[k], starts[k + 1]))
            dst.append((row * n_max * r_max + np.arange(n)[:, None] * r_max
                        + np.arange(r)[None, :]).reshape(-1))
            col_src.append(row * r_max + np.arange(r))
            col_dst.append(np.arange(col_starts[k], col_starts[k + 1]))
        batches.append((*(torch.from_numpy(np.concatenate(x)).to(device)
                          for x in (src, dst, col_src, col_dst)),
                        (len(members), n_max, r_max)))
    return batches


def orthonormalize_packed_host_(packed: torch.Tensor, shapes: tuple) -> torch.Tensor:
    """``orthonormalize`` of every P in the host tensor ``packed`` (float32; P_k: a row-major
    ``shapes[k]`` = (n_k, r_k) block, one after another), in float64, in place, in one
    compiled call for all of them; returns which columns of the P^'s are nonzero, as
    ``orthonormalize_packed_`` does. The same steps as ``orthonormalize``, their float64
    sums in loops rather than BLAS's order (so a P^ may differ from NumPy's in a last bit,
    never across ranks: every rank runs the same loops on the same summed P's). One call
    costs about what NumPy's fixed cost of some 15 us a P did for a few P's, and it does not
    grow with the layers."""
    starts, rows, ranks, col_starts = _host_layout(shapes)
    live = np.empty(int(col_starts[-1]), np.bool_)
    _compiled_gram_schmidt()(host_view(packed), starts, rows, ranks, col_starts, live,
                             _DEPENDENT)
    return torch.from_numpy(live)


@functools.lru_cache(maxsize=32)   # the same every step
def _host_layout(shapes: tuple) -> tuple[np.ndarray, ...]:
    """(each P's first element, rows, rank, first column among all P's columns, then the
    column count at the end) of ``orthonormalize_packed_host_``'s P's."""
    rows = np.array([n for n, _ in shapes], np.int64)
    ranks = np.array([r for _, r in shapes], np.int64)
    starts = np.concatenate([[0], np.cumsum(rows * ranks)]).astype(np.int64)
    col_starts = np.concatenate([[0], np.cumsum(ranks)]).astype(np.int64)
    return starts, rows, ranks, col_starts


@functools.cache
def prepare_host_route() -> None:
    """Load (or, the first time on a machine, compile) the host route's Gram-Schmidt now, once
    per process: importing numba and loading the compiled loop take some 0.4 s, which would
    otherwise land on the first step of a host model (an algorithm calls this when it sets up
    its exchange, as L-GreCo loads its dynamic program)."""
    orthonormalize_packed_host_(torch.ones(1), ((1, 1),))


@functools.cache
def _compiled_gram_schmidt():
    """``_gram_schmidt_packed`` compiled, on first use: importing numba costs every rank about
    0.3 s, and only host PowerSGD needs this."""
    import numba
    return numba.njit(cache=True, nogil=True)(_gram_schmidt_packed)


def _gram_schmidt_packed(packed, starts, rows, ranks, col_starts, live, dependent):
    """For each P_k (row-major at ``starts[k]``): ``orthonormalize``'s steps in float64 on a
    copy whose rows are P_k's columns (each contiguous), written back in ``packed``'s dtype
    (float32: a nonzero column has norm 1 and stays nonzero); ``live`` marks the nonzero
    columns."""
    for k in range(rows.size):
        n, r, start = rows[k], ranks[k], starts[k]
        cols = np.empty((r, n))
        for i in range(n):
            for j in range(r):
                cols[j, i] = packed[start + i * r + j]
        coeffs = np.empty(r)
        for j in range(r):
            norm0 = 0.0
            for i in range(n):
                norm0 += cols[j, i] * cols[j, i]
            if j:
                for _ in range(2):   # twice is enough
                    for t in range(j):
                        coeffs[t] = 0.0
                        for i in range(n):
                            coeffs[t] += cols[t, i] * cols[j, i]
                    for i in range(n):
                        along = 0.0
                        for t in range(j):
                            along += cols[t, i] * coeffs[t]
                        cols[j, i] -= along
            norm = 0.0
            for i in range(n):
                norm += cols[j, i] * cols[j, i]
            norm, norm0 = np.sqrt(norm), np.sqrt(norm0)
            keep = norm != 0.0 and norm > dependent * norm0
            for i in range(n):
                cols[j, i] = cols[j, i] / norm if keep else 0.0
            live[col_starts[k] + j] = keep
        for i in range(n):
            for j in range(r):
                packed[start + i * r + j] = cols[j, i]   # rounded to packed's dtype


def orthonormalize(p: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning those of ``p`` (n x r), in order, as a new float64 array.

    Classical Gram-Schmidt with one re-orthogonalization pass ("twice is enough"): columns
    stay orthogonal to float64 precision even when P is ill-conditioned, which the warm start
    makes likely (its columns converge towards the top singular vectors). Columns dependent on
    earlier ones (see ``_DEPENDENT``), zero columns included, come out as zeros. Deterministic:
    the same input gives the same bits on ranks with the same NumPy build.
    """
    out = np.array(p, dtype=np.float64, order="F")  # a copy; columns contiguous
    for j in range(out.shape[1]):
        col = out[:, j]
        norm0 = np.linalg.norm(col)
        if j:
            done = out[:, :j]
            for _ in range(2):
                col -= done @ (done.T @ col)
        norm = np.linalg.norm(col)
        if norm == 0.0 or norm <= _DEPENDENT * norm0:
            col[:] = 0.0
        else:
            col /= norm
    return out


def _check_segment(seg: LowRankSegment) -> int:
    """Validate one segment; returns its cols (m)."""
    flat = seg.flat
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"PowerSGD takes contiguous 1-D float32 tensors, got {flat.dtype} "
                         f"of shape {tuple(flat.shape)} on {flat.device}")
    numel = flat.numel()
    if seg.rows < 1 or numel == 0 or numel % seg.rows:
        raise ValueError(f"rows={seg.rows} must be positive and divide the {numel} elements")
    cols = numel // seg.rows
    if not 1 <= seg.rank <= min(seg.rows, cols):
        raise ValueError(f"rank must be in [1, min(rows, cols)] = [1, {min(seg.rows, cols)}] "
                         f"for a {seg.rows} x {cols} matrix, got rank={seg.rank}")
    q = seg.q
    if (q.dtype != torch.float32 or q.dim() != 2 or q.shape[0] != cols
            or q.shape[1] < seg.rank or q.device != flat.device):
        raise ValueError(f"q must be a float32 ({cols}, r_max >= {seg.rank}) tensor on "
                         f"{flat.device}, got "
                         f"{q.dtype} of shape {tuple(q.shape)} on {q.device}")
    e = seg.error
    if e is not None and (e.dtype != torch.float32 or tuple(e.shape) != (numel,)
                          or e.device != flat.device or not e.is_contiguous()):
        raise ValueError(f"error must be a contiguous float32 ({numel},) tensor on "
                         f"{flat.device}, got "
                         f"{e.dtype} of shape {tuple(e.shape)} on {e.device}")
    return cols


def powersgd_allreduce_(segments: list[LowRankSegment], comm, *,
                        scale: float = 1.0, stats: WireStats | None = None) -> None:
    """PowerSGD of every segment in place, in two allreduces in all (module docstring):
    ``LowRankExchange(segments).run(...)``, planned for this call alone.

    ``scale`` multiplies the summed Q (1/P averages). ``stats`` counts each allreduce as
    ``WireStats.allreduce`` does (2(P-1)/P x its bytes)."""
    LowRankExchange(segments).run(comm, scale=scale, stats=stats)


class LowRankExchange:
    """A PowerSGD exchange of a fixed list of segments: planned once, run every step.

    Planning checks the segments, orders them into product batches (``_product_batches``:
    segments of one shape and rank whose matrices, Q's and results each lie at one stride in
    one memory, such as a bucket's layers of one shape with their Q's and error memories end
    to end, as PowerSGD keeps them, take one batched product where each took one of its own),
    places every P and Q in the packed buffers (kept from step to step) and prepares the warm
    start. A run then costs the host a few operations a batch, and none a segment.

    A plan holds views of the segments' tensors: it stays right while they stay where they
    are (memory, shapes, dtypes). A caller that keeps one across steps makes a new one when
    they move (PowerSGD keeps one a bucket: ``AlgorithmImpl.kept_plan``)."""

    def __init__(self, segments: list[LowRankSegment]):
        cols = [_check_segment(seg) for seg in segments]
        if segments:
            device = segments[0].flat.device
            if any(seg.flat.device != device for seg in segments):
                raise ValueError(f"PowerSGD segments must share one device, got "
                                 f"{sorted({str(seg.flat.device) for seg in segments})}")
        order, self.batches = _product_batches(segments, cols)
        self.segments = segments = [segments[k] for k in order]
        cols = [cols[k] for k in order]
        if not segments:
            return
        p_off = list(itertools.accumulate((seg.rows * seg.rank for seg in segments), initial=0))
        q_off = list(itertools.accumulate((m * seg.rank for m, seg in zip(cols, segments)),
                                          initial=0))
        self.p_buf = torch.empty(p_off[-1], dtype=torch.float32, device=device)
        self.q_buf = torch.empty(q_off[-1], dtype=torch.float32, device=device)
        with_error = [seg for seg in segments if seg.error is not None]
        self.errors = [seg.error for seg in with_error]
        self.error_grads = [seg.flat for seg in with_error]
        self.views = [batch.views(segments, self.p_buf, p_off, self.q_buf, q_off)
                      for batch in self.batches]
        self.shapes = tuple((seg.rows, seg.rank) for seg in segments)
        self.orthonormalize_ = (
            functools.partial(orthonormalize_packed_,
                              batches=packed_batches(self.shapes, self.p_buf.device))
            if _on_device(self.p_buf) else orthonormalize_packed_host_)
        self.warm_start = _WarmStart(segments, cols, self.q_buf)

    def run(self, comm, *, scale: float = 1.0, stats: WireStats | None = None) -> None:
        """The steps of the module docstring for every segment (an empty plan makes no MPI
        call)."""
        if not self.segments:
            return
        # M_i per segment: the error memory (holding g + e, added for all segments in one
        # operation) or flat
        if self.errors:
            torch._foreach_add_(self.errors, self.error_grads)
        for mats, q, p_hat, _, _ in self.views:
            torch.bmm(mats, q, out=p_hat)
        _allreduce_sum(self.p_buf, comm, stats)

        # float64 Gram-Schmidt where P is, many P's at once (no wait on a device)
        live_columns = self.orthonormalize_(self.p_buf, self.shapes)

        for batch, (mats, _, p_hat, q_mine, _) in zip(self.batches, self.views):
            torch.bmm(mats.transpose(1, 2), p_hat, out=q_mine)
            if batch.error:  # before the sum overwrites this rank's own Q_i
                mats.baddbmm_(p_hat, q_mine.transpose(1, 2), alpha=-1.0)
        _allreduce_sum(self.q_buf, comm, stats)
        if scale != 1.0:
            self.q_buf.mul_(scale)

        for _, _, p_hat, q_avg, result in self.views:   # the Q_i's are the averaged Q's now
            torch.bmm(p_hat, q_avg.transpose(1, 2), out=result)
        self.warm_start(self.q_buf, live_columns)


@dataclass(frozen=True)
class _ProductBatch:
    """Segments ``start`` to ``stop`` (in the exchange's order) of one shape (``rows`` x
    ``cols``, ``rank``), with error memories or without (``error``), whose matrices M, Q's
    and results lie at one stride each in one memory: ``strides`` (M, Q, flat), elements."""

    start: int
    stop: int
    rows: int
    cols: int
    rank: int
    error: bool
    strides: tuple

    def views(self, segments, p_buf, p_off, q_buf, q_off):
        """(M, Q, P, this rank's Q_i, result) of the batch as (B, ., .) tensors: the
        segments' own memory seen at its strides, and their places in the packed P and Q."""
        b, n, m, r = self.stop - self.start, self.rows, self.cols, self.rank
        first = segments[self.start]
        mat = first.flat if first.error is None else first.error
        m_stride, q_stride, flat_stride = self.strides
        q0 = first.q
        return (mat.as_strided((b, n, m), (m_stride, m, 1)),
                q0.as_strided((b, m, r), (q_stride, q0.stride(0), q0.stride(1))),
                p_buf[p_off[self.start]:p_off[self.stop]].view(b, n, r),
                q_buf[q_off[self.start]:q_off[self.stop]].view(b, m, r),
                first.flat.as_strided((b, n, m), (flat_stride, m, 1)))


def _product_batches(segments: list[LowRankSegment], cols: list[int]):
    """The exchange's order of the segments (those of one kind, i.e. shape, rank, Q layout and
    error or not, together, in their given order; kinds in order of first appearance) and its
    ``_ProductBatch``es: runs of one kind whose three tensors (M, Q, flat) each step through
    one memory at one stride. A segment that no other continues is a batch of one."""
    kinds = [(seg.rows, m, seg.rank, seg.q.shape[1], seg.q.stride(), seg.error is None)
             for seg, m in zip(segments, cols)]
    first_of = {}
    for k, kind in enumerate(kinds):
        first_of.setdefault(kind, k)
    order = sorted(range(len(segments)), key=lambda k: first_of[kinds[k]])
    places = [_places(segments[k]) for k in order]
    batches, start = [], 0
    for i in range(1, len(order) + 1):
        if (i < len(order) and kinds[order[i]] == kinds[order[start]]
                and _continues(places, start, i)):
            continue
        seg = segments[order[start]]
        strides = tuple(b[1] - a[1] for a, b in zip(places[start], places[start + 1])) \
            if i - start > 1 else (0, 0, 0)
        batches.append(_ProductBatch(start, i, seg.rows, cols[order[start]], seg.rank,
                                     seg.error is not None, strides))
        start = i
    return order, batches


def _places(seg: LowRankSegment) -> tuple:
    """(storage, first element, elements) of the segment's M, Q and flat."""
    mat = seg.flat if seg.error is None else seg.error
    return tuple((t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                 for t in (mat, seg.q, seg.flat))


def _continues(places: list, start: int, i: int) -> bool:
    """Whether each of segment i's tensors lies where the run from ``start`` puts the next
    one: in the run's first one's memory, one stride on from segment i - 1's (the second
    segment sets the stride, at least its tensor's size, so the batch's matrices are
    apart)."""
    for tensor, (storage, first, size) in enumerate(places[start]):
        here, before = places[i][tensor], places[i - 1][tensor]
        step = here[1] - before[1]
        if here[0] != storage:
            return False
        if i - start == 1 and step < size:
            return False
        if i - start > 1 and step != places[start + 1][tensor][1] - first:
            return False
    return True


class _WarmStart:
    """Each segment's Q <- its Q_avg (in the packed Q buffer), except the columns whose P^
    column is zero (``live_columns`` False: the same on all ranks), which keep their Q, for
    all segments in a few operations whatever their number:

    1. every whole Q (r_max columns) end to end in one buffer (one copy of them all);
    2. the first ``rank`` columns of each picked out of it, and one select between them and
       Q_avg (a select, not a branch: the host never waits for the device);
    3. the result put back in the buffer, and the buffer copied into the Q's at once (whole
       Q's, so the copy is the same fast one whether a Q is wider than its rank or not)."""

    def __init__(self, segments: list[LowRankSegment], cols: list[int], q_buf: torch.Tensor):
        layout = tuple((m, seg.rank, seg.q.shape[1]) for m, seg in zip(cols, segments))
        self.positions, self.column_of = _warm_start_maps(layout, str(q_buf.device))
        self.qs = FusedTensors([seg.q for seg in segments])

    def __call__(self, q_avg: torch.Tensor, live_columns: torch.Tensor) -> None:
        # flat: a Q alone is its own buffer, in its (cols, r_max) shape
        whole, positions = self.qs.gather().view(-1), self.positions
        live = live_columns.to(whole.device).index_select(0, self.column_of)
        whole.index_copy_(0, positions, torch.where(live, q_avg, whole.index_select(0, positions)))
        self.qs.scatter()


@functools.lru_cache(maxsize=32)
def _warm_start_maps(layout: tuple, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For the packed Q_avg's (Q_k: a row-major (m_k, r_k) block, ``layout[k]`` = (m_k, r_k,
    r_max_k)), each element's position among the whole Q's end to end (row-major (m_k,
    r_max_k) blocks), and its column's index among all Q_avg's columns (Q_0's, then Q_1's...),
    on ``device``: made once per layout."""
    positions, columns = [], []
    whole_start = column_start = 0
    for m, r, width in layout:
        positions.append(whole_start + (np.arange(m)[:, None] * width
                                        + np.arange(r)[None, :]).reshape(-1))
        columns.append(column_start + np.tile(np.arange(r), m))
        whole_start += m * width
        column_start += r
    return tuple(torch.from_numpy(np.concatenate(x).astype(np.int64)).to(device)
                 for x in (positions, columns))


def _on_device(buf: torch.Tensor) -> bool:
    """Whether the P's are orthonormalized by torch where they are (``orthonormalize_packed_``):
    on a device. Host P's take one compiled call (``orthonormalize_packed_host_``)."""
    return buf.device.type != "cpu"


def _allreduce_sum(buf: torch.Tensor, comm, stats: WireStats | None) -> None:
    transport.of(comm).allreduce_(buf, dense=False)  # P and Q are payloads, not gradients
    if stats is not None:
        stats.allreduce(buf.numel() * buf.element_size(), comm.Get_size())
