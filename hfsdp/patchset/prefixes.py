"""``prefixes``: every prefix of the series builds a tree that imports, and passes its patch's smoke command.

[Note: prefix trees] A series is reviewed, bisected and rebased patch by patch, so every prefix of it
(the overlay plus patches 1..k) should be a working tree, not only the whole series. For each k,
``prefixes`` builds that tree and, in a fresh Python process, imports ``megatron.core`` and
``megatron.training`` from it; with ``--smoke`` the same process then runs patch k's smoke command,
named in its DEP-3 header (``X-Smoke``, below). The first k whose prefix fails while prefix k-1 passes
names patch k as the one that breaks the tree.

Speed (CI runs it for every base): the series is built once, as a queue ([Note: the queue] in
tree.py), from one extracted sdist; ``--jobs`` workers each check out a contiguous run of its
commits into a git work tree of their own, so going from prefix k to k+1 rewrites only the files of
patch k+1 and Python's bytecode caches of the rest stay valid; one process per prefix does both
imports and the smoke. Everything lives in one folder in the system's temporary folder, removed at
the end; the checkout's ``megatron/`` is never read or written.

Each prefix tree is stamped as what it is: its stamp lists patches 1..k, and its fork version carries
``.prefix.<k>`` (``0.18.2+hfsdp.2.prefix.5``). The tree's import check reads that stamp alone, as in any
tree ([Note: the import guard] in the overlay's ``megatron/core/fork_info.py``); ``HFSDP_SKIP_FORK_GUARD``
is cleared for the child, so the check runs.

``X-Smoke`` is one command: ``python -c CODE``, ``python -m MODULE [ARGS...]`` (shell quoting), or a
pytest node id of this checkout's tests (``tests/unit_tests/x/test_y.py::test_z``). ``lint`` checks
its form.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import gitops
from .errors import SeriesError
from .project import Project
from .scan import hash_files
from .series import Patch
from .source import locate_sdist
from .stamp import make_stamp, write_stamp_file
from .tree import build_queue

SMOKE_FIELD = "X-Smoke"
SMOKE_FORMS = ("`python -c CODE`, `python -m MODULE [ARGS]` or a pytest node id of this checkout's tests "
               "(tests/.../test_x.py::test_y)")
PREFIX_TIMEOUT_S = 600  # one prefix's imports and smoke; a hang is a failure, not a stuck CI job
_NODE_ID = re.compile(r"tests/[A-Za-z0-9_./-]+\.py(::\S+)?")

# The child: the prefix tree first on sys.path, the checkout (hfsdp, tests) after it, both imports,
# then the smoke. argv: tree, checkout, kind ("" for none), smoke words.
_DRIVER = r"""
import os, sys
tree, checkout, kind, words = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
sys.path[:0] = [tree]
sys.path.append(checkout)
import megatron.core, megatron.training
where = os.path.realpath(megatron.core.__file__)
if not where.startswith(os.path.realpath(tree) + os.sep):
    sys.exit(f"megatron.core was imported from {where}, not from the prefix tree {tree}")
if kind == "code":
    sys.argv = ["-c"]
    exec(compile(words[0], "<X-Smoke>", "exec"), {"__name__": "__main__"})
elif kind == "module":
    import runpy
    sys.argv = list(words)
    runpy.run_module(words[0], run_name="__main__", alter_sys=True)
elif kind == "pytest":
    import pytest
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", os.path.join(checkout, words[0])]))
"""


@dataclass(frozen=True)
class Smoke:
    """A patch's smoke command (see the note): ``kind`` code/module/pytest and its words."""

    kind: str
    words: tuple[str, ...]


def parse_smoke(value: str) -> Smoke:
    """The smoke command an ``X-Smoke`` value names; ValueError (the reason) for any other form."""
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"its quoting does not parse ({exc})") from None
    if words[:2] == ["python", "-c"] and len(words) == 3:
        return Smoke("code", (words[2],))
    if words[:2] == ["python", "-m"] and len(words) >= 3:
        return Smoke("module", tuple(words[2:]))
    if len(words) == 1 and _NODE_ID.fullmatch(words[0]) and ".." not in words[0]:
        return Smoke("pytest", (words[0],))
    raise ValueError(f"it is none of {SMOKE_FORMS}")


def smoke_of(patch: Patch) -> Smoke | None:
    """``patch``'s smoke command, None without one; a malformed ``X-Smoke`` is refused, naming the patch."""
    value = patch.fields.get(SMOKE_FIELD)
    if value is None:
        return None
    try:
        return parse_smoke(value)
    except ValueError as exc:
        raise SeriesError(f"{patch.name}: {SMOKE_FIELD} {value!r} is not a smoke command: {exc}",
                          f"write it as one of {SMOKE_FORMS}; `scripts/patchset lint` checks every patch's") from None


@dataclass(frozen=True)
class PrefixResult:
    """Prefix ``k`` (patches 1..k): whether it imports (and passes its smoke), and why not."""

    k: int
    patch: str
    ok: bool
    seconds: float
    detail: str = ""  # the last line the child wrote (the exception), for a failure


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def check_prefixes(project: Project, sdist: Path | None = None, smoke: bool = False, jobs: int = 2,
                   log: Callable[[str], None] = print) -> list[PrefixResult]:
    """Build every prefix of the series and run the child on it (see the note); results in series order."""
    pin, patches, overlay = project.pin(), project.series(), project.overlay()
    smokes = [smoke_of(patch) for patch in patches]  # a malformed one is refused before anything is built
    source = locate_sdist(pin, sdist)
    env = {key: value for key, value in os.environ.items() if key != "HFSDP_SKIP_FORK_GUARD"}
    stop = threading.Event()
    running: set[subprocess.Popen[str]] = set()
    lock = threading.Lock()
    adding = threading.Lock()
    results: dict[int, PrefixResult] = {}
    with tempfile.TemporaryDirectory(prefix="patchset-prefixes-") as tmp:
        queue = build_queue(pin, source, patches, Path(tmp) / "queue", overlay)
        workers = max(1, min(jobs, len(patches)))
        size = -(-len(patches) // workers)
        runs = [list(range(1, len(patches) + 1))[i * size:(i + 1) * size] for i in range(workers)]

        def one(tree: Path, k: int) -> PrefixResult:
            name = patches[k - 1].name
            gitops.git(["checkout", "-q", "--detach", queue.commits[k - 1][1]], cwd=tree)
            stamp = make_stamp(pin, patches[:k], overlay, hash_files(tree, pin.members))
            write_stamp_file(tree, dataclasses.replace(stamp, fork_version=f"{pin.fork_version}.prefix.{k}"))
            command = smokes[k - 1] if smoke else None
            argv = [sys.executable, "-c", _DRIVER, str(tree), str(project.root),
                    "" if command is None else command.kind, *(() if command is None else command.words)]
            started = time.monotonic()
            proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            with lock:
                running.add(proc)
            try:
                out, _ = proc.communicate(timeout=PREFIX_TIMEOUT_S)
                detail = "" if proc.returncode == 0 else _last_line(out)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                detail = f"did not finish in {PREFIX_TIMEOUT_S}s"
            finally:
                with lock:
                    running.discard(proc)
            result = PrefixResult(k, name, proc.returncode == 0 and not detail, time.monotonic() - started, detail)
            verdict = "ok" if result.ok else f"FAILS: {result.detail}"
            log(f"  [{k:>3}/{len(patches)}] {name} ({result.seconds:.1f}s): {verdict}")
            return result

        def work(index: int, ks: list[int]) -> None:
            tree = Path(tmp) / f"tree-{index}"
            # One `worktree add` at a time: git reads every work tree's metadata while it makes one, and
            # a half-made one fails it ("failed to read .git/worktrees/tree-1/commondir").
            with adding:
                gitops.git(["worktree", "add", "-q", "--detach", str(tree), queue.commits[ks[0] - 1][1]],
                           cwd=queue.repo)
            for k in ks:
                if stop.is_set():
                    return
                results[k] = one(tree, k)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(work, i, ks) for i, ks in enumerate(runs) if ks]
            try:
                for future in futures:
                    future.result()
            finally:
                stop.set()  # an interrupt or an error: no new child, and the running ones end now
                with lock:
                    for proc in running:
                        proc.kill()
    return [results[k] for k in sorted(results)]


def first_breaking(results: list[PrefixResult]) -> PrefixResult | None:
    """The first failing prefix whose predecessor passes (or the first patch): its patch breaks the tree."""
    passed = {r.k for r in results if r.ok}
    return next((r for r in results if not r.ok and (r.k == 1 or r.k - 1 in passed)), None)
