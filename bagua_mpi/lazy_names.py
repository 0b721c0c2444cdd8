"""Names a module re-exports from other modules, each imported on first use (PEP 562), so that
importing the module itself stays light (``checkpoint``'s command line needs no MPI;
``exceptions`` is imported by the modules that define the errors it re-exports)."""
from __future__ import annotations

import importlib


def lazy_names(package: str, homes: dict[str, str], namespace: dict):
    """``(__getattr__, __dir__)`` for the module ``package`` whose ``namespace`` (its
    ``globals()``) gains each name of ``homes`` (name -> defining module, absolute or relative to
    ``package``) when the name is first read."""
    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
