"""Load another version of one of the package's modules, to run it beside this tree's.

A benchmark that compares a change with what came before takes the old file from a clone of an
older commit (``git clone -q . /tmp/old && git -C /tmp/old checkout REV``) and loads it with
``load_other_version``. Only that one module is old: its relative imports resolve to this tree's
modules, so both versions run on the same runtime, buffers and communicators.
"""
import importlib.util
import sys
from pathlib import Path

PACKAGE = "bagua_mpi"


def load_other_version(path):
    """The module in ``path`` (``.../bagua_mpi/primitives/lowrank.py``), loaded beside this
    tree's as ``bagua_mpi.primitives._lowrank_baseline``.

    It is registered in ``sys.modules`` before it runs, since a dataclass defined in it looks
    its module up there."""
    path = Path(path).resolve()
    parts = path.parent.parts
    if PACKAGE not in parts:
        raise ValueError(f"{path} is not inside a {PACKAGE} package directory")
    inside = parts[len(parts) - parts[::-1].index(PACKAGE) - 1:]
    name = ".".join(inside + (f"_{path.stem}_baseline",))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
