"""L-GreCo: layer-wise adaptive gradient compression (arXiv 2210.17357), SPEC §6."""
from .algorithm import LGreCo, LGreCoImpl
from .dp import Solution, solve
from .families import FAMILIES, MinMaxBits, TopKDensity

__all__ = ["FAMILIES", "LGreCo", "LGreCoImpl", "MinMaxBits", "Solution", "TopKDensity", "solve"]
