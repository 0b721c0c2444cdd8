"""Where the CPU twins' compiled code is kept on disk: a folder per version of the sources.

Numba's on-disk cache (``cache=True``) checks a compiled function against its own file only,
but the twins inline helpers from other files of this package (``_scalar``, ``_chunk_rules``,
``_host_chunks``, ``_bits``, ...). After an upgrade or a ``git pull`` that changed only a
helper, the machine code compiled from the old helper would be loaded again, silently: pip
leaves the old cache files behind when it replaces the package, and an editable install keeps
them next to the sources. So the twins are cached in a folder named after the sources:

1. ``sources_digest()``: SHA-256 of every ``.py`` file of the package (its relative path and
   bytes, in sorted order), computed once per process;
2. ``cache_folder()``: ``numba-<digest>`` under ``NUMBA_CACHE_DIR`` when that is set, else
   under the package's ``__pycache__``, else under the user's cache folder
   (``$XDG_CACHE_HOME`` or ``~/.cache``, then ``bagua_mpi``): the first that can be written;
   None if none can (then Numba's own choice stands);
3. ``cached_njit(**options)``: ``numba.njit(cache=True, **options)`` with Numba's cache folder
   set to ``cache_folder()`` while the function is decorated, which is when Numba picks a
   function's folder, and put back right after, so functions of other packages keep theirs.

A process that picks a folder whose modification time is over a day old sets it to now, so the
time says (to within a day) when a version last ran, and then deletes the folders of other
versions beside it (``numba-`` and 16 hex digits) that no process has picked for
``STALE_AFTER_DAYS`` (``prune_stale``): each holds a few MB, and an editable install gets a
new one at every change of the sources. A version still in use keeps its folder, however old,
as long as it starts a process now and then; one that starts none for that long compiles
again when it does.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numba
from numba.core import config

PACKAGE = Path(__file__).resolve().parent
STALE_AFTER_DAYS = 30
_FOLDER_NAME = re.compile(r"numba-[0-9a-f]{16}")


@functools.cache
def sources_digest() -> str:
    """The first 16 hex digits of the SHA-256 of the package's sources."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


@functools.cache
def cache_folder() -> str | None:
    """This version's cache folder (see the module docstring), or None."""
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bagua_mpi"
    bases = ([Path(os.environ["NUMBA_CACHE_DIR"])] if os.environ.get("NUMBA_CACHE_DIR")
             else [PACKAGE / "__pycache__", user_cache])
    for base in bases:
        folder = base / f"numba-{sources_digest()}"
        last_used = _modified(folder)  # before the probe below, whose file may change it
        if _writable(folder):
            _mark_used(folder, base, last_used)
            return str(folder)
    return None


def _modified(path: Path) -> float:
    """The path's modification time; 0 where it does not exist (yet)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _mark_used(folder: Path, base: Path, last_used: float) -> None:
    """Set the folder's time to now and prune beside it, where it was last used over a day ago
    (a new folder too): the ranks of a large job all start at once on a shared file system,
    and a metadata write and a listing from each, every start, would cost more than what they
    keep exact."""
    now = time.time()
    if last_used > now - 86400:
        return
    try:
        os.utime(folder)
    except OSError:  # refused: at most a recompile after another version prunes the folder
        return
    prune_stale(base, keep=folder, now=now)


def prune_stale(base: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Delete the version folders in ``base`` other than ``keep`` whose modification time is
    more than ``STALE_AFTER_DAYS`` before ``now``; returns them. Another process deleting
    the same folder at the same time, or a file that cannot be removed, is not an error: what
    is left goes next time."""
    cutoff = (time.time() if now is None else now) - STALE_AFTER_DAYS * 86400
    stale = []
    try:
        entries = list(base.iterdir())
    except OSError:  # not listable: nothing to prune
        return stale
    for folder in entries:
        try:
            if (folder != keep and _FOLDER_NAME.fullmatch(folder.name) and folder.is_dir()
                    and folder.stat().st_mtime < cutoff):
                shutil.rmtree(folder, ignore_errors=True)
                stale.append(folder)
        except OSError:  # gone meanwhile
            continue
    return stale


def cached_njit(**options):
    """``numba.njit(cache=True, **options)``, cached in this version's folder."""
    def decorate(function):
        folder = cache_folder()
        before = config.CACHE_DIR
        if folder is not None:
            config.CACHE_DIR = folder
        try:
            return numba.njit(cache=True, **options)(function)
        finally:
            config.CACHE_DIR = before
    return decorate
