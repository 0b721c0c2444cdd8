"""L-GreCo: layer-wise adaptive gradient compression (arXiv 2210.17357).

This package holds the dynamic programme (``dp``) and the compressor families it chooses levels
in (``families``). The algorithm itself, ``LGreCo`` (registered as ``lgreco``), is in
``bagua_mpi.algorithms`` with the others; ``bagua_mpi.lgreco.LGreCo`` still finds it, imported
on first use because the algorithms package imports this one.
"""
from .dp import Solution, solve
from .families import FAMILIES, MinMaxBits, PowerSGDRank, TopKDensity

__all__ = ["FAMILIES", "LGreCo", "LGreCoImpl", "MinMaxBits", "PowerSGDRank", "Solution",
           "TopKDensity", "solve"]


def __getattr__(name: str):
    if name in ("LGreCo", "LGreCoImpl"):
        from ..algorithms import lgreco
        return getattr(lgreco, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
