"""Checkpoint errors: all are ``BaguaMPIError`` (a ``RuntimeError``), so one ``except`` catches
them; each message names the file (and the rank, where one rank's part is at fault)."""
from __future__ import annotations

from ..exceptions import BaguaMPIError


class CheckpointError(BaguaMPIError):
    """Root of the checkpoint errors (bad arguments to ``save``/``load`` included)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path, or none in the given directory."""


class CheckpointCorruptError(CheckpointError):
    """A file is truncated, was never finished, or fails a checksum (SHA-256 or fletcher32)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"corrupt checkpoint {path}: {reason}")
        self.path = path
        self.reason = reason


class CheckpointFormatError(CheckpointError):
    """A readable file that is not a bagua_mpi checkpoint, or of an unknown format version."""


class CheckpointWriteError(CheckpointError):
    """A save failed on some rank; no new checkpoint was published (the previous one stands)."""


class WorldSizeMismatchError(CheckpointError):
    """The checkpoint holds per-rank state that cannot be mapped onto this job's world size."""
