"""The benchmark scripts still load, and the L-GreCo comparison still prints its table.

Benchmarks run by hand and rarely, so a break in one (an import that moved, a key that was
renamed) would otherwise show only when someone needs its numbers: ``sparse.py --lgreco`` once
failed at its last line because L-GreCo's assignment became keyed by parameter name.
"""
import json
import subprocess
import sys

import pytest

from mpi_harness import REPO, assert_mpi_ok, run_mpi

BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))

# Imports every script as a module (each guards its run with ``__name__ == "__main__"``), from
# the benchmarks directory as when it runs, in one process: a subprocess a script would cost a
# torch import each.
_IMPORT_ALL = """
import importlib.util, json, sys, traceback
sys.path.insert(0, sys.argv[1])
errors = {}
for name in sys.argv[2:]:
    try:
        spec = importlib.util.spec_from_file_location(name[:-3], f"{sys.argv[1]}/{name}")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        errors[name] = None
    except BaseException:
        errors[name] = traceback.format_exc()
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def import_errors():
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(BENCHMARKS), *SCRIPTS],
                         capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_imports(script, import_errors):
    assert import_errors[script] is None, import_errors[script]


def test_lgreco_comparison_prints_its_assignment(tmp_path):
    """A few steps of ``sparse.py --lgreco topk`` at 2 ranks, to the end of its report."""
    table = tmp_path / "lgreco.md"
    result = run_mpi("../../benchmarks/sparse.py", 2, "--lgreco", "topk", "--levels", "0.1",
                     "--lgreco-default", "0.1", "--steps", "6", "--lgreco-warmup", "2",
                     "--lgreco-period", "2", "--vocab", "64", "--markdown", str(table),
                     timeout=240)
    assert_mpi_ok(result)
    text = table.read_text()
    assert "| L-GreCo (default" in text, text
    assert "last assignment (tensor (elements): level): tok.weight (" in text, text


def test_sparse_timing_runs_every_variant(tmp_path):
    """One small round of ``sparse_timing.py``'s ranks at 3 ranks (no shaped link): its gTop-k
    tree variant once handed the tree a segment in a form the primitive no longer took."""
    out = tmp_path / "samples.json"
    result = run_mpi("../../benchmarks/sparse_timing.py", 3, "--inner", "--json", str(out),
                     "--numel", "20000", "--densities", "0.01", "--rounds", "1", "--warmup", "0",
                     "--dense-rounds", "1", timeout=240)
    assert_mpi_ok(result)
    samples = json.loads(out.read_text())["samples"]
    assert set(samples) == {"dense@0", *(f"{name}@0.01" for name in (
        "compress", "topk", "gtopk", "allgather", "tree_bcast", "merges", "decode"))}, samples
    assert all(samples.values()), samples
