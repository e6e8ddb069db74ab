"""The overlay in queue/export, lint and check (also against another release, and a yanked one)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from patchset_fake import (
    ALLOC_PATCH,
    BASE_FILES,
    OVERLAY_FILES,
    TRAIN_PATCH,
    Env,
    make_sdist,
    package_index,
    patch_text,
    tree_digest,
)

from hfsdp.patchset.check import check_against, top_level_names
from hfsdp.patchset.cli import main
from hfsdp.patchset.export import export_queue
from hfsdp.patchset.lint import lint
from hfsdp.patchset.materialize import materialize
from hfsdp.patchset.queue import make_queue

ALLOCATOR = "megatron/core/maxpool_allocator.py"
TEARDOWN = "megatron/training/fork/teardown.py"
CREATES = ("diff --git a/megatron/core/made.py b/megatron/core/made.py\nnew file mode 100644\n"
           "--- /dev/null\n+++ b/megatron/core/made.py\n@@ -0,0 +1 @@\n+MADE = 1\n")


def cli(env: Env, *args: str) -> int:
    return main(["--root", str(env.project.root), *args])


def quiet(*_: object) -> None:
    pass


def git(queue: Path, *args: str, **env: str) -> str:
    proc = subprocess.run(["git", "-C", str(queue), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def overlay_commit(queue: Path) -> str:
    return git(queue, "rev-list", "--reverse", "patchset/base..HEAD").split()[0]


def fixup_overlay(queue: Path, change) -> None:  # noqa: ANN001
    """Change the queue's work tree with ``change(queue)``, then fold the change into the overlay commit."""
    change(queue)
    git(queue, "add", "-A", ".")
    git(queue, "commit", "-q", f"--fixup={overlay_commit(queue)}")
    git(queue, "rebase", "-q", "-i", "--autosquash", "patchset/base", GIT_SEQUENCE_EDITOR="true")


def patches_digest(env: Env) -> dict[str, str]:
    return tree_digest(env.project.patches_dir)


# --- queue / export


def test_queue_export_round_trip_keeps_the_overlay(overlaid: Env, tmp_path: Path) -> None:
    export_queue(overlaid.project, make_queue(overlaid.project, tmp_path / "q").repo, log=quiet)  # canonical
    first = patches_digest(overlaid)
    assert {p for p in first if p.startswith("overlay/")} == {f"overlay/{p}" for p in OVERLAY_FILES}
    export_queue(overlaid.project, make_queue(overlaid.project, tmp_path / "q2").repo, log=quiet)
    assert patches_digest(overlaid) == first


def test_export_writes_overlay_changes_made_in_the_queue(overlaid: Env, tmp_path: Path) -> None:
    export_queue(overlaid.project, make_queue(overlaid.project, tmp_path / "q").repo, log=quiet)
    before = {p.name: p.read_bytes() for p in overlaid.project.patches_dir.glob("*.patch")}
    queue = make_queue(overlaid.project, tmp_path / "q2").repo

    def change(repo: Path) -> None:
        (repo / ALLOCATOR).write_text(OVERLAY_FILES[ALLOCATOR] + "POOL_SLOTS = 4\n")
        (repo / TEARDOWN).unlink()
        (repo / "megatron/core/planner.py").write_text("PLAN = 1\n")

    fixup_overlay(queue, change)
    assert cli(overlaid, "export", "--queue", str(queue)) == 0
    overlay = overlaid.project.overlay_dir
    assert (overlay / ALLOCATOR).read_text().endswith("POOL_SLOTS = 4\n")
    assert not (overlay / TEARDOWN).exists() and not (overlay / "megatron/training").exists()
    assert (overlay / "megatron/core/planner.py").read_text() == "PLAN = 1\n"
    assert {p.name: p.read_bytes() for p in overlaid.project.patches_dir.glob("*.patch")} == before
    assert cli(overlaid, "materialize") == 0
    assert (overlaid.project.root / "megatron/core/planner.py").read_text() == "PLAN = 1\n"


def test_export_refuses_an_overlay_commit_that_changes_base_files(overlaid: Env, tmp_path: Path, capsys) -> None:
    queue = make_queue(overlaid.project, tmp_path / "q").repo
    fixup_overlay(queue, lambda repo: (repo / "megatron/core/__init__.py").write_text("VALUE = 3\n"))
    before = patches_digest(overlaid)
    capsys.readouterr()
    assert cli(overlaid, "export", "--queue", str(queue)) == 2
    err = capsys.readouterr().err
    assert "changes or deletes files of the base" in err and "M megatron/core/__init__.py" in err, err
    assert patches_digest(overlaid) == before
    fixup_overlay(queue, lambda repo: (repo / "megatron/core/__init__.py").write_text("VALUE = 1\n"))  # the way out
    assert cli(overlaid, "export", "--queue", str(queue)) == 0


def test_export_refuses_a_patch_commit_that_creates_a_file(overlaid: Env, tmp_path: Path, capsys) -> None:
    queue = make_queue(overlaid.project, tmp_path / "q").repo
    (queue / "megatron/core/made.py").write_text("MADE = 1\n")
    git(queue, "add", "-A", ".")
    git(queue, "commit", "-q", "-m", "made\n\nDescription: makes a file\n")
    before = patches_digest(overlaid)
    capsys.readouterr()
    assert cli(overlaid, "export", "--queue", str(queue)) == 2
    err = capsys.readouterr().err
    assert "(made.patch) creates megatron/core/made.py" in err and "belongs in the overlay commit" in err, err
    assert patches_digest(overlaid) == before
    # The way out: the file moves into the overlay commit; the patch commit, now empty, goes.
    git(queue, "reset", "-q", "--hard", "HEAD~1")
    fixup_overlay(queue, lambda repo: (repo / "megatron/core/made.py").write_text("MADE = 1\n"))
    assert cli(overlaid, "export", "--queue", str(queue)) == 0
    assert (overlaid.project.overlay_dir / "megatron/core/made.py").read_text() == "MADE = 1\n"


def test_a_series_that_still_creates_files_round_trips_and_lint_names_it(fake: Env, tmp_path: Path) -> None:
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                       "made.patch": patch_text("Make a file", CREATES),
                       "train.patch": patch_text("Fork training", TRAIN_PATCH)})
    export_queue(fake.project, make_queue(fake.project, tmp_path / "q").repo, log=quiet)
    first = patches_digest(fake)
    export_queue(fake.project, make_queue(fake.project, tmp_path / "q2").repo, log=quiet)
    assert patches_digest(fake) == first
    messages = [str(p) for p in lint(fake.project)]
    assert messages == ["made.patch: creates megatron/core/made.py; a file upstream does not have belongs in the "
                        "overlay: move it to patches/overlay/megatron/core/made.py and drop it from the patch"]


def test_export_refuses_a_queue_without_overlay_commit_while_the_overlay_has_files(overlaid: Env, tmp_path: Path,
                                                                                   capsys) -> None:
    queue = make_queue(overlaid.project, tmp_path / "q").repo
    git(queue, "rebase", "-q", "--onto", "patchset/base", overlay_commit(queue))  # the overlay commit dropped
    before = patches_digest(overlaid)
    capsys.readouterr()
    assert cli(overlaid, "export", "--queue", str(queue)) == 2
    err = capsys.readouterr().err
    assert "has no overlay commit" in err and "exporting would delete them" in err, err
    assert patches_digest(overlaid) == before


def test_a_queue_without_overlay_commit_exports_when_there_is_no_overlay(fake: Env, tmp_path: Path) -> None:
    """A queue made before the overlay existed (no overlay commit) still exports an overlay-free series."""
    queue = make_queue(fake.project, tmp_path / "q").repo
    git(queue, "rebase", "-q", "--onto", "patchset/base", overlay_commit(queue))
    assert cli(fake, "export", "--queue", str(queue)) == 0
    assert fake.project.overlay_files() == []


def test_export_refuses_an_overlay_changed_since_the_queue(overlaid: Env, tmp_path: Path, capsys) -> None:
    queue = make_queue(overlaid.project, tmp_path / "q").repo
    overlaid.write_overlay({TEARDOWN: "def tear_down():\n    return 'pulled'\n"})
    before = patches_digest(overlaid)
    capsys.readouterr()
    assert cli(overlaid, "export", "--queue", str(queue)) == 2
    err = capsys.readouterr().err
    assert f"patches/overlay/{TEARDOWN}" in err and "would undo those changes" in err, err
    assert patches_digest(overlaid) == before


def test_export_refuses_a_misplaced_overlay_commit_and_overlay_outside_the_members(overlaid: Env, tmp_path: Path,
                                                                                   capsys) -> None:
    queue = make_queue(overlaid.project, tmp_path / "q").repo
    before = patches_digest(overlaid)
    (queue / "megatron/core/late.py").write_text("LATE = 1\n")
    git(queue, "add", "-A", ".")
    git(queue, "commit", "-q", "-m", "overlay")
    capsys.readouterr()
    assert cli(overlaid, "export", "--queue", str(queue)) == 2
    assert "comes right after the base" in capsys.readouterr().err
    git(queue, "reset", "-q", "--hard", "HEAD~1")
    fixup_overlay(queue, lambda repo: (repo / "megatron/notes.txt").write_text("mine\n"))
    assert cli(overlaid, "export", "--queue", str(queue)) == 2
    err = capsys.readouterr().err
    assert "adds what cannot be an overlay file" in err and "megatron/notes.txt is outside" in err, err
    assert patches_digest(overlaid) == before


# --- lint


def test_lint_refuses_patches_that_create_or_touch_overlay_files(overlaid: Env) -> None:
    touches = TRAIN_PATCH.replace("megatron/training/train.py", TEARDOWN).replace(
        "@@ -1,2 +1,2 @@\n def train():\n-    return 'upstream'\n+    return 'fork'\n",
        "@@ -1,2 +1,2 @@\n def tear_down():\n-    return 'clean'\n+    return 'patched'\n")
    overlaid.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                           "made.patch": patch_text("Make a file", CREATES),
                           "touch.patch": patch_text("Patch an overlay file", touches),
                           "train.patch": patch_text("Fork training", TRAIN_PATCH)})
    messages = [str(p) for p in lint(overlaid.project)]
    assert messages == [
        "made.patch: creates megatron/core/made.py; a file upstream does not have belongs in the overlay: move it "
        "to patches/overlay/megatron/core/made.py and drop it from the patch",
        f"touch.patch: touches {TEARDOWN}, a file of the overlay: change patches/overlay/{TEARDOWN} itself and "
        "drop it from the patch",
    ]
    assert cli(overlaid, "materialize") == 0  # mechanically it builds; lint is what refuses it


def test_lint_refuses_overlay_files_the_sdist_has_or_outside_the_members(overlaid: Env) -> None:
    overlaid.write_overlay({"megatron/core/alloc.py": "mine = True\n", "megatron/legacy/old.py": "OLD = 1\n"})
    (overlaid.project.overlay_dir / "NOTES.md").write_text("notes\n")
    messages = [str(p) for p in lint(overlaid.project)]
    assert messages == [
        "overlay: patches/overlay/NOTES.md is outside megatron/core, megatron/training; the overlay holds files of "
        "those folders only",
        "overlay: patches/overlay/megatron/legacy/old.py is outside megatron/core, megatron/training; the overlay "
        "holds files of those folders only",
        "overlay: patches/overlay/megatron/core/alloc.py is a file of the megatron_core-0.18.2.tar.gz sdist; the "
        "overlay only adds files: make the change to it a patch and delete the overlay copy",
    ]


def test_lint_names_a_patch_saved_with_crlf_line_endings(fake: Env) -> None:
    crlf = patch_text("Add maxpool flag", ALLOC_PATCH).replace("\n", "\r\n")
    (fake.project.patches_dir / "alloc.patch").write_bytes(crlf.encode())
    messages = [str(p) for p in lint(fake.project)]
    assert "alloc.patch: has CRLF line endings (line 1); save it with LF endings" in messages


def test_lint_of_the_fake_with_an_overlay_is_clean(overlaid: Env, capsys) -> None:
    assert lint(overlaid.project) == []
    assert cli(overlaid, "check") == 0
    assert "the overlay (2 files) and all 2 patches apply" in capsys.readouterr().out


# --- check --against


def newer_release(tmp_path: Path, version: str = "0.19.2") -> Path:
    """A later release that defines its own MaxPoolAllocator beside the fork's module, and has the fork's
    teardown file at the same path."""
    files = dict(BASE_FILES)
    files["megatron/core/buffers.py"] = (
        "import logging\n\nlogger = logging.getLogger(__name__)\n\n\nclass MaxPoolAllocator:\n    pass\n\n\n"
        "def _private_helper():\n    return 1\n")
    files["megatron/training/elsewhere.py"] = "class MaxPoolAllocator:\n    pass\nPOOL_LANES = 2\n"
    files["megatron/training/fork/teardown.py"] = "def tear_down():\n    return 'upstream'\n"
    folder = tmp_path / version
    folder.mkdir()
    return make_sdist(folder, version=version, files=files)


def test_check_against_a_release_reports_overlay_conflicts(overlaid: Env, tmp_path: Path, capsys) -> None:
    sdist = newer_release(tmp_path)
    report = check_against(overlaid.project, str(sdist))
    assert [(c.path, c.reason, c.files) for c in report.overlay] == [
        (TEARDOWN, "0.19.2 has a file at this path", (TEARDOWN,)),
        (ALLOCATOR, "defines MaxPoolAllocator, which 0.19.2 also defines in megatron/core/buffers.py (the same "
                    "package)", ("megatron/core/buffers.py",)),
    ]  # not logger, not _private_helper; not the MaxPoolAllocator of another package
    assert {r.patch: r.state for r in report.patches} == {"alloc.patch": "applies", "train.patch": "applies"}
    capsys.readouterr()
    assert cli(overlaid, "check", "--against", str(sdist)) == 1
    out = capsys.readouterr().out
    assert f"  conflicts overlay {ALLOCATOR}: defines MaxPoolAllocator, which 0.19.2 also defines in " in out
    assert "2 overlay conflict(s)" in out


def test_top_level_names() -> None:
    source = ("import os\nfrom x import y\nlogger = 1\n_hidden = 2\n__all__ = ['A']\nA, (B, *C) = 1, (2, 3)\n"
              "D: int = 4\nclass E:\n    inner = 5\ndef f():\n    local = 6\nasync def g():\n    pass\n"
              "if os:\n    H = 7\ntype T = int\n")
    assert top_level_names(source) == {"A", "B", "C", "D", "E", "f", "g", "T"}


@pytest.fixture
def index(overlaid: Env, tmp_path: Path) -> Iterator[Env]:
    """``overlaid`` whose base.toml points at a local index serving 0.18.1 (yanked) and 0.19.2."""
    files = {p.name: p.read_bytes() for p in (newer_release(tmp_path, "0.18.1"), newer_release(tmp_path))}
    with package_index(files, yanked={"megatron_core-0.18.1.tar.gz": "wrong version"}) as url:
        base = overlaid.project.patches_dir / "base.toml"
        base.write_text(base.read_text().replace("http://127.0.0.1:9/simple", f"{url}/simple"))
        yield overlaid


def test_check_against_a_yanked_release_says_so(index: Env, monkeypatch, capsys) -> None:
    capsys.readouterr()
    assert cli(index, "check", "--against", "0.18.1") == 1  # downloaded from the index (into the cache)
    out = capsys.readouterr().out
    assert "note:    megatron_core-0.18.1.tar.gz is yanked on http://127.0.0.1:" in out
    assert "(wrong version): pip installs it only when pinned exactly" in out
    assert cli(index, "check", "--against", "0.19.2") == 1
    assert "note:" not in capsys.readouterr().out
    monkeypatch.setenv("MEGATRON_PATCHSET_OFFLINE", "1")  # cached now: checked offline, the index not asked
    assert cli(index, "check", "--against", "0.18.1") == 1
    assert "whether megatron_core-0.18.1.tar.gz is yanked on http://127.0.0.1:" in capsys.readouterr().out


def test_check_against_a_file_when_the_index_does_not_answer(overlaid: Env, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    assert cli(overlaid, "check", "--against", str(newer_release(tmp_path))) == 1
    out = capsys.readouterr().out
    assert "is unknown (the index did not answer:" in out and "Traceback" not in out


def test_check_against_an_overlay_module_that_does_not_parse(overlaid: Env, tmp_path: Path, capsys) -> None:
    overlaid.write_overlay({ALLOCATOR: "class Broken(:\n"})
    capsys.readouterr()
    assert cli(overlaid, "check", "--against", str(newer_release(tmp_path))) == 2
    err = capsys.readouterr().err
    assert f"patches/overlay/{ALLOCATOR} is not valid Python (line 1" in err and "Traceback" not in err


# --- the read-only verbs with an overlay


@pytest.mark.parametrize("verb", [["status"], ["check"], ["diff"], ["lint"], ["diff", "--series"], ["overlay"]])
def test_read_only_verbs_write_nothing_with_an_overlay(overlaid: Env, verb: list[str]) -> None:
    materialize(overlaid.project, log=quiet)
    (overlaid.project.root / ALLOCATOR).write_text("edited = True\n")
    root = overlaid.project.root
    digest = tree_digest(root)
    os.chmod(root, 0o555)
    try:
        assert cli(overlaid, *verb) in (0, 1)
    finally:
        os.chmod(root, 0o755)
    assert tree_digest(root) == digest
