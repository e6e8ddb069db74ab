"""No import cycles among hfsdp's modules, counting imports inside functions.

A cycle that only an import inside a function keeps from failing at import time still ties two
modules together: neither can be read, tested or moved without the other. The graph is built from
the source with ``ast`` (every ``import`` / ``from ... import`` anywhere in a module, relative
imports resolved); an edge goes to the most specific hfsdp module an import names. Package
``__init__`` files are import-free here, so the package a module lives in adds no edge.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    """``root/a/b.py`` -> ``a.b``; ``root/a/__init__.py`` -> ``a``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The dotted names ``node`` imports, relative ones made absolute (``from X import y``
    yields ``X.y``, which is a module or a name inside ``X``)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    yield from (f"{base}.{alias.name}" for alias in node.names)


def owning_module(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``, or None."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def import_graph(package_dir: Path) -> Graph:
    """Module -> the modules of the same package it imports, anywhere in its source."""
    root = package_dir.parent
    modules = {module_name(p, root): p for p in sorted(package_dir.rglob("*.py"))}
    graph: Graph = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported_names(module, path.name == "__init__.py", node):
                    target = owning_module(name, modules)
                    if target is not None and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components of more than one module, each sorted, in order of their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module: ``[a, b, ..., a]``."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{component} is not strongly connected")


def cycles(graph: Graph) -> list[str]:
    """One named cycle per strongly connected component, e.g. ``a -> b -> a``."""
    return [" -> ".join(shortest_cycle(graph, c)) for c in strongly_connected(graph)]


def test_hfsdp_has_no_import_cycles() -> None:
    graph = import_graph(REPO_ROOT / "hfsdp")
    # The builder sees imports inside functions (entry.py imports its helpers at call time).
    assert "hfsdp.training.requirements" in graph["hfsdp.training.entry"], "the import graph lost an edge"
    found = cycles(graph)
    assert not found, ("import cycles (move the shared piece into the module that owns it): "
                       + "; ".join(found))


def _package(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("files, expected", [
    ({"__init__.py": "", "a.py": "from pkg import b\n", "b.py": "def f():\n    from .a import x\n"},
     ["pkg.a -> pkg.b -> pkg.a"]),
    ({"__init__.py": "", "sub/__init__.py": "", "sub/a.py": "from .. import c\n",
      "c.py": "import pkg.d as d\n", "d.py": "def f():\n    from .sub.a import g\n"},
     ["pkg.c -> pkg.d -> pkg.sub.a -> pkg.c"]),
    ({"__init__.py": "", "a.py": "from . import b\n", "b.py": "import os\nfrom pkg.c import y\n",
      "c.py": "x = 1\n"}, []),
])
def test_cycles_are_found_and_named(tmp_path: Path, files: dict[str, str], expected: list[str]) -> None:
    assert cycles(import_graph(_package(tmp_path, files))) == expected
