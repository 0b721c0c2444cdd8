"""Checkpoint directories: names, atomic publication, the ``latest`` pointer, keep-last-N.

A directory holds ``ckpt-<step:010d>.h5`` files, a ``latest`` pointer (a one-line text file
naming one of them) and, only while a save runs or after one was killed, hidden temporaries
``.ckpt-<step>.h5.tmp-<id>``. A save publishes in this order, each step atomic:

1. the file is written and sealed under its temporary name, flushed and fsync'ed;
2. ``os.replace(temporary, final)``, then the directory is fsync'ed (the rename is durable);
3. the pointer is written to ``.latest.tmp-<id>``, fsync'ed, ``os.replace``'d onto ``latest``,
   and the directory fsync'ed again;
4. old checkpoints beyond the newest ``keep`` are deleted (never the one ``latest`` names).

A ``kill -9`` between any two of these leaves either the previous state (the temporary is
junk that the next save deletes) or a complete new file that ``latest`` does not name yet;
``latest`` always names a complete file. No locks are taken, so this works on shared
filesystems where ``flock`` is unavailable; ``os.replace`` within one directory is atomic on
POSIX filesystems and on NFS, Lustre and GPFS. One job per directory.
"""
from __future__ import annotations

import logging
import os
import re
import uuid

from .errors import CheckpointNotFoundError

logger = logging.getLogger(__name__)

LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{10,})\.h5$")
_TEMP = re.compile(r"^\.(ckpt-\d+\.h5|latest)\.tmp-[0-9a-f]+$")


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:010d}.h5"


def step_of(name: str) -> int | None:
    m = _NAME.match(os.path.basename(name))
    return int(m.group(1)) if m else None


def temporary_name(final_name: str) -> str:
    return f".{final_name}.tmp-{uuid.uuid4().hex[:12]}"


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make renames in ``directory`` durable (some filesystems refuse; that is not fatal)."""
    try:
        fsync_path(directory)
    except OSError as exc:  # e.g. EINVAL on filesystems without directory fsync
        logger.debug("fsync of directory %s failed: %s", directory, exc)


def publish(temporary: str, final: str) -> None:
    """Atomically make the (fsync'ed) ``temporary`` visible as ``final``."""
    os.replace(temporary, final)
    fsync_dir(os.path.dirname(final) or ".")


def write_latest(directory: str, name: str) -> None:
    """Atomically point ``directory/latest`` at checkpoint file ``name``."""
    tmp = os.path.join(directory, temporary_name(LATEST))
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, os.path.join(directory, LATEST))


def read_latest(directory: str) -> str | None:
    """The file name ``latest`` points to, or None without a pointer."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    if step_of(name) is None or os.path.basename(name) != name:
        logger.warning("bagua_mpi checkpoint: ignoring malformed pointer %s/latest (%r)",
                       directory, name[:100])
        return None
    return name


def list_checkpoints(directory: str) -> list[str]:
    """Paths of the checkpoint files in ``directory``, newest step first (unverified)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = sorted(((step_of(n), n) for n in names if step_of(n) is not None), reverse=True)
    return [os.path.join(directory, n) for _, n in found]


def latest(directory: str) -> str | None:
    """Path of the checkpoint ``directory/latest`` names; without a pointer, the newest file.

    Does not verify the file (``load`` does, and falls back); None if there is no checkpoint.
    """
    name = read_latest(directory)
    if name is not None and os.path.exists(os.path.join(directory, name)):
        return os.path.join(directory, name)
    files = list_checkpoints(directory)
    return files[0] if files else None


def candidates(path: str, fallback: bool) -> list[str]:
    """Files to try, in order, for ``load(path)``.

    A directory: the file ``latest`` names, then (with ``fallback``) the older ones, newest
    first. Files with a higher step than ``latest`` are an interrupted save or an abandoned
    timeline, and are not used. A file: that file, then (with ``fallback``) the older ones in its
    directory.
    """
    if os.path.isdir(path):
        directory = path
        name = read_latest(directory)
        files = list_checkpoints(directory)
        if name is not None and os.path.join(directory, name) in files:
            first = os.path.join(directory, name)
        elif files:
            first = files[0]
        else:
            raise CheckpointNotFoundError(f"no checkpoint in {directory}")
    elif os.path.isfile(path):
        first = path
        directory = os.path.dirname(path) or "."
        files = list_checkpoints(directory) if step_of(path) is not None else []
    else:
        raise CheckpointNotFoundError(f"no checkpoint file or directory at {path}")
    if not fallback:
        return [first]
    limit = step_of(first)
    older = [f for f in files if limit is not None and step_of(f) < limit]
    return [first] + older


def remove_stale_temporaries(directory: str) -> list[str]:
    """Delete temporaries left by killed saves (one job per directory is assumed)."""
    removed = []
    for name in os.listdir(directory):
        if _TEMP.match(name):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    if removed:
        logger.info("bagua_mpi checkpoint: removed %d temporaries of interrupted saves in %s",
                    len(removed), directory)
    return removed


def prune(directory: str, current: str, keep: int | None) -> list[str]:
    """Keep the newest ``keep`` checkpoints up to ``current``; delete older ones and any with a
    higher step than ``current`` (left by an abandoned timeline). Returns what was deleted."""
    current_step = step_of(current)
    removed = []
    kept = 0
    for path in list_checkpoints(directory):
        step = step_of(path)
        if os.path.basename(path) == os.path.basename(current):
            kept += 1
            continue
        if step > current_step or (keep is not None and kept >= keep):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        else:
            kept += 1
    return removed
