"""Algorithms by name: ``DistributedOptimizer(algorithm="qsgd")`` looks them up here."""
from __future__ import annotations

from .base import Algorithm

_REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make an ``Algorithm`` subclass available by its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"algorithm name {cls.name!r} is already taken by "
                         f"{_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(_REGISTRY)


def create(name_or_algorithm, **kwargs) -> Algorithm:
    """An ``Algorithm`` from a registered name (with hyperparameters) or as given."""
    if isinstance(name_or_algorithm, Algorithm):
        if kwargs:
            raise ValueError("hyperparameters go into the Algorithm object itself")
        return name_or_algorithm
    if not isinstance(name_or_algorithm, str):
        raise TypeError(f"algorithm must be a name or an Algorithm, got {name_or_algorithm!r}")
    cls = _REGISTRY.get(name_or_algorithm)
    if cls is None:
        raise ValueError(f"unknown algorithm {name_or_algorithm!r}; valid names: "
                         + ", ".join(names()))
    return cls(**kwargs)
