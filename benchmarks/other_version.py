"""Load another version of one of this tree's modules, to run it beside this tree's.

A benchmark that compares a change with what came before takes the old file from a clone of an
older commit (``git clone -q . /tmp/old && git -C /tmp/old checkout REV``) and loads it with
``load_other_version``. Only that one module is old: its relative imports resolve to this tree's
modules, so both versions run on the same runtime, buffers and communicators.
"""
import importlib.util
import sys
from pathlib import Path


def load_other_version(path):
    """The module in ``path`` (``/tmp/old/bagua_mpi/primitives/lowrank.py``), loaded beside
    this tree's as ``bagua_mpi.primitives.lowrank_baseline``: its package is the run of
    directories above it that hold an ``__init__.py``.

    It is registered in ``sys.modules`` before it runs, since a dataclass defined in it looks
    its module up there."""
    path = Path(path).resolve()
    package = []
    folder = path.parent
    while (folder / "__init__.py").exists():
        package.insert(0, folder.name)
        folder = folder.parent
    if not package:
        raise ValueError(f"{path} is not inside a package (no __init__.py beside it)")
    name = ".".join([*package, f"{path.stem}_baseline"])
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
