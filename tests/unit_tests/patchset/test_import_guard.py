"""The two checks that keep a run on the reviewed fork ([Note: the import guard] in the overlay's
``megatron/core/fork_info.py``): ``import megatron.core`` reads the tree's own stamp and nothing outside
``megatron/``; ``ensure_fork`` (hfsdp/patchset/guard.py) holds that stamp to the checkout, for the base the
tree was built from.

The fake checkout of patchset_fake.py (two bases) gets the fork's own fork_info.py as an overlay file and a
patch, in both series, that hooks it into ``megatron/core/__init__.py`` as the fork-identity patch does.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from patchset_fake import ALLOC_PATCH, OTHER, TRAIN_PATCH, Env, patch_text

from hfsdp.patchset.cli import main

REPO = Path(__file__).resolve().parents[3]
FORK_INFO = "megatron/core/fork_info.py"
HOOK = textwrap.dedent(
    """\
    diff --git a/megatron/core/__init__.py b/megatron/core/__init__.py
    --- a/megatron/core/__init__.py
    +++ b/megatron/core/__init__.py
    @@ -1 +1,3 @@
    +from megatron.core.fork_info import verify_tree
    +verify_tree()
     VALUE = 1
    """)

# A fresh Python, the fake checkout first on sys.path and this one after it (for hfsdp): import megatron.core
# (its import check runs), then ensure_fork on the fake checkout. One line for each outcome.
IMPORT_THEN_ENSURE = """
import sys
from pathlib import Path
try:
    import megatron.core
except ImportError as exc:
    print("import:", exc)
    raise SystemExit(0)
print("import: ok", megatron.core.__file__)
from hfsdp.patchset.errors import StaleTree
from hfsdp.patchset.guard import ensure_fork
from hfsdp.patchset.project import Project
try:
    ensure_fork(Project(Path(sys.argv[1])))
except StaleTree as exc:
    print("ensure_fork: StaleTree:", exc.cause, "->", exc.fix)
else:
    print("ensure_fork: ok")
"""

# Imports megatron.core and asks fork_info everything it tells, recording every file and folder opened or
# listed meanwhile (audit events). The standard library fork_info uses, and the namespace package megatron,
# are imported first: finding those is the import system's reading, not the tree's.
AUDITED = """
import json, os, shlex, sys, pathlib
import megatron
seen = []
def record(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        seen.append(os.path.realpath(os.fsdecode(args[0])))
sys.addaudithook(record)
import megatron.core.fork_info as f
facts = [f.fork_version(), f.base_version(), f.local_label(), f.applied_patches()]
f.verify_tree()
print(json.dumps({"facts": facts, "seen": seen}))
"""


def cli(env: Env, *args: str) -> int:
    return main(["--root", str(env.project.root), *args])


def child(env: Env, code: str) -> list[str]:
    """``code`` run with the fake checkout first on sys.path, the import check on; its output lines."""
    root = env.project.root
    environ = {k: v for k, v in os.environ.items() if k != "HFSDP_SKIP_FORK_GUARD"}
    environ["PYTHONPATH"] = f"{root}{os.pathsep}{REPO}"
    proc = subprocess.run([sys.executable, "-c", code, str(root)], cwd=root.parent, capture_output=True, text=True,
                          env=environ, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def outcome(env: Env) -> tuple[str, str]:
    """What ``import megatron.core`` and then ``ensure_fork`` say, in a fresh Python."""
    lines = child(env, IMPORT_THEN_ENSURE)
    if lines[0].startswith("import: ok "):
        where = Path(lines[0].removeprefix("import: ok ")).resolve()
        assert where.parent.parent == env.project.megatron_dir.resolve(), where  # the fake tree, not this checkout's
        return "import: ok", lines[1]
    return lines[0], ""


@pytest.fixture
def guarded(two: Env) -> Env:
    """``two`` with the fork's fork_info.py in its overlay, hooked into megatron.core by guard.patch in both
    bases' series."""
    two.write_overlay({FORK_INFO: (REPO / "patches" / "overlay" / FORK_INFO).read_text()})
    two.write_series({"guard.patch": patch_text("Hook the import check", HOOK),
                      "alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                      "train.patch": patch_text("Fork training", TRAIN_PATCH)})
    (two.project.patches_dir / "bases" / OTHER / "series").write_text("guard.patch\nalloc.patch\ntrain.patch\n")
    return two


def test_a_stale_tree_imports_and_ensure_fork_refuses_it(guarded: Env) -> None:
    """The tree does not read its checkout: after a pull changed a patch it still imports (it is what its
    stamp says), and ensure_fork, which compares the stamp with the checkout, calls it stale."""
    assert cli(guarded, "materialize") == 0
    assert outcome(guarded) == ("import: ok", "ensure_fork: ok")
    alloc = guarded.project.patches_dir / "alloc.patch"
    alloc.write_text(patch_text("Add maxpool flag, described anew", ALLOC_PATCH))
    imported, ensured = outcome(guarded)
    assert imported == "import: ok"
    assert ensured.startswith("ensure_fork: StaleTree: ") and "megatron is stale" in ensured, ensured
    assert "patches/series, patches/base.toml and patches/overlay/" in ensured
    assert "run `scripts/patchset materialize` (or `pip install -e .`)" in ensured
    # A changed overlay file, the guard's own included, is the same: imports, stale for ensure_fork.
    assert cli(guarded, "materialize") == 0 and outcome(guarded) == ("import: ok", "ensure_fork: ok")
    guarded.write_overlay({FORK_INFO: (REPO / "patches" / "overlay" / FORK_INFO).read_text() + "# touched\n"})
    imported, ensured = outcome(guarded)
    assert imported == "import: ok" and ensured.startswith("ensure_fork: StaleTree: "), ensured


def test_a_tree_of_another_base_is_held_to_that_bases_series(guarded: Env) -> None:
    """A tree stamped as built on 0.19.2 is compared with patches/bases/0.19.2/: a change of its series there
    leaves the import as it was and makes ensure_fork refuse it, naming that base's folder and command."""
    assert cli(guarded, "--base", OTHER, "materialize") == 0
    assert outcome(guarded) == ("import: ok", "ensure_fork: ok")  # the tree's base, found from its stamp
    folder = guarded.project.patches_dir / "bases" / OTHER
    (folder / "series").write_text("guard.patch\nalloc.patch\n")  # train.patch dropped on this base
    (folder / "train.patch").unlink()
    imported, ensured = outcome(guarded)
    assert imported == "import: ok"
    assert ensured.startswith("ensure_fork: StaleTree: ") and "megatron is stale" in ensured, ensured
    assert f"patches/bases/{OTHER}/series, patches/bases/{OTHER}/base.toml" in ensured
    assert (f"run `scripts/patchset --base {OTHER} materialize` (or `HFSDP_BASE={OTHER} pip install -e .`); "
            f"`scripts/patchset --base {OTHER} status` says why") in ensured
    assert cli(guarded, "--base", OTHER, "materialize") == 0
    assert outcome(guarded) == ("import: ok", "ensure_fork: ok")


@pytest.mark.parametrize("stamp", [None, "{not json", "[]", '{"base_version": "0.18.2"}'])
def test_an_unstamped_tree_fails_on_import_with_the_way_out(guarded: Env, stamp: str | None) -> None:
    assert cli(guarded, "materialize") == 0
    path = guarded.project.megatron_dir / ".patchset-stamp.json"
    if stamp is None:
        path.unlink()
    else:
        path.write_text(stamp)
    imported, ensured = outcome(guarded)
    assert imported.startswith("import: ") and ensured == "", imported
    why = ("has no .patchset-stamp.json: it was not materialized by the hfsdp tooling" if stamp is None
           else "is not a readable JSON object naming the tree's fork_version")
    assert why in imported, imported
    # The two commands it suggests name this checkout, whose path holds a space, as a shell reads them.
    materialize, install = re.findall(r"`([^`]+)`", imported)[-2:]
    root = guarded.project.root.resolve()
    assert shlex.split(materialize) == [str(root / "scripts" / "patchset"), "materialize"]
    assert shlex.split(install) == ["pip", "install", "-e", str(root)]


def test_the_import_check_reads_nothing_outside_megatron(guarded: Env) -> None:
    """Every file and folder opened or listed while megatron.core imports and fork_info answers lies in the
    tree (the stamp among them); with the checkout's patches/ gone it answers the same."""
    assert cli(guarded, "materialize") == 0
    tree = guarded.project.megatron_dir.resolve()

    def audited() -> dict:
        (line,) = child(guarded, AUDITED)
        return json.loads(line)

    found = audited()
    assert found["facts"] == ["0.18.2+hfsdp.7", "0.18.2", "hfsdp.7", ["guard.patch", "alloc.patch", "train.patch"]]
    assert str(tree / ".patchset-stamp.json") in found["seen"]
    assert [p for p in found["seen"] if not Path(p).is_relative_to(tree)] == []
    (guarded.project.root / "patches").rename(guarded.project.root / "patches.away")
    assert audited()["facts"] == found["facts"]
