"""HDF5 checkpoints of the whole training state, safe against crashes and pre-emption.

    import bagua_mpi.checkpoint as ckpt
    start = 0
    if ckpt.latest("ckpt") is not None:                       # resume if there is something
        start = ckpt.load("ckpt", model=model, optimizer=opt).step   # collective
    for step in range(start, steps):
        ...                                                   # one optimizer step
        if (step + 1) % 100 == 0:                             # step = steps completed
            ckpt.save("ckpt", model=model, optimizer=opt, step=step + 1, keep=3)  # collective

One file per checkpoint (``format``): the model, the optimizer (all state tensors and
param_groups), every rank's algorithm state (``DistributedOptimizer.algorithm_state_dict``),
every rank's RNG states, step/epoch and user extras; replicated state once, per-rank state in
``/ranks/<r>``. Files are written under a temporary name and published atomically with a
``latest`` pointer (``rotation``); SHA-256 and fletcher32 checksums are verified on load, which
can fall back to the previous checkpoint. ``writer`` explains the two write schemes (parallel
HDF5, or token passing with serial h5py).
"""
from .errors import (CheckpointCorruptError, CheckpointError, CheckpointFormatError,
                     CheckpointNotFoundError, CheckpointWriteError, WorldSizeMismatchError)
from .format import FORMAT_VERSION
from .reader import CheckpointInfo, load, read_meta, verify
from .rotation import latest, list_checkpoints
from .writer import save, scheme

__all__ = ["save", "load", "latest", "list_checkpoints", "verify", "read_meta", "scheme",
           "CheckpointInfo", "FORMAT_VERSION", "CheckpointError", "CheckpointCorruptError",
           "CheckpointFormatError", "CheckpointNotFoundError", "CheckpointWriteError",
           "WorldSizeMismatchError"]
