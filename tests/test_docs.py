"""The documentation does not rot: every code block of README.md and docs/*.md runs, every
relative link resolves, and the site's nav lists every page.

How a fenced block is treated is decided by its language (the info string) and its first line;
docs/index.md, "Code blocks in these pages", says the same for readers:

* ```` ```python ````: written to a file and run with this Python, one process. If its first
  line is ``# mpiexec -n N``, it runs under ``mpiexec -n N`` instead (the mpiexec beside this
  Python, as the multi-rank suites use; ``OMP_NUM_THREADS=1``).
* ```` ```bash ````: run with ``bash -e -o pipefail``, so any failing command fails the test.
  ``python`` and ``mpiexec`` on its PATH are this environment's.
* A ``python`` or ``bash`` block whose first line is ``# not run in tests: <reason>`` is
  collected and reported as skipped with that reason (installs, Slurm submissions, benchmarks
  that take minutes, commands that need root, a GPU or a cluster). The reason must be given.
* ```` ```text ```` blocks (output, pictures) and blocks without a language (the diagrams of
  docs/design.md, the sample output of docs/doctor.md) are not code and are not collected.
  Any other language fails ``test_every_block_has_a_known_language``: a new block has to choose.

Every block is its own test, named by file and line (``docs/training.md:11``). It runs in a
fresh empty directory in which ``examples/``, ``benchmarks/``, ``slurm/`` and ``tests/`` link to
the repository's, so paths read as from the repository root and whatever the block writes is
thrown away. A runnable block may not hold a bare ``...`` line: a placeholder that happens to be
valid Python is still pseudo-code.

The blocks are small on purpose (tiny models, a few steps): the whole file costs about 70
CPU-seconds on 2 cores, so its wall time is about half that when nothing else runs, and grows
with whatever shares the cores. Run it with ``python -m pytest -q tests/test_docs.py``.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpi_harness import REPO, mpiexec_path, run_job

DOC_FILES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
RUN_LANGUAGES = {"python", "bash"}
TEXT_LANGUAGES = {"text", ""}
NOT_RUN = re.compile(r"#\s*not run in tests:\s*(.*)$")
MPIEXEC = re.compile(r"#\s*mpiexec -n (\d+)\b")
LINKED_DIRS = ("examples", "benchmarks", "slurm", "tests")
BLOCK_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    end: int           # 1-based line of the closing fence
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0].strip() if self.code.strip() else ""

    @property
    def skip_reason(self) -> str | None:
        m = NOT_RUN.match(self.first_line)
        return m.group(1).strip() if m else None

    @property
    def ranks(self) -> int | None:
        m = MPIEXEC.match(self.first_line)
        return int(m.group(1)) if m else None


FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        info = m.group("info").strip()
        language = info.split()[0] if info else ""
        body, j = [], i + 1
        while j < len(lines):
            close = FENCE.match(lines[j])
            if (close and close.group("fence")[0] == fence[0]
                    and len(close.group("fence")) >= len(fence)
                    and not close.group("info").strip()):
                break
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        assert j < len(lines), f"{path.name}:{i + 1}: code block never closed"
        blocks.append(Block(path, i + 1, j + 1, language, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for path in DOC_FILES for b in fenced_blocks(path)]
CODE_BLOCKS = [b for b in ALL_BLOCKS if b.language in RUN_LANGUAGES]


def _param(block: Block):
    reason = block.skip_reason
    marks = [pytest.mark.skip(reason=f"{block.name}: {reason}")] if reason else []
    return pytest.param(block, id=block.name, marks=marks)


def _environment() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # several ranks share 2 cores
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("BAGUA_MPI_STALL_ABORT_S", "150")  # a hang ends well before the timeout
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    # `python` and `mpiexec` in a bash block are this environment's (the mpich wheel puts
    # mpiexec beside python)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    for name in LINKED_DIRS:
        (work / name).symlink_to(REPO / name, target_is_directory=True)
    return work


@pytest.mark.parametrize("block", [_param(b) for b in CODE_BLOCKS])
def test_code_block_runs(block: Block, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(_workdir(tmp_path))  # run_job starts the command here
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
        if block.ranks is not None:
            cmd = [mpiexec_path(), "-n", str(block.ranks)] + cmd
    else:
        script = tmp_path / "block.sh"
        script.write_text(block.code)
        cmd = ["bash", "-e", "-o", "pipefail", str(script)]
    result = run_job(cmd, _environment(), BLOCK_TIMEOUT_S)
    state = "timed out" if result.timed_out else f"exit code {result.returncode}"
    assert not result.timed_out and result.returncode == 0, (
        f"{block.name} ({' '.join(cmd[:4])} ...): {state}\n--- block ---\n{block.code}"
        f"--- output ---\n{result.output}")


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in ALL_BLOCKS])
def test_every_block_has_a_known_language(block: Block):
    assert block.language in RUN_LANGUAGES | TEXT_LANGUAGES, (
        f"{block.name}: language {block.language!r}; use python or bash (run, or first line "
        f"'# not run in tests: <reason>') or text (output, not run)")


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in CODE_BLOCKS])
def test_runnable_blocks_are_not_pseudo_code(block: Block):
    if block.skip_reason is not None:
        return
    if NOT_RUN.search(block.code.split("\n", 1)[0]) is None and "not run in tests" in block.code:
        pytest.fail(f"{block.name}: the 'not run in tests' marker must be the first line")
    bare = [n for n, ln in enumerate(block.code.splitlines(), 1)
            if re.fullmatch(r"\s*\.\.\.\s*(#.*)?", ln)]
    assert not bare, f"{block.name}: placeholder '...' on block line(s) {bare}: make it runnable"
    if block.ranks is None and block.language == "python":
        assert not re.match(r"#\s*mpiexec", block.first_line), (
            f"{block.name}: write the marker as '# mpiexec -n N'")


def test_skipped_blocks_give_a_reason():
    empty = [b.name for b in CODE_BLOCKS if b.skip_reason == ""]
    assert not empty, f"'# not run in tests:' without a reason: {empty}"


# -- links ------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _without_blocks(path: Path) -> str:
    """The file with its fenced code blocks blanked out (line numbers kept)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for b in fenced_blocks(path):
        for k in range(b.line - 1, b.end):
            lines[k] = ""
    return "\n".join(lines)


def _prose(path: Path) -> str:
    """The file without code blocks and inline code spans (links there are not links)."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", _without_blocks(path), flags=re.S)


def _github_slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _mkdocs_slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    """Heading anchors that GitHub and MkDocs both give (the link must work in both)."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _without_blocks(path), flags=re.M)
    return {_github_slug(h) for h in headings} & {_mkdocs_slug(h) for h in headings}


def _links():
    for path in DOC_FILES:
        for m in LINK.finditer(_prose(path)):
            target = m.group(1)
            if SCHEME.match(target):
                continue
            yield pytest.param(path, target, id=f"{path.relative_to(REPO)}->{target}")


@pytest.mark.parametrize("path,target", list(_links()))
def test_relative_link_resolves(path: Path, target: str):
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    assert dest.exists(), f"{path.relative_to(REPO)}: link to {target}: no such file {dest}"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), (
            f"{path.relative_to(REPO)}: link to {target}: no heading with that anchor in "
            f"{dest.relative_to(REPO)} (have {sorted(_anchors(dest))})")


# -- the site and the front door --------------------------------------------------------------

def test_mkdocs_nav_lists_every_page():
    config = (REPO / "mkdocs.yml").read_text()
    assert re.search(r"^site_name:\s*\S", config, flags=re.M)
    nav = re.findall(r"^\s+-\s+(?:\"[^\"]*\"|[^:\n]+):\s*(\S+\.md)\s*$", config, flags=re.M)
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert sorted(nav) == pages, f"mkdocs.yml nav {sorted(nav)} against docs/ {pages}"


def test_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 200, "the README is the front door; details go to docs/"
    for command in ('pip install torch==2.13.0 -e ".[mpich,examples]" && OMP_NUM_THREADS=1 '
                    'mpiexec -n 4 '
                    'python examples/train_mlp.py',
                    'pip install torch==2.13.0 -e ".[mpich,test]" && python -m pytest -q -rs'):
        assert command + "\n" in readme, f"the README's set-up command changed: {command}"
        assert command + "\n" in (REPO / "docs" / "index.md").read_text(), (
            f"docs/index.md repeats the README's set-up commands: {command}")
    ci = (REPO / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".[mpich,test]" && python -m pytest -q -rs' in ci


def test_readme_doctor_excerpt_is_copied_from_the_doctor_page():
    doctor = (REPO / "docs" / "doctor.md").read_text().splitlines()
    excerpts = [b for b in fenced_blocks(REPO / "README.md")
                if b.language == "text" and "bagua_mpi doctor" in b.code]
    assert excerpts, "the README shows a doctor excerpt under 'Is my setup right?'"
    for line in excerpts[0].code.splitlines():
        if line.strip() != "...":
            assert line in doctor, f"README doctor excerpt line not in docs/doctor.md: {line!r}"
