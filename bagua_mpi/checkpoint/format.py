"""The checkpoint file format: layout, version and the seal.

One HDF5 file per checkpoint, no pickle anywhere::

    [user block, 512 bytes]  "BAGUA_MPI_CHECKPOINT" / format_version / sha256 / size  (the seal)
    /                        attrs mirror /meta for h5dump/h5ls (informational only)
    /meta                    uint8 JSON: format, version, step, epoch, world_size, write_scheme,
                             which trees are replicated, the algorithm config, versions
    /model  /optimizer  /extras          replicated trees (written once, by rank 0)
    /ranks/<r>/meta                      uint8 JSON: this rank's contents
    /ranks/<r>/rng  /algorithm  /rank_extras   per-rank trees (plus /model, /optimizer when
                                               the ranks' copies differ: decentralized training)

A *tree* is nested state (a ``state_dict``, an optimizer's state, user extras): a group holding
``tree``, the structure as uint8 JSON with every tensor replaced by a placeholder, and one
dataset per tensor (``000000``, ``000001``, ... with attrs ``path``, ``torch_dtype``, ``shape``
for people reading the file). The JSON placeholder, not the attrs, is what the reader trusts.
``trees`` encodes and decodes them; this module holds what needs no torch (and what
``python -m bagua_mpi.checkpoint info`` and ``list`` use).

Integrity, two layers: every dataset (tensors and JSON alike) is chunked with ``fletcher32``, so
HDF5 verifies each chunk as it is read; and the seal in the user block (bytes HDF5 ignores)
holds the SHA-256 of every byte after it and the file size, written last. A flipped byte
anywhere, a truncation or a file whose save never finished is caught by the seal; the
fletcher32 sums also locate the damage. ``libver=("v108", "v110")`` gives checksummed HDF5
metadata and files that HDF5 1.10 and newer read. Files written through parallel HDF5 (the
``mpio`` scheme) keep tensors in contiguous datasets, because filters would force a collective
call per dataset; there each placeholder carries its tensor's SHA-256 instead, verified on read.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator

import h5py
import numpy as np

from .errors import CheckpointCorruptError, CheckpointFormatError

FORMAT_NAME = "bagua_mpi.checkpoint"
FORMAT_VERSION = 1
USERBLOCK_SIZE = 512  # HDF5 needs a power of two >= 512
MAGIC = b"BAGUA_MPI_CHECKPOINT\n"
LIBVER = ("v108", "v110")  # checksummed metadata; readable by HDF5 >= 1.10
_HASH_CHUNK = 16 << 20


# -- HDF5 groups ---------------------------------------------------------------------------------

def open_file(path: str, mode: str, **kwargs) -> h5py.File:
    """``h5py.File`` without HDF5 file locks: the save protocol already gives exclusive access,
    and ``flock`` fails on many shared filesystems (the same as ``HDF5_USE_FILE_LOCKING=FALSE``)."""
    return h5py.File(path, mode, locking=False, **kwargs)


def json_bytes(obj) -> bytes:
    return json.dumps(obj, allow_nan=True, separators=(",", ":")).encode()


def write_json(group, name: str, obj) -> None:
    data = np.frombuffer(json_bytes(obj), dtype=np.uint8)
    group.create_dataset(name, data=data, chunks=True, fletcher32=True)


def read_json(group, name: str):
    return json.loads(bytes(group[name][()]).decode())


def array_digest(arr: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(arr)).cast("B")).hexdigest()


def with_digests(skeleton, arrays: list[np.ndarray]):
    """A copy of ``skeleton`` whose placeholders also carry their array's SHA-256 (the layout
    of unfiltered datasets, see ``mpio``); ``read_tree`` verifies them."""
    copy = json.loads(json_bytes(skeleton))
    for node, arr in zip(leaf_nodes(copy), arrays):
        node["sha256"] = array_digest(arr)
    return copy


def leaf_name(index: int) -> str:
    return f"{index:06d}"


def leaf_nodes(skeleton) -> Iterator[dict]:
    """Placeholders of a skeleton, in index order (the order ``encode_tree`` assigned)."""
    found = []

    def walk(node):
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            for key in ("__tensor__", "__ndarray__"):
                if key in node:
                    if node[key] >= 0:
                        found.append(node)
                    return
            for v in node.values():
                walk(v)

    walk(skeleton)
    return iter(found)


def read_all_datasets(f, file_path: str) -> int:
    """Read every dataset (each chunk's fletcher32 verified); returns how many were read."""
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if hasattr(obj, "dtype") else None)
    for name in names:
        try:
            f[name][()]
        except (OSError, ValueError) as exc:
            raise CheckpointCorruptError(file_path, f"dataset /{name}: {exc}") from exc
    return len(names)


# -- the seal: SHA-256 of everything after the user block ----------------------------------------

def header_bytes(digest_hex: str, size: int) -> bytes:
    text = MAGIC + (f"format_version {FORMAT_VERSION}\nsha256 {digest_hex}\nsize {size}\n"
                    "the sha256 covers bytes 512..size-1 (tail -c +513 FILE | sha256sum)\n"
                    ).encode()
    return text.ljust(USERBLOCK_SIZE, b"\0")


def digest_after_header(fd: int, size: int) -> str:
    h = hashlib.sha256()
    offset = USERBLOCK_SIZE
    while offset < size:
        chunk = os.pread(fd, min(_HASH_CHUNK, size - offset), offset)
        if not chunk:
            break
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


def seal(path: str) -> str:
    """Write the header into the user block of the finished file, fsync; return the digest."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        digest = digest_after_header(fd, size)
        os.pwrite(fd, header_bytes(digest, size), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest


def parse_header(raw: bytes, path: str) -> dict:
    if len(raw) < USERBLOCK_SIZE:
        raise CheckpointCorruptError(path, f"only {len(raw)} bytes, shorter than the header")
    if not raw.startswith(MAGIC):
        if raw.strip(b"\0") == b"":
            raise CheckpointCorruptError(path, "the header is empty: the save that wrote this "
                                         "file never finished")
        raise CheckpointCorruptError(path, f"no {MAGIC.strip().decode()} header (not a "
                                     "bagua_mpi checkpoint, or its first bytes are damaged)")
    text, _, padding = raw.partition(b"\0")
    if padding.strip(b"\0"):
        raise CheckpointCorruptError(path, "non-zero bytes in the header's padding")
    fields = {}
    for line in text.decode(errors="replace").splitlines()[1:]:
        key, _, value = line.partition(" ")
        fields[key] = value
    try:
        version = int(fields["format_version"])
        digest = fields["sha256"]
        size = int(fields["size"])
    except (KeyError, ValueError):
        raise CheckpointCorruptError(path, f"unreadable header {text[:200]!r}") from None
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise CheckpointCorruptError(path, f"malformed digest in the header: {digest!r}")
    if version == FORMAT_VERSION and raw[:USERBLOCK_SIZE] != header_bytes(digest, size):
        raise CheckpointCorruptError(path, "the header is damaged")
    return {"format_version": version, "sha256": digest, "size": size}


def check_seal(path: str, full: bool = True) -> dict:
    """Verify the header, the size and (``full``) the SHA-256 of ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CheckpointCorruptError(path, f"cannot open: {exc}") from exc
    try:
        header = parse_header(os.pread(fd, USERBLOCK_SIZE, 0), path)
        if header["format_version"] > FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{path} has format version {header['format_version']}; this bagua_mpi reads "
                f"up to {FORMAT_VERSION} (upgrade bagua_mpi)")
        actual = os.fstat(fd).st_size
        if actual != header["size"]:
            raise CheckpointCorruptError(path, f"{actual} bytes on disk, the header says "
                                         f"{header['size']} (truncated or appended to)")
        if full:
            digest = digest_after_header(fd, actual)
            if digest != header["sha256"]:
                raise CheckpointCorruptError(path, f"SHA-256 mismatch: content {digest[:16]}..., "
                                             f"header {header['sha256'][:16]}...")
    finally:
        os.close(fd)
    return header
