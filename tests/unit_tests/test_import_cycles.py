"""No import cycles among hfsdp's modules, or through the overlay, counting imports inside functions.

A cycle that only an import inside a function keeps from failing at import time still ties two
modules together: neither can be read, tested or moved without the other. The graph is built from
the source with ``ast`` (every ``import`` / ``from ... import`` anywhere in a module, relative
imports resolved); an edge goes to the most specific module of the package an import names.
Package ``__init__`` files are import-free in hfsdp, so the package a module lives in adds no edge.

The overlay (patches/overlay/) is checked as the materialized megatron/ it becomes, with upstream
around it: every import of or into an overlay module counts wherever it stands (only our files and
our hooks write those), upstream's other imports count at module level. Upstream's own imports
inside functions are upstream's business, and often break upstream cycles on purpose.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Callable, Iterator, Mapping
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


# (importer, imported, whether the import runs when the importer is imported) -> counted?
EdgeRule = Callable[[str, str, bool], bool]


def imports_in_functions(tree: ast.AST) -> set[int]:
    """ids of the import nodes that stand inside a function (run when it is called)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def import_graph(package_dir: Path, counts: EdgeRule | None = None) -> Graph:
    """Module -> the modules of the same package it imports, anywhere in its source (``counts``,
    if given, says which of those imports make an edge)."""
    root = package_dir.parent
    modules = {module_name(p, root): p for p in sorted(package_dir.rglob("*.py"))}
    graph: Graph = {}
    for module, path in modules.items():
        targets: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        deferred = imports_in_functions(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported_names(module, path.name == "__init__.py", node):
                    target = owning_module(name, modules)
                    if target is None or target == module:
                        continue
                    if counts is None or counts(module, target, id(node) not in deferred):
                        targets.add(target)
        graph[module] = targets
    return graph


def overlay_rule(overlay: set[str]) -> EdgeRule:
    """Every import of or into an overlay module; other imports only at module level."""
    return lambda importer, imported, eager: eager or importer in overlay or imported in overlay


def overlay_modules(overlay_dir: Path) -> set[str]:
    """The module names the overlay's Python files get once materialized."""
    return {module_name(p, overlay_dir) for p in overlay_dir.rglob("*.py")}


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


# Packages that may not import another, wherever the import stands: the main job shares what it has in
# common with the benchmark through modules of their own (hfsdp/flagsets.py, hfsdp/launch/pretrain.py,
# hfsdp/planner/pools.py), never through the benchmark's internals; the trace readers stand alone.
FORBIDDEN = {"hfsdp.main_job": ("hfsdp.bench",), "hfsdp.trace": ("hfsdp.bench",)}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def forbidden_imports(graph: Graph, forbidden: Mapping[str, tuple[str, ...]]) -> list[str]:
    """``importer -> imported`` for every edge of ``graph`` that ``forbidden`` rules out."""
    return [f"{importer} -> {imported}" for importer, targets in sorted(graph.items())
            for package, banned in forbidden.items() if _within(importer, package)
            for imported in sorted(targets) if any(_within(imported, b) for b in banned)]


def test_the_main_job_and_the_trace_readers_import_nothing_of_the_benchmark() -> None:
    graph = import_graph(REPO_ROOT / "hfsdp")
    assert "hfsdp.planner.pools" in graph["hfsdp.main_job.rehearsal"], "the import graph lost an edge"
    found = forbidden_imports(graph, FORBIDDEN)
    assert not found, "imports of the benchmark's internals (move what both use into a module of its own): " + (
        "; ".join(found))


def test_forbidden_imports_are_found_wherever_they_stand(tmp_path: Path) -> None:
    package = _package(tmp_path, {"__init__.py": "", "job/__init__.py": "", "bench/__init__.py": "",
                                  "bench/run.py": "x = 1\n", "job/a.py": "def f():\n    from pkg.bench.run import x\n",
                                  "job/b.py": "import pkg.bench\n", "shared.py": "from pkg.bench import run\n"})
    assert forbidden_imports(import_graph(package), {"pkg.job": ("pkg.bench",)}) == [
        "pkg.job.a -> pkg.bench.run", "pkg.job.b -> pkg.bench"]


def test_the_overlay_makes_no_import_cycle() -> None:
    overlay = overlay_modules(REPO_ROOT / "patches" / "overlay")
    megatron = REPO_ROOT / "megatron"
    assert overlay, "found no overlay modules"
    assert (megatron / ".patchset-stamp.json").is_file(), (
        f"{megatron} is not materialized; run `scripts/patchset materialize`")
    materialized = {module_name(p, REPO_ROOT) for p in megatron.rglob("*.py")}
    missing = sorted(overlay - materialized)
    assert not missing, f"overlay modules missing from the materialized tree (stale?): {missing}"
    graph = import_graph(megatron, overlay_rule(overlay))
    # The builder sees a hook: ParamAndGradBuffer imports the max-pool allocators.
    pgb = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
    assert "megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.allocator" in graph[pgb], (
        "the import graph lost the max-pool hook's edge")
    found = [c for c in strongly_connected(graph) if overlay & set(c)]
    assert not found, ("import cycles through the overlay (the hook imports the overlay, never the "
                       "other way round): " + "; ".join(" -> ".join(shortest_cycle(graph, c)) for c in found))


@pytest.mark.parametrize("files, overlay, expected", [
    # upstream's own deferred import does not count; one into an overlay module does
    ({"__init__.py": "", "up.py": "import pkg.low\n", "low.py": "def f():\n    import pkg.up\n"}, set(), []),
    ({"__init__.py": "", "up.py": "import pkg.ours\n", "ours.py": "def f():\n    import pkg.up\n"},
     {"pkg.ours"}, ["pkg.ours -> pkg.up -> pkg.ours"]),
    ({"__init__.py": "", "up.py": "def f():\n    from . import ours\n", "ours.py": "import pkg.up\n"},
     {"pkg.ours"}, ["pkg.ours -> pkg.up -> pkg.ours"]),
])
def test_overlay_rule_counts_our_imports_wherever_they_stand(
        tmp_path: Path, files: dict[str, str], overlay: set[str], expected: list[str]) -> None:
    assert cycles(import_graph(_package(tmp_path, files), overlay_rule(overlay))) == expected


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


# [Note: cycles at import time]
# The tests above read imports as ties between modules. What breaks a program is narrower: a
# module that, while it runs, causes an import of itself before it has defined what is asked of
# it ("partially initialized module"). Upstream modules often take an ``except ImportError:``
# fallback then, without a word (Megatron-FSDP's standalone mode). Such a loop only runs through
# imports that execute at import time, and through packages: importing ``a.b.c`` first runs
# ``a/__init__`` and ``a/b/__init__``. The release already has loops of that kind, which it
# survives, so the fork is held to this: no import-time edge the release lacks may close a loop.

def import_time_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: not inside a function, nor
    under ``if TYPE_CHECKING:``."""
    def visit(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    yield from visit(ast.Module(body=[orelse], type_ignores=[]))
            else:
                yield from visit(child)
    yield from visit(tree)


def import_time_graph(package_dir: Path) -> Graph:
    """Module -> the modules of the package that importing it runs: each import-time import's
    module and every package above it (their ``__init__`` runs first), but the module's own
    packages."""
    root = package_dir.parent
    modules = {module_name(p, root): p for p in sorted(package_dir.rglob("*.py"))}
    graph: Graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets: set[str] = set()
        for node in import_time_imports(tree):
            for name in imported_names(module, path.name == "__init__.py", node):
                parts = name.split(".")
                targets.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in modules)
        # Its own packages are already running when a module runs: importing them again runs nothing.
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        graph[module] = targets - ancestors - {module}
    return graph


def path_between(graph: Graph, start: str, goal: str) -> list[str] | None:
    """A shortest path ``[start, ..., goal]`` along the graph's edges, or None."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if v == goal:
            path = [v]
            while (prev := came_from[path[-1]]) is not None:
                path.append(prev)
            return path[::-1]
        for w in sorted(graph.get(v, ())):
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    return None


def new_import_time_loops(fork: Graph, release: Graph) -> list[str]:
    """Each edge the fork adds to the release's graph that closes a loop, as ``a -> b -> ... -> a``."""
    found = []
    for u in sorted(fork):
        for v in sorted(fork[u] - release.get(u, set())):
            back = path_between(fork, v, u)
            if back is not None:
                found.append(" -> ".join([u, *back]))
    return found


@pytest.fixture(scope="module")
def release_graph(pristine_megatron: Path) -> Graph:
    return import_time_graph(pristine_megatron / "megatron")


DDPC = "megatron.core.distributed.distributed_data_parallel_config"
POLICY = "megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy"


def test_the_fork_adds_no_import_time_loop(release_graph: Graph) -> None:
    fork = import_time_graph(REPO_ROOT / "megatron")
    # The reader sees the release's own loops through packages, which the fork must not add to.
    assert "megatron.core" in release_graph["megatron.core.utils"] or any(
        "megatron.core" in targets for targets in release_graph.values()), "package edges are missing"
    found = new_import_time_loops(fork, release_graph)
    assert not found, ("imports the release does not have close a loop at import time (a module would "
                       "meet itself half-initialized; import inside the function that needs it, or move "
                       "the shared piece): " + "; ".join(found))


def test_the_check_finds_the_loop_of_a_config_that_imports_the_policy_at_its_top(release_graph: Graph) -> None:
    """Megatron Core's DDP config importing the double-buffer policy at module level put Megatron-FSDP
    in its standalone mode: the package's ``__init__`` imports ``fully_shard``, which imports the
    half-built config."""
    fork = import_time_graph(REPO_ROOT / "megatron")
    assert POLICY not in fork[DDPC]
    fork[DDPC] = fork[DDPC] | {POLICY, *(POLICY.rsplit(".", i)[0] for i in range(1, 3))}
    found = new_import_time_loops(fork, release_graph)
    assert any(loop.startswith(DDPC + " -> ") and ".megatron_fsdp.fully_shard" in loop for loop in found), found


@pytest.mark.parametrize("files, expected", [
    # a config that imports the rules at its top, through a package whose __init__ imports the config
    ({"__init__.py": "", "cfg.py": "from .sub.rules import r\n", "sub/__init__.py": "from . import user\n",
      "sub/user.py": "from pkg.cfg import C\n", "sub/rules.py": "r = 1\n"},
     ["pkg.cfg -> pkg.sub -> pkg.sub.user -> pkg.cfg"]),
    # the same import inside a function, or only for type checkers, runs later or never
    ({"__init__.py": "", "cfg.py": "def f():\n    from .sub.rules import r\n",
      "sub/__init__.py": "from . import user\n", "sub/user.py": "from pkg.cfg import C\n", "sub/rules.py": "r = 1\n"},
     []),
    ({"__init__.py": "",
      "cfg.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.rules import r\n",
      "sub/__init__.py": "from . import user\n", "sub/user.py": "from pkg.cfg import C\n", "sub/rules.py": "r = 1\n"},
     []),
])
def test_new_import_time_loops_are_found_and_named(tmp_path: Path, files: dict[str, str], expected: list[str]) -> None:
    release = {k: v for k, v in files.items() if k != "cfg.py"} | {"cfg.py": ""}
    release_graph = import_time_graph(_package(tmp_path / "release", release))
    assert new_import_time_loops(import_time_graph(_package(tmp_path / "fork", files)), release_graph) == expected
