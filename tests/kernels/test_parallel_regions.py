"""Every parallel CPU twin starts the parallel regions its code names, its ``prange`` loops, and
no others.

In a function compiled with ``parallel=True`` Numba also turns array expressions and slice
assignments into parallel loops, each a region of its own: a fork and a join of the kernel
threads, where idle threads then spin. One such slice of zeros, in the serial loop over the
segments after the min-max segments' encode, started a region per segment and call (130 a
step for 64 L-GreCo layers); with two kernel threads beside the training thread on two cores
it tripled a small step. This module runs every host kernel once (every compressor of the
registry, the row forms, the decoders, the segmented functions, ``minmax_errors``), then
passes each parallel twin through Numba's front end again, with the types it met, as far as
the pass that makes the parallel loops, and lists the loops it made at the function's top
level: each must come from a ``prange``. (A loop made inside a ``prange`` body is lowered as
a plain serial loop and starts no region. The machine code, which says nothing more about
the loops, is not generated: the module took 44-46 s on 2 cores with it, 14-15 s without.)

The twins are enumerated from ``numba_kernels``' modules, so a new one that the calls below do
not reach fails here until it is given a call.
"""
import importlib
import pkgutil
import types

import numba
import numpy as np
import pytest
from numba.core.compiler import CompilerBase, DefaultPassBuilder, _EarlyPipelineCompletion
from numba.core.compiler_machinery import FunctionPass, PassManager, register_pass
from numba.core.registry import CPUDispatcher
from numba.parfors.parfor import Parfor

import numba_kernels as nk
from row_refs import (ROW_FORMS, registry_cases, row_format, row_matrix, segment_layout,
                      topk_segment_layout)


def _parallel_twins():
    """{"module.function": dispatcher} for every CPU function compiled with parallel=True."""
    found = {}
    for info in pkgutil.walk_packages(nk.__path__, "numba_kernels."):
        if info.name.startswith("numba_kernels._cuda"):
            continue   # device code, and importing it needs numba.cuda
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (isinstance(value, CPUDispatcher) and value.targetoptions.get("parallel")
                    and value.__module__ == module.__name__):
                found[f"{module.__name__}.{name}"] = value
    return found


TWINS = _parallel_twins()


def _run_every_host_kernel():
    """Each host kernel once, on small inputs that reach its parallel loops."""
    rng = np.random.default_rng(0)
    for _, compress, kw in registry_cases():
        payloads = [compress(rng.standard_normal(300).astype(np.float32), **kw)
                    for _ in range(2)]
        stack = np.stack([p.buffer for p in payloads])
        nk.decompress_many(stack, payloads[0].format)
    for name, kw in (("minmax", {"bits": 3, "chunk": 64}), ("qsgd", {"levels": 15, "chunk": 64}),
                     ("onebit", {"chunk": 64, "scale": "l2"})):
        for residual in (None, np.zeros(600, np.float32)):
            fmt = row_format(name, kw, 300)
            mat = row_matrix(2, fmt)
            extra = {"row_seeds": (1, 0, 1)} if name == "qsgd" else {}
            ROW_FORMS[name][0](rng.standard_normal(600).astype(np.float32), mat, 8,
                               residual=residual, **kw, **extra)
            nk.decompress_rows(mat, fmt, col=8)
    nk.minmax_errors(rng.standard_normal(300).astype(np.float32), [2, 4], chunk=64)
    segments, size, err_size, width, parts = segment_layout([(300, 3), (129, 8)], 2, 64)
    for residual in (None, np.zeros(err_size, np.float32)):
        mat = np.zeros((2, width), np.uint8)
        nk.compress_minmax_rows_segments(rng.standard_normal(size).astype(np.float32), segments,
                                         mat, chunk=64, residual=residual)
        nk.decompress_minmax_rows_segments(mat, segments, np.zeros(size, np.float32), chunk=64)
        sums = [nk.MinMaxSegment(j * 200, part, s.bits, s.col)
                for j, (s, part) in enumerate(zip(segments, parts))]
        nk.decompress_minmax_segments(mat, sums, np.zeros(400, np.float32), chunk=64)
    for index_dtype in ("int32", "int64"):
        segments, size, r_size, width = topk_segment_layout([(300, 7), (129, 3)], index_dtype)
        for residual in (None, np.zeros(r_size, np.float32)):
            sent, other, merged = (np.zeros(width, np.uint8) for _ in range(3))
            for msg in (sent, other):
                nk.compress_topk_segments(rng.standard_normal(size).astype(np.float32),
                                          segments, msg, index_dtype, residual=residual)
            nk.merge_topk_segments(sent, other, segments, merged, index_dtype)
            nk.decompress_topk_segments(merged, segments, np.zeros(size, np.float32),
                                        index_dtype, factor=0.5, residual=residual,
                                        sent=None if residual is None else sent)


@pytest.fixture(scope="module")
def kernels_run():
    _run_every_host_kernel()


@register_pass(mutates_CFG=False, analysis_only=True)
class _StopWithTheParallelLoops(FunctionPass):
    """The pipeline's end: hands back the function's IR as the parallel-loop passes left it."""
    _name = "stop_with_the_parallel_loops"

    def __init__(self):
        FunctionPass.__init__(self)

    def run_pass(self, state):
        raise _EarlyPipelineCompletion(types.SimpleNamespace(typing_error=None,
                                                             func_ir=state.func_ir))


class _UpToTheParallelLoops(CompilerBase):
    """Numba's own untyped and typed passes (typing, inlining, the conversion of prange loops,
    array expressions and slice assignments to parallel loops, their fusion), and no
    lowering."""

    def define_pipelines(self):
        pm = PassManager("up_to_the_parallel_loops")
        for part in (DefaultPassBuilder.define_untyped_pipeline(self.state),
                     DefaultPassBuilder.define_typed_pipeline(self.state)):
            pm.passes.extend(part.passes)
        pm.add_pass(_StopWithTheParallelLoops, "hand back the IR with its parallel loops")
        pm.finalize()
        return [pm]


def _parallel_loops(dispatcher):
    """(line, how Numba made it) of each parallel loop at the top level of ``dispatcher``'s
    function, for the first types it was called with: what becomes a parallel loop is a
    matter of the code's statements, not of the element types."""
    options = {k: v for k, v in dispatcher.targetoptions.items()
               if k not in ("cache", "nopython")}
    fresh = numba.njit(pipeline_class=_UpToTheParallelLoops, **options)(dispatcher.py_func)
    result = fresh._compiler._compile_core(dispatcher.signatures[0], None)
    loops = [stmt for block in result.func_ir.blocks.values() for stmt in block.body
             if isinstance(stmt, Parfor)]
    return [(loop.loc.line, loop.patterns[0][0] if loop.patterns else "?") for loop in loops]


def test_the_twins_are_found():
    assert len(TWINS) >= 20, sorted(TWINS)   # there were 21 when this was written


@pytest.mark.parametrize("name", sorted(TWINS))
def test_parallel_regions_are_the_pranges(kernels_run, name):
    dispatcher = TWINS[name]
    assert dispatcher.signatures, (f"{name} was not called by _run_every_host_kernel: give it a "
                                   f"call there")
    loops = _parallel_loops(dispatcher)
    assert loops, f"{name} is compiled parallel but has no parallel loop"
    others = [(line, kind) for line, kind in loops if kind != "prange"]
    assert not others, (f"{name}: Numba made parallel loops of its own at lines "
                        f"{others} (an array expression or a slice assignment; write a loop)")
