"""Single-process inspection of a checkpoint file, with no MPI: ``read_meta`` and ``verify``
(what ``python -m bagua_mpi.checkpoint`` runs, and what ``load`` checks each candidate with)."""
from __future__ import annotations

import h5py

from .errors import CheckpointCorruptError, CheckpointFormatError
from .format import (FORMAT_NAME, FORMAT_VERSION, check_seal, open_file, read_all_datasets,
                     read_json)


def read_meta(path: str, *, verify: bool = True) -> dict:
    """``/meta`` of a checkpoint file, after checking its seal (no MPI needed)."""
    check_seal(path, full=verify)
    try:
        with open_file(path, "r") as f:
            meta = read_json(f, "meta")
    except (OSError, KeyError, ValueError) as exc:
        raise CheckpointCorruptError(path, f"cannot read /meta: {exc}") from exc
    _check_format(meta, path)
    return meta


def verify(path: str) -> dict:
    """Check a checkpoint completely: seal, SHA-256, every dataset's fletcher32 sums, and every
    tree's structure.

    Returns ``/meta``; raises ``CheckpointCorruptError`` / ``CheckpointFormatError`` naming the
    file. Needs no MPI: ``python -m bagua_mpi.checkpoint verify ckpt/latest``.
    """
    from .trees import read_tree  # torch: only verify decodes the trees, info and list do not

    meta = read_meta(path, verify=True)
    try:
        with open_file(path, "r") as f:
            read_all_datasets(f, path)
            trees = []
            f.visititems(lambda name, obj: trees.append(obj) if isinstance(obj, h5py.Group)
                         and "tree" in obj else None)
            for group in trees:
                read_tree(group, path)  # structure, sizes, and per-tensor SHA-256 (mpio files)
    except OSError as exc:
        raise CheckpointCorruptError(path, str(exc)) from exc
    return meta


def _check_format(meta, path: str) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointFormatError(f"{path} is not a bagua_mpi checkpoint")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointFormatError(f"{path} has format version {meta['format_version']}; this "
                                    f"bagua_mpi reads up to {FORMAT_VERSION}")
