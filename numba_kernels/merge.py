"""Merges that the sparse collectives need (gTop-k's tree reduction).

``merge_topk(a, b, k)`` is one round of gTop-k: the union of two top-k
payloads, adding values at equal indices, then the top-k of that union by
magnitude (ties to the lower index), listed by index:
  1. merge the two ascending index lists (CPU: two pointers; GPU: each entry
     finds its rank in the other list by binary search, so the merged
     position is its own rank plus that rank, and an index present in both
     is written once, by the entry from ``a``, with the sum);
  2. run the exact selection of ``_select`` on the merged values.
``restore_unselected(residual, sent, selected)`` gives back to the residual
what a rank sent but the global selection dropped: residual[i] += v for each
sent (i, v) whose index i is not in ``selected``.

Dense payloads are merged by decoding: ``decompress_many`` (in dispatch)
sums a stack of payloads into one buffer in a single pass.
"""
import numpy as np

from ._api import output_buffer, payload_rows, require_same
from ._device import flat, stream_of
from ._disk_cache import cached_njit
from ._select import select_exact
from .errors import KernelParameterError, LayoutError, PayloadError
from .wire import Payload, TopKFormat


@cached_njit(nogil=True)
def union_cpu(ia, va, ib, vb, uidx, uval):
    """Merge two ascending (index, value) lists, summing equal indices; return the length."""
    a = 0
    b = 0
    m = 0
    while a < ia.size or b < ib.size:
        if b == ib.size or (a < ia.size and ia[a] < ib[b]):
            uidx[m] = ia[a]
            uval[m] = va[a]
            a += 1
        elif a == ia.size or ib[b] < ia[a]:
            uidx[m] = ib[b]
            uval[m] = vb[b]
            b += 1
        else:
            uidx[m] = ia[a]
            uval[m] = va[a] + vb[b]
            a += 1
            b += 1
        m += 1
    return m


@cached_njit(nogil=True)
def restore_cpu(resid, sidx, sval, gidx):
    """resid[i] += v for sent (i, v) whose i is absent from the ascending list gidx."""
    g = 0
    for j in range(sidx.size):
        i = sidx[j]
        while g < gidx.size and gidx[g] < i:
            g += 1
        if g == gidx.size or gidx[g] != i:
            resid[i] = resid[i] + sval[j]


def _topk_views(p, name):
    if not isinstance(p, Payload) or not isinstance(p.format, TopKFormat):
        raise PayloadError(f"{name} must be a top-k Payload, got "
                           f"{type(getattr(p, 'format', p)).__name__}")
    return p.views()


def merge_topk(a, b, k=None, out=None, stream=None):
    """gTop-k merge of two top-k payloads of the same tensor; returns a top-k Payload.

    ``k`` defaults to a's k and must not exceed max(a.k, b.k), so the union
    always holds k entries.  Example (one tree round):
    ``mine = merge_topk(mine, Payload(mine.format, received))``.
    Device launches: 1 while a.k + b.k is at most 32,768 (4,096 under the
    simulator): one block prefills, unites and selects.  Above that 10 (prefill
    the union's two buffers, the union, the exact selection's 7).  +1 zeroing
    the padding (int64 indices, odd k); none but that when k is 0.
    """
    va, vb = _topk_views(a, "a"), _topk_views(b, "b")
    fa, fb = a.format, b.format
    if fa.n != fb.n or fa.index_dtype != fb.index_dtype:
        raise PayloadError(f"cannot merge top-k payloads of different tensors: "
                           f"a has n={fa.n} {fa.index_dtype}, b has n={fb.n} {fb.index_dtype}")
    k = fa.k if k is None else k
    if not 0 <= k <= max(fa.k, fb.k):
        raise KernelParameterError(f"k must be in [0, max(a.k, b.k)] = [0, {max(fa.k, fb.k)}], "
                                   f"got {k}")
    dev = a.on_device
    require_same(dev, b.on_device, "merge_topk")
    fmt = TopKFormat(fa.n, k, fa.index_dtype)
    st = stream_of(stream) if dev else 0
    buf = output_buffer(out, fmt.nbytes, dev, st)
    v = fmt.views(buf)
    if dev:
        from ._cuda import merge as kern
        kern.merge(va, vb, fmt, v["indices"], v["values"], buf, st)
        return Payload(fmt, buf)
    buf[fmt.used_nbytes:] = 0
    uidx = np.empty(fa.k + fb.k, np.int64)
    uval = np.empty(fa.k + fb.k, np.float32)
    m = union_cpu(va["indices"], va["values"], vb["indices"], vb["values"], uidx, uval)
    select_exact(uval, m, k, v["indices"], v["values"], uval, False, uidx, True)
    return Payload(fmt, buf)


def restore_unselected(residual, sent, selected, stream=None):
    """residual[i] += v for every (i, v) of ``sent`` whose index is not in ``selected``.

    Device launches: 1 (none when ``sent`` is empty)."""
    ss, gs = _topk_views(sent, "sent"), _topk_views(selected, "selected")
    ra, dev = flat(residual, "residual")
    if ra.size != sent.format.n or selected.format.n != sent.format.n:
        raise LayoutError(f"residual has {ra.size} elements; sent and selected describe "
                          f"{sent.format.n} and {selected.format.n}")
    require_same(dev, sent.on_device, "restore_unselected")
    require_same(dev, selected.on_device, "restore_unselected")
    if dev:
        from ._cuda import merge as kern
        kern.restore(ra, ss["indices"], ss["values"], gs["indices"], stream_of(stream))
    else:
        restore_cpu(ra, ss["indices"], ss["values"], gs["indices"])
    return residual


def scale_topk_stack(stack, fmt, factor, col=0, stream=None):
    """Multiply the k values of every top-k payload of ``stack`` by ``factor`` in place: a
    (P, nbytes) stack, or payloads at byte column ``col`` of wider rows (``fmt.views2d``).

    Averaging an all-gathered stack this way takes one pass, not one per row.
    Device launches: 1 (none when k or P is 0).
    """
    if not isinstance(fmt, TopKFormat):
        raise PayloadError(f"fmt must be a TopKFormat, got {type(fmt).__name__}")
    rows, col, dev = payload_rows(stack, fmt, col)
    values, vcol = fmt.views2d(rows, col)["values"]
    if not dev:
        values[:, vcol:vcol + fmt.k] *= np.float32(factor)
    else:
        from ._cuda.common import scale_columns
        scale_columns(values, vcol, fmt.k, np.float32(factor), stream_of(stream))
    return stack


def scale_topk_values(payload, factor, stream=None):
    """Multiply a top-k payload's k values by ``factor`` in place (host or device).

    Averaging a sparse sum this way touches k values instead of the n-element decoded tensor.
    Device launches: 1 (none when k is 0).
    """
    _topk_views(payload, "payload")
    scale_topk_stack(payload.buffer.reshape(1, payload.nbytes), payload.format, factor,
                     stream=stream)
    return payload
