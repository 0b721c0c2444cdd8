"""The CPU twins' on-disk cache follows the whole package's sources, not one file's."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numba_kernels

PACKAGE = Path(numba_kernels.__file__).resolve().parent

# QSGD codes of a ramp, printed by a fresh interpreter that imports the package from argv[1]
CODES = """
import sys
import time
sys.path.insert(0, sys.argv[1])
import numpy as np
import numba_kernels as nk
from numba_kernels._disk_cache import cache_folder
assert nk.__file__.startswith(sys.argv[1]), nk.__file__
p = nk.compress_qsgd(np.linspace(-1, 1, 4096, dtype=np.float32), seed=3)
print(int(np.abs(p.views()["codes"].astype(int)).sum()), cache_folder())
"""


def codes_in_fresh_process(root, env):
    out = subprocess.run([sys.executable, "-c", CODES, str(root)], env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout.split()
    return int(out[0]), out[1]


def test_a_changed_helper_is_compiled_again(tmp_path):
    """A copy of the package compiles the QSGD encoder into its cache; then only the level
    rule (``_chunk_rules.py``, which the encoder in ``qsgd.py`` inlines) changes to give 0.
    The next process must run the new rule. Numba's own cache keys on ``qsgd.py`` alone and
    loaded the old machine code (a stale cache after an upgrade or a ``git pull``)."""
    root = tmp_path / "copy"
    shutil.copytree(PACKAGE, root / "numba_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "user_cache")
    first, folder = codes_in_fresh_process(root, env)
    assert first > 0 and folder.startswith(str(root / "numba_kernels" / "__pycache__")), folder
    assert any(Path(folder).rglob("*.nbi")), "nothing was cached"
    rules = root / "numba_kernels" / "_chunk_rules.py"
    source = rules.read_text()
    marker = "    return -level if v < _ZERO else level\n"
    assert marker in source
    rules.write_text(source.replace(marker, "    return _ZERO * level\n"))
    second, new_folder = codes_in_fresh_process(root, env)
    assert second == 0, "the encoder ran the level rule compiled before the change"
    assert new_folder != folder


def test_the_folder_is_under_numba_cache_dir_when_set(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "shared"))
    out = subprocess.run(
        [sys.executable, "-c", "from numba_kernels._disk_cache import cache_folder, "
         "sources_digest; print(cache_folder(), sources_digest())"],
        env=env, check=True, capture_output=True, text=True, timeout=120).stdout.split()
    assert out[0] == str(tmp_path / "shared" / f"numba-{out[1]}")


def test_folders_of_versions_unused_for_long_are_deleted(tmp_path):
    """Beside this version's folder: another version's folder unused for longer than the
    limit goes; one used within it, other names and plain files stay; this version's stays
    however old its time (it ran now)."""
    from numba_kernels import _disk_cache

    now = 2_000_000_000.0
    limit = _disk_cache.STALE_AFTER_DAYS * 86400

    def folder(name, age):
        path = tmp_path / name
        path.mkdir()
        (path / "f.nbi").write_bytes(b"x")
        os.utime(path, (now - age, now - age))
        return path

    keep = folder("numba-" + "a" * 16, 10 * limit)
    old = folder("numba-" + "0123456789abcdef", limit + 60)
    recent = folder("numba-" + "b" * 16, limit - 60)
    other = folder("numba-not-a-digest", 10 * limit)
    plain = tmp_path / ("numba-" + "c" * 16 + "x")
    plain.write_bytes(b"")
    assert _disk_cache.prune_stale(tmp_path, keep=keep, now=now) == [old]
    assert not old.exists()
    assert keep.exists() and recent.exists() and other.exists() and plain.exists()


def test_picking_a_folder_marks_it_used_and_prunes_beside_it(tmp_path):
    """A fresh process under NUMBA_CACHE_DIR picks this version's folder, last used long ago:
    the folder stays and its time is now; a stale sibling is gone."""
    from numba_kernels._disk_cache import sources_digest

    shared = tmp_path / "shared"
    long_ago = 1_000_000_000
    mine, stale = shared / f"numba-{sources_digest()}", shared / ("numba-" + "d" * 16)
    for folder in (mine, stale):
        folder.mkdir(parents=True)
        os.utime(folder, (long_ago, long_ago))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(shared))
    out = subprocess.run(
        [sys.executable, "-c", "from numba_kernels._disk_cache import cache_folder; "
         "print(cache_folder())"],
        env=env, check=True, capture_output=True, text=True, timeout=120).stdout.split()
    assert out[0] == str(mine)
    assert mine.stat().st_mtime > long_ago + 86400
    assert not stale.exists()


def test_a_folder_picked_within_a_day_is_left_as_it_is(tmp_path):
    """The ranks of a job all start at once: where this version's folder was picked less than a
    day ago, a process neither rewrites its time nor lists the folders beside it (a stale
    sibling stays until a start a day later)."""
    from numba_kernels import _disk_cache

    shared = tmp_path / "shared"
    mine = shared / f"numba-{_disk_cache.sources_digest()}"
    stale = shared / ("numba-" + "e" * 16)
    for folder in (mine, stale):
        folder.mkdir(parents=True)
    hour_ago = time.time() - 3600
    os.utime(mine, (hour_ago, hour_ago))
    os.utime(stale, (1_000_000_000, 1_000_000_000))
    _disk_cache._mark_used(mine, shared, last_used=hour_ago)
    assert mine.stat().st_mtime == hour_ago and stale.exists()
    _disk_cache._mark_used(mine, shared, last_used=time.time() - 2 * 86400)  # a day later
    assert mine.stat().st_mtime > hour_ago and not stale.exists()


def test_the_last_use_is_read_before_the_write_probe(tmp_path, monkeypatch):
    """Where the file system has no unnamed temporary files, the probe of whether the folder can
    be written creates and deletes a named one, which sets the folder's time to now. The last
    use must be read before it, or no process would ever prune."""
    from numba_kernels import _disk_cache

    def probe_with_a_named_file(folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "probe").write_bytes(b"")
        (folder / "probe").unlink()
        return True

    shared = tmp_path / "shared"
    mine = shared / f"numba-{_disk_cache.sources_digest()}"
    stale = shared / ("numba-" + "f" * 16)
    for folder in (mine, stale):
        folder.mkdir(parents=True)
        os.utime(folder, (1_000_000_000, 1_000_000_000))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(shared))
    monkeypatch.setattr(_disk_cache, "_writable", probe_with_a_named_file)
    assert _disk_cache.cache_folder.__wrapped__() == str(mine)
    assert not stale.exists()
