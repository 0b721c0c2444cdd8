"""Compile every recorded kernel launch to PTX: the real CUDA compiler's type check.

The simulator runs kernels as Python, so it cannot catch what only Numba's
CUDA compiler rejects (typing, unsupported calls).  ``sim_kernels.py`` records
the argument types of each launch; this script, run WITHOUT the simulator and
with libNVVM available (no GPU needed), compiles each one for a target
compute capability and exits non-zero if any launch fails (each failure printed).

Usage: python ptx_compile.py signatures.json [major minor] [--resources]
(NVVM runs at -O0, which is enough to type-check and lower; set
NUMBA_KERNELS_PTX_OPT=1 for the optimising compile.)

The optimising compile also checks that no compiler fuses a multiply and an add by itself,
which would make a kernel's bytes differ from its CPU twin's (the CPU compiler does not fuse,
and the simulator runs Python's arithmetic): an addition or subtraction in the PTX that takes
a plain product (``mul.f32``, not ``mul.rn.f32``) is one ``ptxas`` may fuse, and NVVM is
compiled a second time with contraction off (``-fma=0``) to show it fused nothing itself (the
same count of ``fma`` instructions). The kernels write their multiply-adds as ``fma32`` and
their products as ``mul32`` instead. A kernel module may excuse a pair in an
``EXACT_PRODUCTS`` dict (kernel name -> why): a product that is exact rounds alike fused or
not.

Every compile also checks that the kernels use only exact or correctly rounded operations,
which the CPU twins compute alike: the library functions the IR given to NVVM declares
(libdevice's ``__nv_*``, LLVM's intrinsics) must be in ``EXACT_CALLS`` (``expf``, ``logf``,
``sinf``, ``powf`` are not: each GPU library rounds them its own way), NVVM may not be asked
for fast math, and no PTX instruction may be approximate (``.approx``) or flush subnormals to
zero (``.ftz``). Each kernel is compiled with its own options (``fastmath`` included), as a GPU
run compiles it.

With ``--resources`` it compiles with optimisation, as a GPU run does, assembles each launch
with ``ptxas -v`` (the CUDA toolkit's assembler; no GPU needed) and prints, per kernel, the
largest register count over its recorded signatures, spills, static shared memory and the
blocks of THREADS threads that fit on one SM of the target.  It exits 1 if a kernel spills or
needs more than REGISTER_LIMIT registers a thread.  A streaming kernel hides memory latency
with the warps in flight: registers are what limit them here (the stack decoders needed 72,
three blocks an SM, before their indices were made unsigned).
"""
import importlib
import json
import math
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import numba
from numba import cuda


def numba_type(spec):
    kind = spec[0]
    if kind == "array":
        _, dtype, ndim, contiguous = spec
        arr = np.empty((2,) * ndim, np.dtype(dtype))
        ty = numba.typeof(arr)
        return ty if contiguous else ty.copy(layout="A")
    if kind == "scalar":
        return numba.typeof(np.dtype(spec[1]).type(0))
    return {"bool": numba.types.boolean, "int": numba.types.int64,
            "float": numba.types.float64}[kind]


class _Device:
    """Stands in for the current device: device functions ask it for its
    compute capability, which would otherwise need a CUDA driver."""

    def __init__(self, cc):
        self.compute_capability = cc


# At 256 threads a block, 64 registers a thread leave room for 4 blocks (half the SM's
# 2048 threads) on every architecture from sm_70 on. A kernel module may allow one of its
# kernels more in a ``REGISTER_BUDGET`` dict (kernel name -> registers), saying why there.
REGISTER_LIMIT = 64
# Per SM, sm_70 to sm_90: registers, threads, and the allocation unit of registers a warp.
SM_REGISTERS, SM_THREADS, WARP_ALLOCATION = 65536, 2048, 256


def blocks_per_sm(registers, threads, shared_bytes, shared_per_sm=228 * 1024):
    """Blocks of ``threads`` threads resident on one SM, as registers, threads and shared
    memory allow."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(registers, 1) * 32 / WARP_ALLOCATION) * WARP_ALLOCATION
    limits = [SM_REGISTERS // (per_warp * warps), SM_THREADS // threads, 32]
    if shared_bytes:
        limits.append(shared_per_sm // (shared_bytes + 1024))   # 1 KB reserved a block
    return min(limits)


def ptxas_resources(ptx, cc):
    """(registers, spill bytes, shared bytes) that ``ptxas -v`` reports for one kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        out = subprocess.run(["ptxas", "-v", f"-arch=sm_{cc[0]}{cc[1]}", src, "-o",
                              os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    shared = re.search(r"(\d+) bytes smem", out)
    return registers, spills, int(shared.group(1)) if shared else 0


# An instruction of the PTX, its predicate guard left out: (opcode, operands).
_GUARD = r"^\s*(?:@!?%p\d+\s+)?"  # a PTX line's start, and its predicate if it has one
_INSTRUCTION = re.compile(_GUARD + r"([a-z][\w.]*)\s+([^;]*);")
_FLOAT_FMA = re.compile(r"\bfma\.rn\.f(?:32|64)\b")
# NVVM's options for the second compile (forked workers inherit it; see main)
_EXTRA_NVVM_OPTIONS = {}
# The library functions the compile in progress declares, and whether NVVM was asked for fast
# math (filled by the wrapped compile_ir)
_IR_SEEN = {"calls": set(), "fast": False}

# Library functions whose results are exact or correctly rounded (sqrt and division are, under
# NVVM's defaults without fastmath), as the CPU twins' are; any other is reported. A kernel
# that needs another must show on a GPU that its bytes are its twin's, then add it here.
EXACT_CALLS = re.compile(r"""(
    __nv_(fabs|floor|ceil|trunc|rint|nearbyint|fmin|fmax|copysign|fma|sqrt
          |isfinite|isnan|isinf|signbit)[fd]?
  | __nv_(float_as_u?int|u?int_as_float|double_as_longlong|longlong_as_double
          |double2hiint|double2loint|hiloint2double)
  | __nv_(popc|popcll|clz|clzll|ffs|ffsll|brev|brevll|u?mulhi|u?mul64hi|u?(ll)?(min|max)
          |(ll)?abs)
  | llvm\.(fma|fabs|floor|ceil|trunc|rint|nearbyint|copysign|minnum|maxnum|sqrt|ctpop|ctlz
          |cttz|bswap|bitreverse|memset|memcpy|memmove|lifetime|assume|smin|smax|umin|umax
          |[su](add|sub|mul)\.with\.overflow)\..*
  | llvm\.nvvm\.(?!.*(approx|ftz)).*
)""", re.X)
_DECLARED = re.compile(r'^declare[^@\n]*@"?((?:__nv_|llvm\.)[\w.]+)', re.M)
_INEXACT_PTX = re.compile(_GUARD + r"([a-z][\w.]*\.(?:approx|ftz)\b[\w.]*)", re.M)


def inexact_operations(declared, fastmath, ptx):
    """What in one compile a CPU twin would not compute alike: library functions outside
    ``EXACT_CALLS``, NVVM's fast math, approximate or flushing PTX instructions (each named
    once)."""
    return ([f"calls {name}" for name in sorted(declared) if not EXACT_CALLS.fullmatch(name)]
            + ["NVVM compiled with fastmath"] * bool(fastmath)
            + [f"PTX {op}" for op in sorted(set(_INEXACT_PTX.findall(ptx)))])


def _see_ir(llvmir, options):
    _IR_SEEN["fast"] = _IR_SEEN["fast"] or bool(options.get("fastmath"))
    for text in llvmir if isinstance(llvmir, (list, tuple)) else [llvmir]:
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        _IR_SEEN["calls"].update(_DECLARED.findall(text))


def _float_op(opcode):
    """("mul" / "add" / ..., rounding given) for a float32/64 opcode, else None."""
    parts = opcode.split(".")
    if parts[-1] not in ("f32", "f64"):
        return None
    return parts[0], "rn" in parts


def fusable_pairs(ptx):
    """The additions and subtractions in ``ptx`` that take a product with no rounding mode
    (``mul.f32``, not ``mul.rn.f32``), directly or through a copy or a negation: pairs
    ``ptxas`` is free to fuse into an FMA."""
    products, pairs = set(), []
    for line in ptx.splitlines():
        match = _INSTRUCTION.match(line)
        op = match and _float_op(match.group(1))
        if not op or op[1]:
            continue
        operands = [a.strip() for a in match.group(2).split(",")]
        if op[0] == "mul" or (op[0] in ("mov", "neg") and operands[1] in products):
            products.add(operands[0])
        elif op[0] in ("add", "sub") and any(a in products for a in operands[1:]):
            pairs.append(line.strip())
    return pairs


def contraction_problems(kernel, sig, cc, ptx, excused):
    """What a compiler could fuse in one launch, unless ``excused`` says why it is exact."""
    problems = [] if excused else [f"ptxas may fuse: {p}" for p in fusable_pairs(ptx)]
    _EXTRA_NVVM_OPTIONS["fma"] = False
    try:
        strict, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc, opt=True,
                                     fastmath=kernel.targetoptions.get("fastmath", False))
    finally:
        _EXTRA_NVVM_OPTIONS.clear()
    fused, written = len(_FLOAT_FMA.findall(ptx)), len(_FLOAT_FMA.findall(strict))
    if fused != written:
        problems.append(f"NVVM fused: {fused} fma with contraction on, {written} with it off")
    return problems


def compile_launch(launch, cc, resources):
    """One recorded launch: (its line, its kernel's key, its register budget, ptxas's resources
    or None, (what a compiler could fuse or None where not checked, its inexact operations),
    failed)."""
    module, name, specs = launch
    kernel = getattr(importlib.import_module(module), name)
    sig = tuple(numba_type(s) for s in specs)
    optimise = resources or os.environ.get("NUMBA_KERNELS_PTX_OPT") == "1"
    fastmath = kernel.targetoptions.get("fastmath", False)
    _IR_SEEN["calls"].clear()
    _IR_SEEN["fast"] = False
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc, opt=optimise, fastmath=fastmath)
    except Exception as exc:
        return f"FAILED {module}.{name}{sig}:\n{exc}", None, None, None, None, True
    inexact = inexact_operations(_IR_SEEN["calls"], _IR_SEEN["fast"], ptx)
    key = f"{module.rsplit('.', 1)[-1]}.{name}"
    source = importlib.import_module(module)
    budget = getattr(source, "REGISTER_BUDGET", {}).get(name, REGISTER_LIMIT)
    used = ptxas_resources(ptx, cc) if resources else None
    fusable = (contraction_problems(kernel, sig, cc, ptx,
                                    name in getattr(source, "EXACT_PRODUCTS", {}))
               if optimise else None)
    return (f"ok {module}.{name} {sig}", key, budget, used,
            (fusable, [f"INEXACT {module}.{name} {sig}: {p}" for p in inexact]), False)


def _compile_ir_with_extra_options(compile_ir):
    def compile_with(llvmir, **options):
        _see_ir(llvmir, options)
        return compile_ir(llvmir, **{**options, **_EXTRA_NVVM_OPTIONS})
    return compile_with


def main(path, cc=(9, 0), resources=False):
    from numba.cuda import dispatcher
    from numba.cuda.cudadrv import nvvm
    dispatcher.get_current_device = lambda: _Device(cc)
    nvvm.compile_ir = _compile_ir_with_extra_options(nvvm.compile_ir)
    with open(path) as fh:
        launches = json.load(fh)
    # Each compile is independent and single-threaded: one worker process a core (forked, so
    # each has the device stand-in above), results in the launches' order.
    workers = max(1, min(len(launches), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(compile_launch, launches, [cc] * len(launches),
                                [resources] * len(launches)))
    worst, budgets, fusable, inexact = {}, {}, [], []
    for line, key, budget, used, problems, failed in results:
        print(line)
        if used is not None:   # the largest of each over the kernel's signatures
            worst[key] = tuple(map(max, worst.get(key, (0, 0, 0)), used))
            budgets[key] = budget
        if problems is not None:
            fusable += [f"FUSABLE {line[3:]}: {p}" for p in problems[0] or ()]
            inexact += problems[1]
    failures = sum(failed for *_, failed in results)
    if failures:
        print(f"{failures} of {len(launches)} launches FAILED to compile")
        return 1
    print(f"{len(launches)} launches compiled to PTX for sm_{cc[0]}{cc[1]}")
    print("\n".join(inexact) if inexact else
          f"only exact or correctly rounded operations in {len(launches)} launches")
    if results and results[0][4][0] is not None:   # the optimising compile checked contraction
        print("\n".join(fusable) if fusable else
              f"no multiply-add left to the compilers to fuse in {len(launches)} launches")
    status = report(worst, budgets, cc) if resources else 0
    return 1 if fusable or inexact else status


def report(worst, budgets, cc):
    """Print the resources table; 1 if a kernel spills or needs too many registers."""
    from numba_kernels._cuda.geometry import THREADS
    print(f"\n| kernel (sm_{cc[0]}{cc[1]}, {THREADS} threads a block) | registers | spill bytes "
          "| shared bytes | blocks an SM | occupancy |\n|---|---:|---:|---:|---:|---:|")
    bad = []
    for name, (registers, spills, shared) in sorted(worst.items()):
        budget = budgets[name]
        blocks = blocks_per_sm(registers, THREADS, shared)
        label = name if budget == REGISTER_LIMIT else f"{name} (budget {budget})"
        print(f"| {label} | {registers} | {spills} | {shared} | {blocks} | "
              f"{blocks * THREADS / SM_THREADS:.0%} |")
        if spills or registers > budget:
            bad.append(f"{name}: {registers} registers, {spills} spill bytes (at most "
                       f"{budget} registers, no spills)")
    for line in bad:
        print(f"OVER BUDGET: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--resources"]
    cc = tuple(int(v) for v in args[1:3]) if len(args) > 2 else (9, 0)
    if "--resources" in sys.argv and shutil.which("ptxas") is None:
        sys.exit("ptxas not found: --resources needs the CUDA toolkit's assembler")
    sys.exit(main(args[0], cc, resources="--resources" in sys.argv))
