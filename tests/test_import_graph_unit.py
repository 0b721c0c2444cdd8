"""No import circles among the modules of ``bagua_mpi`` and ``numba_kernels``.

A circle (A imports B, B imports A, directly or through others) makes the import order matter
and forces lazy imports to paper over it; this test keeps the layering honest. It reads the
sources (AST), so every ``import`` counts: at module level, inside functions, under
``TYPE_CHECKING``. Two kinds of edge are left out, since Python runs them before the importing
module anyway: a module importing one of its own parent packages (``from .. import runtime``
touches ``bagua_mpi/__init__.py``), and a package's ``__init__.py`` importing its own
submodules.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bagua_mpi", "numba_kernels")


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file; a package is named by its ``__init__.py``."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported_names(module: str, path: Path, tree: ast.AST) -> set[str]:
    """Every dotted name an import statement of ``module`` may load (modules or not)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb level - 1 packages up from this one
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}".strip(".")
            names.add(base)
            # ``from pkg import name``: name may be a submodule
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _is_package_of(outer: str, inner: str) -> bool:
    return inner.startswith(outer + ".")


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (see the module docstring for what counts)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[module] = {
            target for target in _imported_names(module, path, tree)
            if target in modules and target != module
            and not _is_package_of(target, module)  # its own parent packages
            and not _is_package_of(module, target)  # a package's own submodules
        }
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's
    algorithm, iterative so deep import chains cannot hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:  # every edge of node seen: close it
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    """One import path around the circle, e.g. ``a -> b -> a``."""
    members = set(component)
    path = [component[0]]
    while True:  # follow edges inside the component until a module repeats
        nxt = min(t for t in graph[path[-1]] if t in members)
        if nxt in path:
            return " -> ".join(path[path.index(nxt):] + [nxt])
        path.append(nxt)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package):
    graph = import_graph()
    mine = [c for c in circles(graph) if any(m.split(".")[0] == package for m in c)]
    assert not mine, f"import circles touching {package}:\n" + "\n".join(
        f"  {_describe(graph, c)}   (modules in the circle: {', '.join(c)})" for c in mine)


def _runs_at_import(tree: ast.AST) -> ast.Module:
    """The statements Python runs when it imports the module: not those inside functions, nor
    under ``if TYPE_CHECKING:``."""
    class Prune(ast.NodeTransformer):
        def visit_FunctionDef(self, node):
            return None

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_If(self, node):
            if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                return node.orelse or None
            return self.generic_visit(node)

    return Prune().visit(tree)


def import_time_graph() -> dict[str, set[str]]:
    """Module -> the project modules that importing it runs first: its imports outside functions,
    each with its parent packages (importing ``a.b`` runs ``a/__init__.py`` before ``a.b``)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = _runs_at_import(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        targets = set()
        for name in _imported_names(module, path, tree):
            parts = name.split(".")
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[module] = {
            target for target in targets
            if target in modules and target != module
            and not _is_package_of(target, module) and not _is_package_of(module, target)}
    return graph


def test_no_import_circle_through_a_package_at_import_time():
    """A circle the graph above cannot see: ``p/__init__.py`` imports ``q.x`` while ``q.y``
    imports ``p.z``. Importing ``q.y`` first runs ``p/__init__.py``, which meets ``q`` half
    imported (a ``from q.x import name`` there fails). Here only imports that run when the module
    loads count, since one inside a function runs after both packages are complete."""
    graph = import_time_graph()
    found = circles(graph)
    assert not found, "circles through package __init__ files at import time:\n" + "\n".join(
        f"  {_describe(graph, c)}" for c in found)
    tree = _runs_at_import(ast.parse("import p.a\ndef f():\n    import p.b\n"
                                     "if TYPE_CHECKING:\n    import p.c\n"))
    assert _imported_names("q", Path("q.py"), tree) == {"p.a"}


def test_the_walk_sees_function_level_imports_and_circles():
    """The checker itself: a circle closed only by an import inside a function is found."""
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert circles(graph) == [["p.a", "p.b", "p.c"]]
    assert _describe(graph, ["p.a", "p.b", "p.c"]) == "p.a -> p.b -> p.c -> p.a"
    tree = ast.parse("def f():\n    from .b import g\n")
    assert "p.b" in _imported_names("p.a", Path("p/a.py"), tree)


def test_importing_the_library_leaves_numba_for_first_use():
    """``import bagua_mpi`` (every rank of every job) does not import numba, about 0.3 s of
    each rank's start; the first kernel does. ``numba_kernels`` resolves each public name
    from its submodule on first use: every name of ``__all__`` resolves."""
    import subprocess
    import sys
    code = ("import sys, bagua_mpi, numba_kernels as nk\n"
            "assert 'numba' not in sys.modules, 'numba was imported'\n"
            "assert all(getattr(nk, name) is not None for name in nk.__all__)\n"
            "assert 'numba' in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
