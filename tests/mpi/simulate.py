"""NumPy simulation of every rank: each rank can build all ranks' inputs from a seed.

The multi-rank suites compare what bagua_mpi returns on this rank with what a plain NumPy
computation over *all* ranks' inputs says it must be.
"""
from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
                "uint8": torch.uint8, "bool": torch.bool}
ALL_DTYPES = tuple(TORCH_DTYPES)
FLOATS = ("float16", "bfloat16", "float32", "float64")


def rank_input(seed: int, rank: int, shape, dtype: str, op: str = "sum") -> torch.Tensor:
    """Rank ``rank``'s input: small values so sums and products never overflow any dtype."""
    rng = np.random.default_rng([seed, rank])
    if dtype == "bool":
        arr = rng.random(shape) < 0.5
    elif dtype in FLOATS:
        lo, hi = (0.5, 1.5) if op == "product" else (-4.0, 4.0)
        arr = rng.uniform(lo, hi, size=shape)
    else:
        lo, hi = (1, 3) if op == "product" else ((0, 50) if dtype == "uint8" else (-50, 50))
        arr = rng.integers(lo, hi + 1, size=shape)
    # Round through the target dtype so every rank's simulated value equals the real input.
    return torch.from_numpy(np.asarray(arr, dtype=np.float64 if dtype in FLOATS else None)
                            ).to(TORCH_DTYPES[dtype])


def as_f64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy() if t.dtype != torch.bool else t.numpy()


def reduce_all(inputs: list, op: str, prescale: float = 1.0, postscale: float = 1.0):
    """Expected allreduce result, computed in float64 (or exactly for ints/bools)."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stack = np.stack([t.numpy() for t in inputs])
        res = {"min": stack.all(0), "product": stack.all(0), "max": stack.any(0)}[op]
        return torch.from_numpy(res)
    stack = np.stack([as_f64(t) for t in inputs]) * prescale
    if op in ("sum", "average"):
        res = stack.sum(0)
    elif op == "min":
        res = stack.min(0)
    elif op == "max":
        res = stack.max(0)
    else:
        res = stack.prod(0)
    if op == "average":
        res = res / len(inputs)
    return torch.from_numpy(res * postscale).to(dtype)


TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Exact for integers and bools; to a relative tolerance of ~1 ulp-ish for floats."""
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    assert tuple(got.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}")
    name = str(got.dtype).replace("torch.", "")
    if name in TOLERANCE:
        torch.testing.assert_close(got.to(torch.float64), expected.to(torch.float64),
                                   rtol=TOLERANCE[name], atol=TOLERANCE[name], msg=what)
    else:
        assert torch.equal(got, expected), f"{what}: {got} != {expected}"


# -- Adasum (Horovod's adaptive summation) -------------------------------------------------------
# The whole vectors, combined as a binary tree over ranks in rank order, in extended precision
# (np.longdouble: a 15-bit exponent, so 1e300**2 neither overflows nor 1e-300**2 underflows).
# No vector halving and no partial sums: independent of how bagua_mpi distributes the work.

def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b; a zero vector's coefficient is 1."""
    dot = np.sum(a * b)
    aa, bb = np.sum(a * a), np.sum(b * b)
    ca = 1 - dot / (2 * aa) if aa != 0 else 1
    cb = 1 - dot / (2 * bb) if bb != 0 else 1
    return ca * a + cb * b


def adasum_tree(vectors: list) -> np.ndarray:
    assert len(vectors) & (len(vectors) - 1) == 0, "Adasum needs a power-of-two rank count"
    while len(vectors) > 1:
        vectors = [adasum_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def adasum_all(inputs: list, prescale: float = 1.0, postscale: float = 1.0) -> np.ndarray:
    """Expected ``allreduce(op=Adasum)`` of every rank's tensor, as float64 (one tensor = one
    vector: grouped allreduces combine each tensor on its own)."""
    vectors = [np.asarray(as_f64(t) if isinstance(t, torch.Tensor) else t,
                          dtype=np.longdouble).reshape(-1) * prescale for t in inputs]
    shape = tuple(inputs[0].shape)
    return (adasum_tree(vectors) * postscale).astype(np.float64).reshape(shape)
