"""CUDA kernels in Numba's simulator, and their compilation for a real GPU.

The simulator must be switched on before numba.cuda is first imported, so it
runs ``sim_kernels.py`` (kernels against their CPU twins, in two processes, and
three more in the GPU's block shapes) and ``sim_launches.py`` (launch and sync counts)
in subprocesses side by side with NUMBA_ENABLE_CUDASIM=1, every one with the
race check on (``numba_kernels._simulator_races``); the rest of the suite keeps
the real numba.cuda.
The ``sim_kernels.py`` processes also record the argument types of every kernel
launch, which ``ptx_compile.py`` then compiles to PTX with the real CUDA compiler
where libNVVM is installed, and ``ptxas`` assembles for each kernel's registers where the
CUDA toolkit is (no GPU needed); the optimised PTX is also searched for a multiply and an add
that a compiler could fuse, and every compile for operations that are not exact or correctly
rounded (``expf``, fast math, ``.approx``), which only a GPU's bytes would show.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


# sim_kernels.py's three longest tests run in a process of their own, so the processes share 2
# cores about evenly. Three more run the kernels in the GPU's shapes (256-thread blocks, 32-lane
# warps, the warp-shuffle code with the simulator's warp intrinsics), the code a GPU runs and
# the simulator's own shapes do not: the *gpu_shapes* tests (row forms, warp intrinsics,
# geometry) in one, every per-format test in the other two (top-k's and the stacked decodes',
# the rest); the row, top-k and merge tests on a grid took about 300 s there and are left to
# the others. In one process the per-format tests took 99-117 s of wall time with the four
# others beside it, and set the run's length; in two, the six processes take 80-87 s.
SLOW_KERNEL_TESTS = ("test_topk_approx or test_row_forms_equal_the_per_partition_calls"
                     " or test_row_forms_long_chunks")
PER_FORMAT = "not (gpu_shapes or row_forms or topk_approx or on_a_grid or race_check)"
PER_FORMAT_HALF = "topk or decompress_many"
GPU_SHAPES = {"NUMBA_KERNELS_GPU_SHAPES": "1"}
RUNS = [(("sim_kernels.py", "-k", SLOW_KERNEL_TESTS), {}),
        (("sim_kernels.py", "-k", f"not ({SLOW_KERNEL_TESTS}) and not gpu_shapes"), {}),
        (("sim_launches.py",), {}),
        (("sim_kernels.py", "-k", "gpu_shapes"), GPU_SHAPES),
        (("sim_kernels.py", "-k", f"({PER_FORMAT}) and ({PER_FORMAT_HALF})"), GPU_SHAPES),
        (("sim_kernels.py", "-k", f"({PER_FORMAT}) and not ({PER_FORMAT_HALF})"), GPU_SHAPES)]


@pytest.fixture(scope="module")
def simulator_run(tmp_path_factory):
    """The simulator files at once, in processes of their own (the simulator runs on one core);
    the launches that the sim_kernels.py processes record are merged into one file."""
    folder = tmp_path_factory.mktemp("simulator")
    records = [folder / f"launches{i}.json" for i in range(len(RUNS))]
    procs = [subprocess.Popen([sys.executable, "-W", "ignore::RuntimeWarning", "-m", "pytest", "-q",
                               "-p", "no:cacheprovider", str(HERE / name), *more],
                              env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
                                       NUMBA_KERNELS_RACECHECK="1",
                                       NUMBA_KERNELS_RECORD=str(record), **env),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for ((name, *more), env), record in zip(RUNS, records)]
    outputs = [proc.communicate(timeout=900) for proc in procs]
    unique = {json.dumps(launch) for path in records if path.exists()
              for launch in json.loads(path.read_text())}
    record = folder / "launches.json"   # only when every sim_kernels.py process wrote its own
    if all(path.exists() for ((name, *_), _), path in zip(RUNS, records)
           if name == "sim_kernels.py"):
        record.write_text(json.dumps([json.loads(s) for s in sorted(unique)]))
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err)
            for p, (out, err) in zip(procs, outputs)], record


def _assert_passed(runs):
    out = "".join(r.stdout + r.stderr for r in runs)
    print(out[-8000:])
    assert all(r.returncode == 0 for r in runs), out
    assert all(" passed" in r.stdout and "skipped" not in r.stdout for r in runs), out


def test_kernels_match_cpu_twins_in_simulator(simulator_run):
    runs, record = simulator_run
    _assert_passed([r for r, (_, env) in zip(runs, RUNS) if not env])
    assert record.exists()


def test_kernels_match_cpu_twins_in_the_gpus_shapes(simulator_run):
    """The same checks in 256-thread blocks with the warp-shuffle code (see RUNS)."""
    runs, _ = simulator_run
    _assert_passed([r for r, (_, env) in zip(runs, RUNS) if env])


def _nvvm_available():
    code = ("from numba.cuda.cudadrv import nvvm; import sys; "
            "sys.exit(0 if nvvm.is_available() else 1)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    return proc.returncode == 0


@pytest.fixture(scope="module")
def ptx_run(simulator_run):
    """``ptx_compile.py`` on the recorded launches, once for both tests below: with
    ``--resources`` (an optimising compile, which type-checks as well, then ``ptxas``) where
    the CUDA toolkit's assembler is on PATH, a plain compile otherwise.  (The compile's
    output, whether it ran with resources.)"""
    runs, record = simulator_run
    if any(r.returncode for r in runs) or not record.exists():
        pytest.skip("a simulator run failed; see test_kernels_match_cpu_twins_in_*")
    if not _nvvm_available():
        pytest.skip("libNVVM not found (install nvidia-cuda-nvcc-cu12 and point CUDA_HOME at it): "
                    "cannot compile the kernels to PTX")
    resources = shutil.which("ptxas") is not None
    # the optimising compile, as a GPU run's, with or without ptxas: the contraction check
    # reads what it gives
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_KERNELS_PTX_OPT"] = "1"
    out = subprocess.run([sys.executable, str(HERE / "ptx_compile.py"), str(record),
                          *(["--resources"] if resources else [])], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    return out, resources


def test_kernels_compile_to_ptx(ptx_run):
    out, _ = ptx_run
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert "compiled to PTX" in out.stdout, out.stdout + out.stderr
    assert "FAILED" not in out.stdout


def test_kernels_fit_the_register_budget(ptx_run):
    """Every recorded launch, compiled as for a GPU and assembled by ``ptxas``: no kernel spills
    registers or needs more than 64 a thread (half an SM's threads at 256 a block), or more
    than its module's ``REGISTER_BUDGET`` allows it; the table printed is
    ``benchmarks/results/kernel_resources.md``'s."""
    out, resources = ptx_run
    if not resources:
        pytest.skip("ptxas (the CUDA toolkit's assembler) not on PATH: cannot count registers")
    table = out.stdout[out.stdout.find("| kernel"):]
    print(table, out.stderr[-3000:])
    assert "compiled to PTX" in out.stdout, "the compile failed: see test_kernels_compile_to_ptx"
    assert table.startswith("| kernel") and "Traceback" not in out.stderr, table + out.stderr
    assert "OVER BUDGET" not in out.stdout, table + out.stderr


def test_no_compiler_fuses_a_multiply_and_an_add(ptx_run):
    """The bytes of a kernel are its CPU twin's only if every multiply-add rounds as there: CUDA
    compilers fuse ``a * b + c`` into an FMA by themselves, the CPU compiler does not, and the
    simulator runs Python's arithmetic, so neither would show a fused pair. In every recorded
    launch's optimised PTX no addition or subtraction may take a product with no rounding mode
    (``ptxas`` may fuse those), and NVVM compiled with contraction off gives as many ``fma``
    instructions (it fused none itself); ``ptx_compile.py`` explains the exceptions."""
    out, _ = ptx_run
    assert "compiled to PTX" in out.stdout, "the compile failed: see test_kernels_compile_to_ptx"
    fusable = [line for line in out.stdout.splitlines() if line.startswith("FUSABLE")]
    assert not fusable, "\n".join(fusable)
    assert "no multiply-add left to the compilers to fuse" in out.stdout, out.stdout[-3000:]


def test_kernels_use_only_exact_or_correctly_rounded_operations(ptx_run):
    """A kernel's bytes are its CPU twin's only where both compute alike, and GPU libraries round
    ``exp``, ``log``, ``sin`` or ``pow`` their own way (libdevice's ``expf`` is built on an
    approximate ``ex2``), as does fast math. Every recorded launch calls only library functions
    of ``ptx_compile.EXACT_CALLS``, without fast math, and its PTX has no ``.approx`` or
    ``.ftz`` instruction."""
    out, _ = ptx_run
    assert "compiled to PTX" in out.stdout, "the compile failed: see test_kernels_compile_to_ptx"
    inexact = [line for line in out.stdout.splitlines() if line.startswith("INEXACT")]
    assert not inexact, "\n".join(inexact)
    assert "only exact or correctly rounded operations in" in out.stdout, out.stdout[-3000:]


_INEXACT_KERNELS = """
import math

from numba import cuda


@cuda.jit
def exact(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = cuda.fma(math.floor(x[i]), math.sqrt(abs(x[i])), x[i] / y[i])


@cuda.jit
def with_exp(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = math.exp(x[i])


@cuda.jit
def with_sin(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = math.sin(x[i])


@cuda.jit(fastmath=True)
def fast(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] / y[i] + x[i]


@cuda.jit(device=True, fastmath=True)
def fast_ratio(a, b):
    return a / b


@cuda.jit
def calls_a_fast_device_function(x, y):
    i = cuda.grid(1)
    if i < x.size:
        y[i] = fast_ratio(x[i], y[i])
"""


def test_the_exactness_check_names_each_inexact_operation(tmp_path):
    """``ptx_compile.py`` on a module of small kernels: floor, sqrt, division and an FMA pass;
    ``math.exp`` (a library call, and ``ex2.approx`` in the PTX), ``math.sin`` (a library call
    whose PTX has no approximate instruction), a kernel compiled with ``fastmath=True`` and a
    kernel that calls a fast-math device function are each reported, and the check fails."""
    if not _nvvm_available():
        pytest.skip("libNVVM not found (install nvidia-cuda-nvcc-cu12 and point CUDA_HOME at it): "
                    "cannot compile kernels to PTX")
    (tmp_path / "inexact_kernels.py").write_text(_INEXACT_KERNELS)
    names = ["exact", "with_exp", "with_sin", "fast", "calls_a_fast_device_function"]
    spec = ["array", "float32", 1, True]
    record = tmp_path / "launches.json"
    record.write_text(json.dumps([["inexact_kernels", name, [spec, spec]] for name in names]))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(HERE / "ptx_compile.py"), str(record)], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "5 launches compiled to PTX" in out.stdout, out.stdout + out.stderr
    found = {}
    for line in out.stdout.splitlines():
        if line.startswith("INEXACT"):
            kernel = line.split()[1].rsplit(".", 1)[1]
            found.setdefault(kernel, []).append(line.rsplit("): ", 1)[1])
    assert "exact" not in found, found
    assert "calls __nv_expf" in found["with_exp"], found
    assert any(p.startswith("PTX ex2.approx") for p in found["with_exp"]), found
    assert found["with_sin"] == ["calls __nv_sinf"], found
    assert "NVVM compiled with fastmath" in found["fast"], found
    assert any(p.startswith("PTX div.approx") for p in found["fast"]), found
    assert "calls __nv_fast_fdividef" in found["calls_a_fast_device_function"], found
    assert out.returncode == 1


def test_fusable_pairs_follow_a_product_through_copies_and_negations():
    """The PTX reading of the check above, on hand-written PTX: a sum may take a product with
    no rounding mode through a copy or a negation; ``.rn`` on either side, or a register that
    holds no product yet, is no pair."""
    sys.path.insert(0, str(HERE))
    try:
        from ptx_compile import fusable_pairs
    finally:
        sys.path.remove(str(HERE))
    ptx = "\n".join(["\tmul.f32 \t%f1, %f2, %f3;",
                     "\tmov.f32 \t%f4, %f1;",
                     "\tneg.f32 \t%f5, %f4;",
                     "\tadd.f32 \t%f6, %f5, %f7;",          # fusable: -(f2 * f3) + f7
                     "\tadd.rn.f32 \t%f8, %f1, %f7;",       # rounds on its own
                     "\tmul.rn.f32 \t%f9, %f2, %f3;",
                     "\tsub.f32 \t%f10, %f7, %f9;",         # the product rounds on its own
                     "\t@%p1 sub.f64 \t%fd1, %fd2, %fd3;",  # %fd3 holds no product yet
                     "\tmul.f64 \t%fd3, %fd4, %fd5;",
                     "\t@!%p2 sub.f64 \t%fd6, %fd2, %fd3;"])  # fusable, under a predicate
    assert fusable_pairs(ptx) == ["add.f32 \t%f6, %f5, %f7;", "@!%p2 sub.f64 \t%fd6, %fd2, %fd3;"]
