"""Communication algorithms, registered by name (see ``base.py`` for the interface)."""
from .base import Algorithm, AlgorithmContext, AlgorithmImpl
from .gradient_allreduce import GradientAllReduce
from .registry import create, names, register

__all__ = ["Algorithm", "AlgorithmContext", "AlgorithmImpl", "GradientAllReduce", "create",
           "names", "register"]
