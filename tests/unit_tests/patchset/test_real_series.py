"""The project's own series: lint-clean, applies, materialized tree is current and importable."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp.patchset.check import check_base
from hfsdp.patchset.errors import PatchsetError
from hfsdp.patchset.guard import ensure_fork
from hfsdp.patchset.lint import lint
from hfsdp.patchset.materialize import tree_status
from hfsdp.patchset.project import Project
from hfsdp.patchset.stamp import read_stamp

PROJECT = Project.default().with_base(None)  # HFSDP_BASE chooses the base, as at install ([Note: bases] in project.py)


def test_series_lints_clean_and_applies_without_fuzz() -> None:
    assert [str(p) for p in lint(PROJECT)] == []
    assert check_base(PROJECT) == len(PROJECT.series()) > 0


def test_materialized_tree_is_current() -> None:
    st = tree_status(PROJECT)
    assert st.exists and st.stamped, "run `scripts/patchset materialize` (pip install -e . does it)"
    assert st.up_to_date, f"stale tree: {st}"
    assert ensure_fork(PROJECT) == PROJECT.megatron_dir


def test_import_from_unrelated_directory_uses_the_fork(tmp_path: Path) -> None:
    code = (
        "import megatron.core, megatron.training, megatron.core.fork_info as f; "
        "print(megatron.core.__file__); print(megatron.training.__file__); "
        "print(megatron.core.__version__); print(','.join(f.applied_patches()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    core, training, version, patches = proc.stdout.strip().splitlines()[-4:]
    assert Path(core).resolve().is_relative_to(PROJECT.megatron_dir.resolve())
    assert Path(training).resolve().is_relative_to(PROJECT.megatron_dir.resolve())
    assert version == PROJECT.pin().fork_version
    assert patches.split(",") == [p.name for p in PROJECT.series()]


# Loads the tree's fork_info by path (running megatron/core/__init__ would need torch) with the tooling
# unimportable, and runs its import check: "ok" or the check's error.
GUARD_ONLY = """
import importlib.abc, importlib.util, sys
class NoTooling(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hfsdp" or name.startswith("hfsdp."):
            raise ImportError("the product imported the tooling: " + name)
sys.meta_path.insert(0, NoTooling())
spec = importlib.util.spec_from_file_location("fork_info", sys.argv[1])
guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard)
try:
    guard.verify_tree()
except guard.ForkTreeError as exc:
    print(exc)
else:
    print("ok")
"""


def test_the_import_check_reads_the_trees_stamp_alone(tmp_path: Path) -> None:
    """The tree's import check needs neither the tooling nor its checkout: a copy of the checkout without
    hfsdp/ passes; it passes the same once the copy's series and overlay changed, and with its patches/ gone
    (whether the tree is current is ensure_fork's question: test_import_guard.py); without its stamp it fails,
    naming the way out for this checkout."""
    copy = tmp_path / "checkout with space"
    shutil.copytree(PROJECT.root, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.so", "tests", "hfsdp", "out"))
    module = copy / "megatron" / "core" / "fork_info.py"

    def guard() -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HFSDP_SKIP_FORK_GUARD")}
        proc = subprocess.run([sys.executable, "-S", "-c", GUARD_ONLY, str(module)], cwd=tmp_path,
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip()

    assert guard() == "ok"
    overlay_file = copy / "patches" / "overlay" / "megatron" / "core" / "fork_info.py"
    overlay_file.write_text(overlay_file.read_text() + "# touched\n")
    patch = copy / "patches" / PROJECT.series()[0].name
    patch.write_text(patch.read_text().replace("Last-Update:", "X-Note: touched\nLast-Update:", 1))
    assert guard() == "ok"
    shutil.rmtree(copy / "patches")
    assert guard() == "ok"
    (copy / "megatron" / ".patchset-stamp.json").unlink()
    unstamped = guard()
    assert "has no .patchset-stamp.json: it was not materialized by the hfsdp tooling" in unstamped, unstamped
    # The two commands it suggests name this checkout, whose path holds a space, as a shell reads them.
    materialize, install = re.findall(r"`([^`]+)`", unstamped)[-2:]
    assert shlex.split(materialize) == [str(copy / "scripts" / "patchset"), "materialize"]
    assert shlex.split(install) == ["pip", "install", "-e", str(copy)]


def test_guard_rejects_megatron_resolving_elsewhere(tmp_path: Path) -> None:
    # In this process megatron.core is the real checkout's; for any other checkout it is foreign.
    copy = tmp_path / "other"
    shutil.copytree(PROJECT.root / "patches", copy / "patches")
    with pytest.raises(PatchsetError, match="not this fork's materialized tree") as info:
        ensure_fork(Project(copy))
    assert "pip uninstall -y megatron-core" in info.value.fix


def test_fork_info_names_what_the_stamp_says() -> None:
    import megatron.core.fork_info as fork_info

    stamp = read_stamp(PROJECT.root)
    assert stamp is not None
    assert (fork_info.fork_version(), fork_info.base_version()) == (stamp.fork_version, stamp.base_version)
    assert fork_info.local_label() == stamp.fork_version.partition("+")[2]
    assert fork_info.applied_patches() == [name for name, _ in stamp.patches]


@pytest.mark.parametrize("text", ["[]", "null", '"x"', "{not json", "{}", '{"fork_version": ""}',
                                  '{"fork_version": 2, "patches": {}}'])
def test_fork_info_reads_a_wrong_shaped_stamp_as_unstamped(tmp_path: Path, monkeypatch, text: str) -> None:
    """A stamp that is not a JSON object naming a fork version makes an unstamped tree: its versions say so
    (naming no release), it lists no patches, and the import check refuses it with the way out, instead of
    raising AttributeError."""
    import megatron.core.fork_info as fork_info

    stamp = tmp_path / ".patchset-stamp.json"
    stamp.write_text(text)
    monkeypatch.setattr(fork_info, "_STAMP", stamp)
    monkeypatch.delenv("HFSDP_SKIP_FORK_GUARD", raising=False)
    assert (fork_info.fork_version(), fork_info.base_version()) == ("unstamped", "unstamped")
    assert fork_info.local_label() == "hfsdp.unstamped"
    assert fork_info.applied_patches() == []
    with pytest.raises(fork_info.ForkTreeError, match="not a readable JSON object naming the tree's fork_version"
                       ) as info:
        fork_info.verify_tree()
    assert "materialize` or `pip install -e " in str(info.value)
