"""The per-partition calls that the row forms replace, and the row forms themselves, for the
row-form checks on the host (``test_rows.py``) and on the device (``device_checks.check_rows``);
the payloads of every registry format at a byte column of wider rows, for
``decompress_many(..., col=)`` (``test_dispatch.py``, ``device_checks.check_decode_at_column``);
and the layout of min-max segments side by side (``test_minmax_segments.py``,
``device_checks.check_minmax_segments``). No numba.cuda here: the host tests import it in the main pytest process."""
import inspect
import itertools

import numpy as np

import numba_kernels as nk
from numba_kernels.registry import CODECS


# The row forms (one launch for the n partitions of a scatter-reduce) against the per-partition
# calls they replace: name -> (row-form compressor, per-partition compressor, format class).
ROW_FORMS = {
    "minmax": (nk.compress_minmax_rows, nk.compress_minmax, nk.MinMaxFormat),
    "qsgd": (nk.compress_qsgd_rows, nk.compress_qsgd, nk.QSGDFormat),
    "onebit": (nk.compress_onebit_rows, nk.compress_onebit, nk.OneBitFormat),
}
ROW_SEEDS = (123456789, 2, 1)     # (base, rank, phase): row k's seed row_seed(base, rank, k, phase)
COL = 8                           # the payload sits after another segment's 8 bytes in each row
JUNK = 0xA5                       # bytes outside the payload's columns, which must stay as they are


def row_format(name, kw, part):
    """The format of one row's payload: a partition of ``part`` elements."""
    return ROW_FORMS[name][2](part, **{k: v for k, v in kw.items() if k in ("bits", "levels",
                                                                          "chunk")})


def partition_loop(name, kw, x, e, mat, col=COL):
    """What C_LP_S did before the row forms: one compress per partition (mat rows, in place)."""
    rows = mat.shape[0]
    part = x.size // rows
    fmt = row_format(name, kw, part)
    compress = ROW_FORMS[name][1]
    for k in range(rows):
        extra = {"seed": nk.row_seed(ROW_SEEDS[0], ROW_SEEDS[1], k, ROW_SEEDS[2])} \
            if name == "qsgd" else {}
        compress(x[k * part:(k + 1) * part], residual=None if e is None else
                 e[k * part:(k + 1) * part], out=mat[k, col:col + fmt.nbytes], **kw, **extra)
    return fmt


def row_form(name, kw, x, e, mat, col=COL):
    extra = {"row_seeds": ROW_SEEDS} if name == "qsgd" else {}
    return ROW_FORMS[name][0](x, mat, col, residual=e, **kw, **extra)


def loop_decode(fmt, mat, col=COL):
    """One decompress_many per row (the per-partition decode the row form replaces), host."""
    out = np.empty(mat.shape[0] * fmt.n, np.float32)
    for k in range(mat.shape[0]):
        nk.decompress_many(np.ascontiguousarray(mat[k:k + 1, col:col + fmt.nbytes]), fmt,
                           out=out[k * fmt.n:(k + 1) * fmt.n])
    return out


def row_matrix(rows, fmt, col=COL):
    return np.full((rows, col + fmt.nbytes + 16), JUNK, np.uint8)


# decompress_many at a column: every compressor of every format in numba_kernels.registry, with
# values for its parameters by name: ``REQUIRED`` for those without a default (a new one fails
# here until it is given one), ``SETTINGS`` for several chunks at small sizes, and each of the
# ``VARIANTS`` (other section dtypes, min-max's byte codes and packed ones) where the compressor takes that parameter.
REQUIRED = {"k": 17}
SETTINGS = {"chunk": 64, "levels": 15, "seed": 3}
VARIANTS = {"kind": ("fp16", "bf16"), "index_dtype": ("int32", "int64"), "bits": (8, 3)}


def registry_cases():
    """(id, compressor, kwargs) for every compressor in the registry and variant of its args."""
    cases = []
    for codec in CODECS:
        for compress in codec.compressors:
            params = list(inspect.signature(compress).parameters.values())[1:]
            kw = {p.name: REQUIRED[p.name] for p in params if p.default is inspect.Parameter.empty}
            kw.update({p.name: SETTINGS[p.name] for p in params if p.name in SETTINGS})
            names = [p.name for p in params if p.name in VARIANTS]
            for values in itertools.product(*(VARIANTS[name] for name in names)):
                args = dict(kw, **dict(zip(names, values)))
                cases.append(("-".join([compress.__name__, *map(str, values)]), compress, args))
    return cases


def payload_stack(compress, kw, n, rows, seed):
    """(format, (rows, nbytes) stack): ``compress`` on different data in each row, host."""
    rng = np.random.default_rng(seed)
    payloads = [compress(rng.standard_normal(n).astype(np.float32), **kw) for _ in range(rows)]
    return payloads[0].format, np.stack([p.buffer for p in payloads])


def at_column(stack, col, seed, extra=16):
    """The rows of ``stack`` at byte column ``col`` of wider rows of random bytes (``extra``
    more after them)."""
    rng = np.random.default_rng(seed)
    mat = rng.integers(0, 256, (stack.shape[0], col + stack.shape[1] + extra), dtype=np.uint8)
    mat[:, col:col + stack.shape[1]] = stack
    return mat


def segment_layout(specs, rows, chunk, gap=3):
    """``MinMaxSegment``s of (length, bits) specs with ``gap`` elements between them in the
    base arrays and 8 bytes between their payloads (the first at column 8); return (segments,
    base size, error memory size, row width, each segment's partition length)."""
    segments, parts = [], []
    offset = err = gap
    col = 8
    for length, bits in specs:
        part = -(-length // rows)
        segments.append(nk.MinMaxSegment(offset, length, bits, col, err))
        parts.append(part)
        offset += length + gap
        err += rows * part + gap
        col += nk.MinMaxFormat(part, bits, chunk).nbytes + 8
    return segments, offset, err, col, parts


def topk_segment_layout(specs, index_dtype):
    """``TopKSegment``s of (length, k) specs with 2 elements between their places in the base
    array, their residuals end to end in the reverse order of the places (so a mix-up of the
    two offsets shows), 8 bytes between payloads (the first at column 8); return (segments,
    base size, residual size, message width)."""
    segments, offset, col = [], 2, 8
    r_offsets = np.cumsum([1] + [n for n, _ in specs[::-1]])[::-1][1:]
    for (n, k), r in zip(specs, r_offsets):
        segments.append(nk.TopKSegment(offset, n, k, col, int(r)))
        offset += n + 2
        col += nk.TopKFormat(n, k, index_dtype).nbytes + 8
    return segments, offset, int(r_offsets[0]) + specs[0][0], col
