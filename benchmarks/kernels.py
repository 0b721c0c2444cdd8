"""Throughput of the numba_kernels compressors.

CPU: each CPU twin against an equivalent vectorised NumPy implementation of
the same job (same inputs, same outputs, error feedback included where the
row says so), in GB/s of float32 input.  GPU (when numba.cuda sees one): each
kernel's effective bandwidth (the bytes it must read and write) against the
device-to-device copy bandwidth measured in the same run, and the approximate
top-k against ``torch.topk``.  Each GPU call is timed twice: with the device
kept busy before it, so that CUDA events time its kernels and not the host's
launching (the bandwidth figures), and on an idle device, which also waits for
the host to launch each kernel (what a step sees when the host cannot run
ahead).  Also prints the compression ratio of each format.

    python benchmarks/kernels.py                   # CPU, n = 10**7
    python benchmarks/kernels.py --gpu-n 100000000 # adds the GPU section on a GPU machine
"""
import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numba_kernels as nk  # noqa: E402

CHUNK = 1024
ONEBIT_CHUNK = 4096
DENSITY = 0.001


def best_times(fns, repeats):
    """Best (wall, process CPU) time of each function, timed in turn
    (interleaved) so that a machine shared with other work slows all alike.
    CPU time counts every thread's work and barely moves with the load."""
    for fn in fns:
        fn()                              # warm-up (and JIT compilation)
    wall = [float("inf")] * len(fns)
    cpu = [float("inf")] * len(fns)
    for _ in range(repeats):
        for j, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[j] = min(wall[j], time.perf_counter() - t0)
            cpu[j] = min(cpu[j], time.process_time() - c0)
    return wall, cpu


# ---- NumPy equivalents ---------------------------------------------------

def np_fp16(x, e):
    c = x + e
    h = c.astype(np.float16)
    e[:] = c - h.astype(np.float32)
    return h


def np_bf16(x, e):
    c = x + e
    u = c.view(np.uint32)
    h = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    e[:] = c - (h.astype(np.uint32) << 16).view(np.float32)
    return h


def np_minmax(x, e, bits):
    c = x + e
    rows = c.reshape(-1, CHUNK)
    mn = rows.min(axis=1, keepdims=True)
    scale = (rows.max(axis=1, keepdims=True) - mn) / np.float32((1 << bits) - 1)
    inv = np.where(scale > 0, 1 / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    codes = np.floor((rows - mn) * inv + np.float32(0.5)).astype(np.uint8)
    e[:] = (rows - (codes * scale + mn)).reshape(-1)
    if bits == 4:
        codes = codes.reshape(-1, 2)
        codes = codes[:, 0] | (codes[:, 1] << 4)
    return codes, mn, scale


def np_qsgd(x, e, gen, levels=127):
    c = x + e
    rows = c.reshape(-1, CHUNK)
    norm = np.sqrt(np.einsum("ij,ij->i", rows, rows))[:, None]
    r = np.abs(rows) * (levels / np.where(norm > 0, norm, 1))
    lo = np.floor(r)
    level = lo + (gen.random(rows.shape, dtype=np.float32) < r - lo)
    codes = (np.sign(rows) * level).astype(np.int8)
    e[:] = (rows - codes * (norm / levels)).reshape(-1)
    return codes, norm


def np_onebit(x, e):
    c = x + e
    rows = c.reshape(-1, ONEBIT_CHUNK)
    scale = np.sqrt(np.einsum("ij,ij->i", rows, rows) / ONEBIT_CHUNK)[:, None]
    neg = rows < 0
    bits = np.packbits(neg, axis=None, bitorder="little")
    e[:] = (rows - np.where(neg, -scale, scale)).reshape(-1)
    return bits, scale


def np_topk(x, e, k):
    c = x + e
    idx = np.argpartition(np.abs(c), c.size - k)[c.size - k:]
    idx.sort()
    vals = c[idx]
    c[idx] = 0
    e[:] = c
    return idx.astype(np.int32), vals


def np_randk(x, gen, k):
    idx = np.sort(gen.choice(x.size, k, replace=False))
    return idx.astype(np.int32), x[idx]


def np_decode_many(codes, mn, scale, rows):
    out = np.zeros(codes.size, np.float32)
    for _ in range(rows):
        out += (codes * scale + mn).reshape(-1)
    return out


def np_decode_minmax4(words, params, n, rows):
    out = np.zeros(n, np.float32)
    mn, scale = params[0::2], params[1::2]
    for _ in range(rows):
        packed = words.view(np.uint8)
        codes = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)[:n]
        out += (codes.reshape(-1, CHUNK) * scale[:, None] + mn[:, None]).reshape(-1)
    return out


def np_decode_qsgd(codes, norms, rows):
    out = np.zeros(codes.size, np.float32)
    for _ in range(rows):
        out += (codes.reshape(-1, CHUNK) * (norms / np.float32(127))[:, None]).reshape(-1)
    return out


def np_decode_halves(halves, rows):
    out = np.zeros(halves.size, np.float32)
    for _ in range(rows):
        out += halves  # NumPy widens each element as it adds
    return out


def np_decode_onebit(signs, scales, n, rows):
    out = np.zeros(n, np.float32)
    for _ in range(rows):
        negative = np.unpackbits(signs.view(np.uint8), bitorder="little")[:n].astype(bool)
        magnitude = np.repeat(scales, ONEBIT_CHUNK)[:n]
        out += np.where(negative, -magnitude, magnitude)
    return out


# ---- CPU section -----------------------------------------------------------

def cpu_rows(n, repeats):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    e1, e2 = np.zeros_like(x), np.zeros_like(x)
    gen = np.random.default_rng(1)
    k = int(n * DENSITY)
    mm = nk.compress_minmax(x, 8, CHUNK)
    stack = np.stack([mm.buffer] * 4)
    codes, mn, scale = np_minmax(x, np.zeros_like(x), 8)
    ta, tb = nk.compress_topk(x, k), nk.compress_topk(x[::-1].copy(), k)
    mm4, qs, ob = (nk.compress_minmax(x, 4, CHUNK), nk.compress_qsgd(x, 127, CHUNK, seed=1),
                   nk.compress_onebit(x, ONEBIT_CHUNK))
    f16, b16 = nk.compress_cast(x, "fp16"), nk.compress_cast(x, "bf16")
    stack4, qstack, obstack, f16stack, b16stack = (np.stack([p.buffer] * 4)
                                                   for p in (mm4, qs, ob, f16, b16))
    return [
        ("fp16 cast + EF", lambda: nk.compress_cast(x, "fp16", residual=e1),
         lambda: np_fp16(x, e2)),
        ("bf16 cast + EF", lambda: nk.compress_cast(x, "bf16", residual=e1),
         lambda: np_bf16(x, e2)),
        ("min-max 8-bit + EF", lambda: nk.compress_minmax(x, 8, CHUNK, residual=e1),
         lambda: np_minmax(x, e2, 8)),
        ("min-max 4-bit + EF", lambda: nk.compress_minmax(x, 4, CHUNK, residual=e1),
         lambda: np_minmax(x, e2, 4)),
        ("QSGD 8-bit + EF", lambda: nk.compress_qsgd(x, 127, CHUNK, seed=1, residual=e1),
         lambda: np_qsgd(x, e2, gen)),
        ("1-bit (l2 scale) + EF", lambda: nk.compress_onebit(x, ONEBIT_CHUNK, residual=e1),
         lambda: np_onebit(x, e2)),
        ("top-k exact, d=0.001, + EF", lambda: nk.compress_topk(x, k, method="exact", residual=e1),
         lambda: np_topk(x, e2, k)),
        ("top-k approx, d=0.001, + EF", lambda: nk.compress_topk(x, k, residual=e1),
         lambda: np_topk(x, e2, k)),
        ("random-k, d=0.001", lambda: nk.compress_randk(x, k, seed=3), lambda: np_randk(x, gen, k)),
        ("decode min-max 8-bit x4 rows", lambda: nk.decompress_many(stack, mm.format),
         lambda: np_decode_many(codes, mn, scale, 4)),
        ("decode min-max 4-bit x4 rows", lambda: nk.decompress_many(stack4, mm4.format),
         lambda: np_decode_minmax4(mm4.views()["codes"], mm4.views()["params"], n, 4)),
        ("decode QSGD 8-bit x4 rows", lambda: nk.decompress_many(qstack, qs.format),
         lambda: np_decode_qsgd(qs.views()["codes"], qs.views()["norms"], 4)),
        ("decode 1-bit x4 rows", lambda: nk.decompress_many(obstack, ob.format),
         lambda: np_decode_onebit(ob.views()["signs"], ob.views()["scales"], n, 4)),
        ("decode fp16 x4 rows", lambda: nk.decompress_many(f16stack, f16.format),
         lambda: np_decode_halves(f16.views()["half"].view(np.float16), 4)),
        ("decode bf16 x4 rows", lambda: nk.decompress_many(b16stack, b16.format),
         lambda: np_decode_halves((b16.views()["half"].astype(np.uint32) << 16)
                                  .view(np.float32), 4)),
        ("merge two top-k (gTop-k round)", lambda: nk.merge_topk(ta, tb),
         lambda: np_merge(ta, tb, k)),
    ]


def np_merge(a, b, k):
    ia, va = a.views()["indices"], a.views()["values"]
    ib, vb = b.views()["indices"], b.views()["values"]
    idx = np.union1d(ia, ib)
    val = np.zeros(idx.size, np.float32)
    val[np.searchsorted(idx, ia)] += va
    val[np.searchsorted(idx, ib)] += vb
    keep = np.sort(np.argpartition(np.abs(val), idx.size - k)[idx.size - k:])
    return idx[keep], val[keep]


def cpu_section(n, repeats):
    n -= n % ONEBIT_CHUNK      # whole chunks, so the NumPy versions can reshape
    lines = [f"### CPU twins vs NumPy, n = {n:,} float32 (GB/s of input = 4n bytes / time)", "",
             "Wall time, best of the repeats, ours and NumPy timed alternately; the last "
             "column compares CPU time (all threads), which a shared machine disturbs less.", "",
             "| compressor | ours (ms) | ours GB/s | NumPy (ms) | NumPy GB/s | speed-up | "
             "CPU-time ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ours, ref in cpu_rows(n, repeats):
        (t_ours, t_ref), (c_ours, c_ref) = best_times([ours, ref], repeats)
        gb = 4 * n / 1e9
        lines.append(f"| {name} | {t_ours * 1e3:.2f} | {gb / t_ours:.2f} | {t_ref * 1e3:.2f} | "
                     f"{gb / t_ref:.2f} | {t_ref / t_ours:.1f}x | "
                     f"{c_ref / max(c_ours, 1e-9):.1f}x |")
    return lines


def ratio_section(n):
    k = int(n * DENSITY)
    rows = [("fp16 / bf16", nk.CastFormat(n)), ("min-max 8-bit, chunk 1024", nk.MinMaxFormat(n, 8)),
            ("min-max 4-bit, chunk 1024", nk.MinMaxFormat(n, 4)),
            ("min-max 2-bit, chunk 1024", nk.MinMaxFormat(n, 2)),
            ("QSGD 127 levels, chunk 1024", nk.QSGDFormat(n)),
            ("1-bit, chunk 4096", nk.OneBitFormat(n, ONEBIT_CHUNK)),
            ("1-bit, one scale", nk.OneBitFormat(n, -(-n // 32) * 32)),
            ("top-k d=0.001, int32 indices", nk.TopKFormat(n, k, "int32")),
            ("top-k d=0.001, int64 indices", nk.TopKFormat(n, k, "int64"))]
    lines = [f"### Compression ratio (float32 bytes / payload bytes), n = {n:,}", "",
             "| format | payload bytes | ratio |", "|---|---:|---:|"]
    lines += [f"| {name} | {f.nbytes:,} | {f.ratio:.2f}x |" for name, f in rows]
    return lines


# ---- GPU section -----------------------------------------------------------

def gpu_section(n, repeats):
    from numba import cuda
    if not cuda.is_available():
        return ["### GPU", "", "no CUDA GPU visible to numba.cuda: GPU section skipped"]
    rng = np.random.default_rng(0)
    host = rng.standard_normal(n).astype(np.float32)
    x = cuda.to_device(host)
    e = cuda.to_device(np.zeros(n, np.float32))
    dst = cuda.device_array_like(x)
    spare = cuda.to_device(host)
    k = int(n * DENSITY)

    from numba_kernels._cuda.common import scale as scale_kernel

    def busy(launches):
        """Keep the device busy (``launches`` passes over a spare array) so that a call
        enqueued behind them runs its kernels back to back: the events then time the device's
        work, not the host's launching (which a call issued to an idle device waits on)."""
        for _ in range(launches):
            scale_kernel(spare, np.float32(1.0))

    def between_events(fn, before=0):
        """(device seconds from a start event to a stop event around fn, host seconds of the
        call), ``before`` busy launches enqueued first."""
        busy(before)
        start, stop = cuda.event(), cuda.event()
        start.record()
        t0 = time.perf_counter()
        fn()
        host_s = time.perf_counter() - t0
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3, host_s

    t_busy = min(between_events(lambda: busy(1))[0] for _ in range(3))

    def timed(fn):
        """(device s, s per call on an idle device, host s of a call), each the best of the
        repeats. The device time has enough busy work queued before the call to cover twice
        its host time; the idle-device time is what a call costs when the host cannot run
        ahead of the device, launching included."""
        fn()
        cuda.synchronize()
        idle, host_s = min(between_events(fn) for _ in range(repeats))
        # (the simulator's events report 0: one busy launch there)
        before = min(64, 1 + int(2 * host_s / t_busy)) if t_busy > 0 else 1
        device = min(between_events(fn, before)[0] for _ in range(repeats))
        return max(device, 1e-9), max(idle, 1e-9), host_s

    def into_payload(compress):
        """compress(out=...) writing into one payload buffer kept across calls, as the
        primitives do (a fresh buffer per call would time Numba's allocator too)."""
        buf = compress(out=None).buffer
        return lambda: compress(out=buf)

    t_copy = timed(lambda: dst.copy_to_device(x))[0]
    copy_bw = 2 * 4 * n / t_copy

    def decode_row(label, payload):
        """Decoding 4 copies of ``payload`` (a stack as an all-gather leaves it) into one
        float32 array: the rows read, the output written."""
        stack = cuda.to_device(np.stack([payload.buffer.copy_to_host()] * 4))
        return (f"decode {label} x4 rows",
                lambda: nk.decompress_many(stack, payload.format, out=dst),
                4 * payload.nbytes + 4 * n)

    # bytes each kernel must move: inputs read + outputs written
    rows = [
        ("fp16 cast + EF", into_payload(lambda out: nk.compress_cast(x, "fp16", residual=e,
                                                                     out=out)),
         8 * n + 4 * n + 2 * n),
        ("min-max 8-bit + EF",
         into_payload(lambda out: nk.compress_minmax(x, 8, CHUNK, residual=e, out=out)),
         8 * n + 4 * n + nk.MinMaxFormat(n, 8).nbytes),
        ("min-max 8-bit, no EF", into_payload(lambda out: nk.compress_minmax(x, 8, CHUNK, out=out)),
         4 * n + nk.MinMaxFormat(n, 8).nbytes),
        ("min-max 4-bit + EF",
         into_payload(lambda out: nk.compress_minmax(x, 4, CHUNK, residual=e, out=out)),
         8 * n + 4 * n + nk.MinMaxFormat(n, 4).nbytes),
        ("QSGD 8-bit + EF",
         into_payload(lambda out: nk.compress_qsgd(x, 127, CHUNK, seed=1, residual=e, out=out)),
         8 * n + 4 * n + nk.QSGDFormat(n).nbytes),
        ("1-bit + EF, chunk 4096",
         into_payload(lambda out: nk.compress_onebit(x, ONEBIT_CHUNK, residual=e, out=out)),
         8 * n + 4 * n + nk.OneBitFormat(n, ONEBIT_CHUNK).nbytes),
        ("1-bit + EF, one scale",
         into_payload(lambda out: nk.compress_onebit(x, -(-n // 32) * 32, residual=e, out=out)),
         8 * n + 4 * n + nk.OneBitFormat(n, -(-n // 32) * 32).nbytes),
        decode_row("min-max 8-bit", nk.compress_minmax(x, 8, CHUNK)),
        decode_row("min-max 4-bit", nk.compress_minmax(x, 4, CHUNK)),
        decode_row("QSGD 8-bit", nk.compress_qsgd(x, 127, CHUNK, seed=1)),
        decode_row("1-bit, chunk 4096", nk.compress_onebit(x, ONEBIT_CHUNK)),
        decode_row("fp16", nk.compress_cast(x, "fp16")),
        ("top-k approx d=0.001", into_payload(lambda out: nk.compress_topk(x, k, out=out)), 4 * n),
        ("top-k exact d=0.001",
         into_payload(lambda out: nk.compress_topk(x, k, method="exact", out=out)), 4 * n),
    ]
    try:
        name = cuda.get_current_device().name
        name = name.decode() if isinstance(name, bytes) else name
    except AttributeError:        # the CUDA simulator has no device object
        name = "simulated"
    lines = [f"### GPU kernels, n = {n:,} float32 ({name})", "",
             f"device-to-device copy: {t_copy * 1e3:.3f} ms, {copy_bw / 1e9:.0f} GB/s "
             "(read + write)",
             "", "Best of the repeats, into payload buffers kept across calls. Device ms: CUDA "
             "events around the call with the device kept busy before it, so its kernels run "
             "back to back (the bandwidth columns use it). Idle ms: the same call on an idle "
             "device, which waits for the host to launch each kernel. Host ms: the call's own "
             "time on the host (launching, not waiting).", "",
             "| kernel | device ms | effective GB/s | % of copy bandwidth | idle ms | "
             "host ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, fn, nbytes in rows:
        t, idle, host_s = timed(fn)
        lines.append(f"| {name} | {t * 1e3:.3f} | {nbytes / t / 1e9:.0f} | "
                     f"{100 * nbytes / t / copy_bw:.0f}% | {idle * 1e3:.3f} | "
                     f"{host_s * 1e3:.3f} |")
    lines += [""] + register_lines()
    try:
        import torch
        if torch.cuda.is_available():
            xt = torch.as_tensor(x, device="cuda")
            t_torch, idle_torch, _ = timed(lambda: torch.topk(xt.abs(), k))
            t_ours, idle_ours, _ = timed(into_payload(lambda out: nk.compress_topk(x, k,
                                                                                 out=out)))
            lines += ["", f"top-k at density {DENSITY} on {n:,} float32, ours (approx) against "
                      f"torch.topk(x.abs(), k): device {t_ours * 1e3:.3f} ms against "
                      f"{t_torch * 1e3:.3f} ms ({t_torch / t_ours:.2f}x); on an idle device "
                      f"{idle_ours * 1e3:.3f} ms against {idle_torch * 1e3:.3f} ms "
                      f"({idle_torch / idle_ours:.2f}x)"]
    except ImportError:
        lines += ["", "torch not installed: torch.topk comparison skipped"]
    return lines


def register_lines():
    """Registers a thread of every numba_kernels kernel this run compiled, as the device's own
    toolchain built it (``tests/kernels/ptx_compile.py --resources`` predicts them without a
    GPU, with the CUDA toolkit's assembler)."""
    import importlib
    import pkgutil
    from numba_kernels import _cuda
    found = []
    for info in pkgutil.iter_modules(_cuda.__path__):
        module = importlib.import_module(f"numba_kernels._cuda.{info.name}")
        for name, obj in sorted(vars(module).items()):
            regs = getattr(obj, "get_regs_per_thread", None)
            if regs is None or not getattr(obj, "overloads", None):
                continue        # not a kernel, or not compiled in this run
            try:
                counts = regs()
            except Exception as exc:  # noqa: BLE001 - a report line, never the run's end
                return [f"registers a thread: not reported ({type(exc).__name__}: {exc})"]
            if counts:
                found.append(f"{info.name}.{name} {max(counts.values())}")
    if not found:
        return ["registers a thread: not reported (no compiled kernel exposes them here; the "
                "CUDA simulator does not)"]
    return ["registers a thread (largest over the argument types compiled), kernel by kernel: "
            + ", ".join(found)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10**7, help="CPU tensor size")
    ap.add_argument("--gpu-n", type=int, default=10**8, help="GPU tensor size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--markdown", help="also write the report, with this command, to this file")
    args = ap.parse_args(argv)
    import numba
    load = os.getloadavg()
    out = [f"numba_kernels benchmark: {platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} CPUs, numba {numba.__version__} ({numba.config.NUMBA_NUM_THREADS} "
           f"threads), numpy {np.__version__}, best of {args.repeats}; load average "
           f"{load[0]:.1f} at start", ""]
    out += cpu_section(args.n, args.repeats) + [""] + ratio_section(args.n)
    if not args.no_gpu:
        out += [""] + gpu_section(args.gpu_n, args.repeats)
    out += ["", f"load average {os.getloadavg()[0]:.1f} at end"]
    report = "\n".join(out)
    print(report)
    if args.markdown:
        command = "python " + " ".join(["benchmarks/kernels.py"] + (argv or sys.argv[1:]))
        with open(args.markdown, "w") as fh:
            fh.write(f"# numba_kernels benchmark\n\nCommand (from the repository root):\n\n"
                     f"    {command}\n\n{report}\n")


if __name__ == "__main__":
    main()
