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
from ..lazy_names import lazy_names
from .errors import (CheckpointCorruptError, CheckpointError, CheckpointFormatError,
                     CheckpointNotFoundError, CheckpointWriteError, WorldSizeMismatchError)
from .rotation import latest, list_checkpoints

# Imported on first use, so that ``python -m bagua_mpi.checkpoint`` (``inspection``) never
# imports MPI: ``load`` and ``save`` need it, reading a file does not.
_DEFINED_IN = {"save": ".writer", "scheme": ".writer", "load": ".reader",
               "CheckpointInfo": ".reader", "read_meta": ".inspection", "verify": ".inspection",
               "FORMAT_VERSION": ".format"}

__all__ = ["save", "load", "latest", "list_checkpoints", "verify", "read_meta", "scheme",
           "CheckpointInfo", "FORMAT_VERSION", "CheckpointError", "CheckpointCorruptError",
           "CheckpointFormatError", "CheckpointNotFoundError", "CheckpointWriteError",
           "WorldSizeMismatchError"]

__getattr__, __dir__ = lazy_names(__name__, _DEFINED_IN, globals())
