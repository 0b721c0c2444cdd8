"""Compile every recorded kernel launch to PTX: the real CUDA compiler's type check.

The simulator runs kernels as Python, so it cannot catch what only Numba's
CUDA compiler rejects (typing, unsupported calls).  ``sim_kernels.py`` records
the argument types of each launch; this script, run WITHOUT the simulator and
with libNVVM available (no GPU needed), compiles each one for a target
compute capability and exits non-zero on the first failure.

Usage: python ptx_compile.py signatures.json [major minor]
(NVVM runs at -O0, which is enough to type-check and lower; set
NUMBA_KERNELS_PTX_OPT=1 for the optimising compile.)
"""
import importlib
import json
import os
import sys

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


def main(path, cc=(9, 0)):
    from numba.cuda import dispatcher
    dispatcher.get_current_device = lambda: _Device(cc)
    with open(path) as fh:
        launches = json.load(fh)
    for module, name, specs in launches:
        kernel = getattr(importlib.import_module(module), name)
        sig = tuple(numba_type(s) for s in specs)
        try:
            cuda.compile_ptx(kernel.py_func, sig, cc=cc,
                             opt=os.environ.get("NUMBA_KERNELS_PTX_OPT") == "1")
        except Exception as exc:
            print(f"FAILED {module}.{name}{sig}:\n{exc}")
            return 1
        print(f"ok {module}.{name} {sig}")
    print(f"{len(launches)} launches compiled to PTX for sm_{cc[0]}{cc[1]}")
    return 0


if __name__ == "__main__":
    cc = tuple(int(v) for v in sys.argv[2:4]) if len(sys.argv) > 3 else (9, 0)
    sys.exit(main(sys.argv[1], cc))
