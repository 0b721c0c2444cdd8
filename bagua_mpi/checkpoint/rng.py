"""Random number generator states as plain arrays (no pickle), and back.

``capture()`` returns a tree of this process's global generators:

* ``torch``: ``torch.get_rng_state()`` (a uint8 tensor, the CPU Mersenne Twister and its
  Philox offset);
* ``cuda``: ``torch.cuda.get_rng_state_all()``, one uint8 tensor per visible device, and
  ``cuda_current``: the current device's index and state (the GPU a rank trains on), only
  when CUDA is already initialized (capturing must not start CUDA on a CPU job);
* ``numpy``: the legacy global ``np.random`` state: 624 uint32 words, the position and the
  cached Gaussian;
* ``python``: ``random.getstate()``: 625 uint32 words (624 + position) and ``gauss_next``.

``restore(tree)`` sets them back, so the draws after a resume are the draws an uninterrupted run
would have made. Where the GPUs changed (another number visible, or the rank on another one:
an all-visible launch resumed under ``slurm/bind_gpu.sh``), the current device's generator
continues the saved current device's, the one a rank with one GPU draws from; restoring by
index would give it another device's state, never advanced. Generators the user owns
(``torch.Generator``, ``np.random.Generator``) are the user's to save, e.g.
``extras={"gen": gen.get_state()}`` / ``gen.bit_generator.state``.
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
        current = torch.cuda.current_device()
        state["cuda_current"] = {"index": current, "state": torch.cuda.get_rng_state(current)}
    return state


def restore(state: dict) -> bool:
    """Set the generators back; True when the draws go on as they would have, False where
    the CUDA generators could not be (logged: no CUDA here, or the GPUs changed and the tree
    predates ``cuda_current``)."""
    torch.set_rng_state(state["torch"])
    _set_numpy_state(state["numpy"])
    _set_python_state(state["python"])
    cuda, current = state.get("cuda"), state.get("cuda_current")
    if not cuda:
        return True
    if not torch.cuda.is_available():
        logger.warning("bagua_mpi checkpoint: CUDA RNG states saved but CUDA is not "
                       "available here; not restored")
        return False
    here, count = torch.cuda.current_device(), torch.cuda.device_count()
    if count == len(cuda) and (current is None or int(current["index"]) == here):
        torch.cuda.set_rng_state_all(cuda)   # the same GPUs: every generator by its index
        return True
    if current is None:
        logger.warning("bagua_mpi checkpoint: %d CUDA RNG states saved, %d devices visible; "
                       "not restored", len(cuda), count)
        return False
    torch.cuda.set_rng_state(current["state"], here)
    logger.info("bagua_mpi checkpoint: saved with %d GPUs visible and cuda:%d current, resumed "
                "with %d and cuda:%d: cuda:%d's generator continues the saved cuda:%d's, the "
                "others start afresh", len(cuda), int(current["index"]), count, here, here,
                int(current["index"]))
    return True


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
