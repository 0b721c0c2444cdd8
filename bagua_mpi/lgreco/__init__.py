"""L-GreCo: layer-wise adaptive gradient compression (arXiv 2210.17357)."""
from .algorithm import LGreCo, LGreCoImpl
from .dp import Solution, solve
from .families import FAMILIES, MinMaxBits, PowerSGDRank, TopKDensity

__all__ = ["FAMILIES", "LGreCo", "LGreCoImpl", "MinMaxBits", "PowerSGDRank", "Solution",
           "TopKDensity", "solve"]
