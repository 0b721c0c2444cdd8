"""Random number generator states as plain arrays (no pickle), and back.

``capture()`` returns a tree of this process's global generators:

* ``torch``: ``torch.get_rng_state()`` (a uint8 tensor, the CPU Mersenne Twister and its
  Philox offset);
* ``cuda``: ``torch.cuda.get_rng_state_all()``, one uint8 tensor per device, only when CUDA is
  already initialized (capturing must not start CUDA on a CPU job);
* ``numpy``: the legacy global ``np.random`` state: 624 uint32 words, the position and the
  cached Gaussian;
* ``python``: ``random.getstate()``: 625 uint32 words (624 + position) and ``gauss_next``.

``restore(tree)`` sets them back, so the draws after a resume are the draws an uninterrupted run
would have made. Generators the user owns (``torch.Generator``, ``np.random.Generator``) are the
user's to save, e.g. ``extras={"gen": gen.get_state()}`` / ``gen.bit_generator.state``.
"""
from __future__ import annotations

import logging
import random

import numpy as np
import torch

logger = logging.getLogger(__name__)


def capture() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": _python_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    _set_numpy_state(state["numpy"])
    _set_python_state(state["python"])
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            logger.warning("bagua_mpi checkpoint: CUDA RNG states saved but CUDA is not "
                           "available here; not restored")
        elif torch.cuda.device_count() != len(cuda):
            logger.warning("bagua_mpi checkpoint: %d CUDA RNG states saved, %d devices visible; "
                           "not restored", len(cuda), torch.cuda.device_count())
        else:
            torch.cuda.set_rng_state_all(cuda)


def _numpy_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {"kind": kind, "keys": np.asarray(keys, dtype=np.uint32), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_numpy_state(s: dict) -> None:
    np.random.set_state((s["kind"], np.asarray(s["keys"], dtype=np.uint32), int(s["pos"]),
                         int(s["has_gauss"]), float(s["cached_gaussian"])))


def _python_state() -> dict:
    version, words, gauss_next = random.getstate()
    return {"version": version, "words": np.asarray(words, dtype=np.uint32),
            "gauss_next": gauss_next}


def _set_python_state(s: dict) -> None:
    words = tuple(int(w) for w in np.asarray(s["words"]).tolist())
    random.setstate((int(s["version"]), words, s["gauss_next"]))
