"""Advice in an error message leads somewhere: every command a fix suggests is run here.

Each test provokes an error, takes the commands quoted in its fix (`...`), runs all of them in
order (``DIR``/``NAME`` filled in, manual steps done where the message asks for them), and checks
that the user ends where the message promised, with nothing lost.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from patchset_fake import (
    ALLOC_PATCH,
    TRAIN_PATCH,
    Env,
    make_sdist,
    package_index,
    patch_text,
    point_at_index,
    save_during_build,
    set_pin,
    sha256,
)

from hfsdp.patchset.cli import main


def commands(message: str) -> list[str]:
    """The commands quoted in a message, in order."""
    return re.findall(r"`([^`]+)`", message)


def run_advice(env: Env, command: str, capsys, **fill: str) -> int:
    """Run one suggested command as a user would, in the checkout."""
    for key, value in fill.items():
        command = re.sub(rf"\b{key}\b", value, command)
    root = env.project.root
    redirect = None
    if " > " in command:
        command, redirect = command.split(" > ")
    argv = shlex.split(command)
    if argv[0] == "scripts/patchset":
        capsys.readouterr()
        rc = main(["--root", str(root), *argv[1:]])
        if redirect:
            (root / redirect).write_text(capsys.readouterr().out)
        return rc
    if argv[0] == "mv":
        os.rename(argv[1], argv[2])
        return 0
    return subprocess.run(argv, cwd=root, capture_output=True, text=True).returncode


def error_of(env: Env, capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["--root", str(env.project.root), *args]) == 2
    return capsys.readouterr().err


def test_edits_on_a_tree_whose_patches_were_pulled(fake: Env, capsys) -> None:
    """materialize (and refresh) refuse; diff > my.patch, materialize --backup, git apply --reject, refresh."""
    main(["--root", str(fake.project.root), "materialize"])
    init = fake.project.megatron_dir / "core" / "__init__.py"
    init.write_text("VALUE = 2  # my edit\n")
    fake.series_with(ALLOC_PATCH.replace("+maxpool = True", "+maxpool = 'pulled'"))  # git pull
    err = error_of(fake, capsys, "materialize")
    assert "megatron/core/__init__.py" in err
    assert error_of(fake, capsys, "refresh").split("-> ")[1] == err.split("-> ")[1]  # same way out
    steps = commands(err.split("-> ", 1)[1])
    assert steps == ["scripts/patchset diff > my.patch", "scripts/patchset materialize --backup",
                     "git apply --reject my.patch", "scripts/patchset refresh", "scripts/patchset refresh --new NAME"]
    for step in steps[:3]:
        assert run_advice(fake, step, capsys) == 0, step
    # No patch owns core/__init__.py: plain refresh asks which, the --new way folds it.
    assert run_advice(fake, steps[3], capsys) == 2 and "refresh --new NAME" in capsys.readouterr().err
    assert run_advice(fake, steps[4], capsys, NAME="my-edit") == 0
    patches = {p.name: p.read_text() for p in fake.project.patches_dir.glob("*.patch")}
    assert "+maxpool = 'pulled'" in patches["alloc.patch"]  # the pulled change is intact
    assert "+VALUE = 2  # my edit" in patches["my-edit.patch"]  # the edit is in a patch
    assert init.read_text() == "VALUE = 2  # my edit\n"
    assert main(["--root", str(fake.project.root), "status"]) == 0  # up to date, no edits
    backup = next(fake.project.root.glob("megatron.bak-*"))
    assert (backup / "core" / "__init__.py").read_text() == "VALUE = 2  # my edit\n"  # and a copy


def test_edits_of_the_lines_a_pulled_patch_changed_too(fake: Env, capsys) -> None:
    """The edit and the pull change one line: `git apply --reject` leaves that hunk in a .rej file; the
    user makes the change by hand as the message says, deletes the .rej file, and refresh folds it in."""
    main(["--root", str(fake.project.root), "materialize"])
    alloc = fake.project.megatron_dir / "core" / "alloc.py"
    alloc.write_text(alloc.read_text().replace("maxpool = True", "maxpool = 'mine'"))
    fake.series_with(ALLOC_PATCH.replace("+maxpool = True", "+maxpool = 'pulled'"))  # git pull
    steps = commands(error_of(fake, capsys, "materialize").split("-> ", 1)[1])
    assert steps[:3] == ["scripts/patchset diff > my.patch", "scripts/patchset materialize --backup",
                         "git apply --reject my.patch"]
    assert run_advice(fake, steps[0], capsys) == 0 and run_advice(fake, steps[1], capsys) == 0
    assert run_advice(fake, steps[2], capsys) != 0  # the hunk meets the pulled line
    rejected = alloc.with_name("alloc.py.rej")
    assert "+maxpool = 'mine'" in rejected.read_text()  # the edit is kept, in the .rej file
    assert "maxpool = 'pulled'" in alloc.read_text()
    alloc.write_text(alloc.read_text().replace("maxpool = 'pulled'", "maxpool = 'mine'"))  # by hand
    rejected.unlink()
    assert run_advice(fake, steps[3], capsys) == 0  # refresh: alloc.patch owns alloc.py
    assert "+maxpool = 'mine'" in (fake.project.patches_dir / "alloc.patch").read_text()
    assert main(["--root", str(fake.project.root), "status"]) == 0
    backup = next(fake.project.root.glob("megatron.bak-*"))
    assert "maxpool = 'mine'" in (backup / "core" / "alloc.py").read_text()  # and a copy


def test_stale_tree_without_edits_refresh_says_materialize(fake: Env, capsys) -> None:
    main(["--root", str(fake.project.root), "materialize"])
    fake.series_with(desc="Reworded")
    err = error_of(fake, capsys, "refresh")
    assert commands(err.split("-> ", 1)[1]) == ["scripts/patchset materialize"]
    assert run_advice(fake, "scripts/patchset materialize", capsys) == 0
    assert main(["--root", str(fake.project.root), "status"]) == 0


def test_foreign_tree_both_ways_out(fake: Env, capsys) -> None:
    tree = fake.project.megatron_dir
    (tree / "core").mkdir(parents=True)
    (tree / "core" / "mine.py").write_text("precious = True\n")
    err = error_of(fake, capsys, "materialize")
    first, second, third = commands(err.split("-> ", 1)[1])
    assert first == f"mv {shlex.quote(str(tree))} {shlex.quote(f'{tree}.mine')}"  # the checkout has a space
    assert second == "scripts/patchset materialize"
    assert third == "scripts/patchset materialize --backup"
    assert run_advice(fake, first, capsys) == 0 and run_advice(fake, second, capsys) == 0
    assert (fake.project.root / "megatron.mine" / "core" / "mine.py").read_text() == "precious = True\n"
    # The other way out, on a fresh foreign tree.
    os.rename(tree, fake.project.root / "megatron.fresh")
    (tree / "core").mkdir(parents=True)
    (tree / "core" / "mine.py").write_text("also precious\n")
    assert run_advice(fake, third, capsys) == 0
    backup = next(fake.project.root.glob("megatron.bak-*"))
    assert (backup / "core" / "mine.py").read_text() == "also precious\n"


def test_kept_path_needed_by_the_new_tree(fake: Env, capsys) -> None:
    main(["--root", str(fake.project.root), "materialize"])
    (fake.project.megatron_dir / "core" / "extra.so").write_bytes(b"mine")
    creates = ("diff --git a/megatron/core/extra.so b/megatron/core/extra.so\nnew file mode 100644\n"
               "--- /dev/null\n+++ b/megatron/core/extra.so\n@@ -0,0 +1 @@\n+theirs\n")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                       "extra.patch": patch_text("Add a file", creates)})
    err = error_of(fake, capsys, "materialize")
    assert commands(err.split("-> ", 1)[1]) == ["scripts/patchset materialize", "scripts/patchset materialize --backup"]
    assert run_advice(fake, "scripts/patchset materialize --backup", capsys) == 0
    backup = next(fake.project.root.glob("megatron.bak-*"))
    assert (backup / "core" / "extra.so").read_bytes() == b"mine"
    # The first way: move it out, then materialize again (on a fresh conflict).
    (fake.project.megatron_dir / "core" / "extra.so").unlink()
    (fake.project.megatron_dir / "training" / "x.so").write_bytes(b"kept")
    assert run_advice(fake, "scripts/patchset materialize", capsys) == 0  # up to date: nothing to do


def test_changed_during_build_then_the_edit_is_saved(fake: Env, monkeypatch, capsys) -> None:
    main(["--root", str(fake.project.root), "materialize"])
    fake.series_with(desc="Reworded")
    edited = fake.project.megatron_dir / "core" / "__init__.py"
    save_during_build(monkeypatch, edited, "VALUE = 5\n")
    err = error_of(fake, capsys, "materialize")
    assert commands(err.split("-> ", 1)[1]) == ["scripts/patchset materialize"]
    rerun = error_of(fake, capsys, "materialize")  # the re-run says how to save the edit first
    steps = commands(rerun.split("-> ", 1)[1])
    for step in steps[:3]:
        assert run_advice(fake, step, capsys) == 0, step
    assert run_advice(fake, steps[4], capsys, NAME="value-five") == 0
    assert edited.read_text() == "VALUE = 5\n" and main(["--root", str(fake.project.root), "status"]) == 0


def test_export_after_the_patches_changed(fake: Env, tmp_path: Path, capsys) -> None:
    queue = tmp_path / "q"
    main(["--root", str(fake.project.root), "queue", "--dir", str(queue)])
    fake.series_with(ALLOC_PATCH.replace("+maxpool = True", "+maxpool = 'pulled'"))
    before = {p.name: p.read_bytes() for p in fake.project.patches_dir.iterdir()}
    err = error_of(fake, capsys, "export", "--queue", str(queue))
    assert "alloc.patch" in err
    assert {p.name: p.read_bytes() for p in fake.project.patches_dir.iterdir()} == before
    (step,) = commands(err.split("-> ", 1)[1])
    new = tmp_path / "fresh"
    assert run_advice(fake, step, capsys, DIR=str(new)) == 0
    assert main(["--root", str(fake.project.root), "export", "--queue", str(new)]) == 0
    assert "+maxpool = 'pulled'" in (fake.project.patches_dir / "alloc.patch").read_text()


def test_refresh_ownership_and_conflict_ways_out(fake: Env, capsys) -> None:
    main(["--root", str(fake.project.root), "materialize"])
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 5\n")
    err = error_of(fake, capsys, "refresh")
    by_patch, by_new = commands(err.split("-> ", 1)[1])
    assert by_patch == "scripts/patchset refresh --patch NAME" and by_new == "scripts/patchset refresh --new NAME"
    assert run_advice(fake, by_patch, capsys, NAME="alloc") == 0
    assert "+VALUE = 5" in (fake.project.patches_dir / "alloc.patch").read_text()
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 6\n")
    assert run_advice(fake, by_new, capsys, NAME="value-six") == 0
    assert "+VALUE = 6" in (fake.project.patches_dir / "value-six.patch").read_text()


def test_refresh_into_an_earlier_patch_that_conflicts(fake: Env, capsys) -> None:
    later = TRAIN_PATCH.replace("megatron/training/train.py", "megatron/core/alloc.py").replace(
        "@@ -1,2 +1,2 @@\n def train():\n-    return 'upstream'\n+    return 'fork'\n",
        "@@ -30,3 +30,3 @@ line_29 = 29\n line_29 = 29\n-line_30 = 30\n+line_30 = 'later'\n line_31 = 31\n")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                       "later.patch": patch_text("Touch line 30", later)})
    main(["--root", str(fake.project.root), "materialize"])
    alloc = fake.project.megatron_dir / "core" / "alloc.py"
    alloc.write_text(alloc.read_text().replace("line_30 = 'later'", "line_30 = 'mine'"))
    before = {p.name: p.read_bytes() for p in fake.project.patches_dir.iterdir()}
    err = error_of(fake, capsys, "refresh", "--patch", "alloc")
    assert {p.name: p.read_bytes() for p in fake.project.patches_dir.iterdir()} == before
    (step,) = commands(err.split("-> ", 1)[1])
    assert run_advice(fake, step, capsys, NAME="line-thirty") == 0
    assert "+line_30 = 'mine'" in (fake.project.patches_dir / "line-thirty.patch").read_text()


def test_queue_inside_the_checkout_suggests_a_folder_beside_it(fake: Env, capsys) -> None:
    err = error_of(fake, capsys, "queue", "--dir", str(fake.project.root / "pq"))
    (step,) = commands(err.split("-> ", 1)[1])
    assert run_advice(fake, step, capsys) == 0
    assert (fake.project.root.parent / f"{fake.project.root.name}-queue" / ".git").is_dir()


def test_a_folder_that_is_not_a_checkout(tmp_path, capsys) -> None:
    capsys.readouterr()
    assert main(["--root", str(tmp_path), "status"]) == 2
    assert "is not a checkout of this project" in capsys.readouterr().err


def test_patches_that_is_no_folder_is_put_back(fake: Env, capsys) -> None:
    """patches is a named pipe in a git checkout: the fix moves it aside and checks the folder out again."""
    git_checkout_of(fake)
    patches = fake.project.patches_dir
    os.rename(patches, fake.project.root / "elsewhere")
    os.mkfifo(patches)
    err = error_of(fake, capsys, "status")
    assert "its patches is a named pipe, not a folder" in err, err
    for command in commands(err):
        assert run_advice(fake, command, capsys) == 0, command
    assert patches.is_dir() and main(["--root", str(fake.project.root), "status"]) == 1  # not materialized yet


@pytest.mark.parametrize("built", [False, True])
def test_status_on_a_series_that_lost_patches_gives_advice_materialize_takes(fake: Env, capsys, built: bool) -> None:
    """patches/series lost patches patches/ still holds: status's way to a current tree restores the series
    before materialize (which refuses such a series), instead of sending the user to materialize alone."""
    git_checkout_of(fake)
    if built:
        assert main(["--root", str(fake.project.root), "materialize"]) == 0
    (fake.project.patches_dir / "series").write_text("")
    capsys.readouterr()
    assert main(["--root", str(fake.project.root), "status"]) == 1
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("stamp:", "tree:"))
               and "->" in line]
    assert commands(line) == ["git checkout -- patches/series", "scripts/patchset materialize"], line
    for command in commands(line):
        assert run_advice(fake, command, capsys) == 0, command
    capsys.readouterr()
    assert main(["--root", str(fake.project.root), "status"]) == 0, capsys.readouterr().out


def test_symlinked_tree_both_ways_out(fake: Env, capsys) -> None:
    """`mv megatron X; ln -s X megatron`: put the folder back in its place, or set the link aside."""
    root = fake.project.root
    main(["--root", str(root), "materialize"])
    tree = fake.project.megatron_dir
    (tree / "core" / "__init__.py").write_text("VALUE = 3  # mine\n")
    os.rename(tree, root / "X")
    os.symlink("X", tree)
    err = error_of(fake, capsys, "status")
    unlink, move, backup = commands(err.split("-> ", 1)[1])
    assert unlink == f"unlink {shlex.quote(str(tree))}"
    assert move == f"mv {shlex.quote(str(root / 'X'))} {shlex.quote(str(tree))}"
    assert backup == "scripts/patchset materialize --backup"
    assert run_advice(fake, unlink, capsys) == 0 and run_advice(fake, move, capsys) == 0
    assert not tree.is_symlink() and (tree / "core" / "__init__.py").read_text() == "VALUE = 3  # mine\n"
    capsys.readouterr()
    assert main(["--root", str(root), "diff"]) == 0
    diff = capsys.readouterr().out
    assert "+VALUE = 3  # mine" in diff and "deleted file mode" not in diff  # exactly the edit
    # The other way out: the link (not its folder) goes to megatron.bak-*, a fresh tree is built.
    os.rename(tree, root / "X")
    os.symlink("X", tree)
    assert run_advice(fake, backup, capsys) == 0
    (kept,) = root.glob("megatron.bak-*")
    assert os.readlink(kept) == "X" and (kept / "core" / "__init__.py").read_text() == "VALUE = 3  # mine\n"
    assert not tree.is_symlink() and main(["--root", str(root), "status"]) == 0


def test_dangling_symlinked_tree_way_out(fake: Env, capsys) -> None:
    root = fake.project.root
    tree = fake.project.megatron_dir
    os.symlink("gone", tree)
    (root / ".patchset-old-megatron-1-2").mkdir()  # and a tree parked by a killed run: not renamed onto the link
    (root / ".patchset-old-megatron-1-2" / "NOTES.md").write_text("mine\n")
    err = error_of(fake, capsys, "materialize")
    assert "(which does not exist)" in err
    assert commands(err.split("-> ", 1)[1]) == ["scripts/patchset materialize --backup"]  # nothing to move back
    assert run_advice(fake, "scripts/patchset materialize --backup", capsys) == 0
    kept = sorted(root.glob("megatron.bak-*"))
    assert [os.readlink(p) for p in kept if p.is_symlink()] == ["gone"]
    assert [(p / "NOTES.md").read_text() for p in kept if not p.is_symlink()] == ["mine\n"]
    assert main(["--root", str(root), "status"]) == 0


def test_symlinked_folder_inside_the_tree_both_ways_out(fake: Env, capsys) -> None:
    root = fake.project.root
    main(["--root", str(root), "materialize"])
    core = fake.project.megatron_dir / "core"
    (core / "__init__.py").write_text("VALUE = 8  # mine\n")
    os.rename(core, root / "core-elsewhere")
    os.symlink(root / "core-elsewhere", core)
    err = error_of(fake, capsys, "diff")
    unlink, move, backup = commands(err.split("-> ", 1)[1])
    assert run_advice(fake, unlink, capsys) == 0 and run_advice(fake, move, capsys) == 0
    capsys.readouterr()
    assert main(["--root", str(root), "diff"]) == 0
    assert "+VALUE = 8  # mine" in capsys.readouterr().out
    os.rename(core, root / "core-elsewhere")
    os.symlink(root / "core-elsewhere", core)
    assert run_advice(fake, backup, capsys) == 0
    (kept,) = root.glob("megatron.bak-*")
    assert os.readlink(kept / "core") == str(root / "core-elsewhere")
    assert (root / "core-elsewhere" / "__init__.py").read_text() == "VALUE = 8  # mine\n"
    assert main(["--root", str(root), "status"]) == 0


# --- The overlay (patches/overlay/).

ALLOCATOR = "megatron/core/maxpool_allocator.py"


def test_an_overlay_file_over_a_base_file(overlaid: Env, capsys) -> None:
    """Delete the overlay copy; the change to the upstream file goes into a patch."""
    main(["--root", str(overlaid.project.root), "materialize"])
    overlaid.write_overlay({"megatron/core/alloc.py": "replaced = True\n"})
    err = error_of(overlaid, capsys, "materialize")
    assert commands(err.split("-> ", 1)[1]) == ["scripts/patchset refresh"]
    (overlaid.project.overlay_dir / "megatron/core/alloc.py").unlink()  # the manual step
    alloc = overlaid.project.megatron_dir / "core" / "alloc.py"
    alloc.write_text(alloc.read_text() + "replaced = True\n")
    assert run_advice(overlaid, "scripts/patchset refresh", capsys) == 0
    assert "+replaced = True" in (overlaid.project.patches_dir / "alloc.patch").read_text()
    assert main(["--root", str(overlaid.project.root), "status"]) == 0


def test_what_cannot_be_an_overlay_file(overlaid: Env, capsys) -> None:
    (overlaid.project.overlay_dir / "NOTES.md").write_text("notes\n")
    err = error_of(overlaid, capsys, "materialize")
    assert commands(err.split("-> ", 1)[1]) == ["scripts/patchset lint"]
    assert run_advice(overlaid, "scripts/patchset lint", capsys) == 1
    assert "patches/overlay/NOTES.md is outside" in capsys.readouterr().out
    (overlaid.project.overlay_dir / "NOTES.md").unlink()
    assert main(["--root", str(overlaid.project.root), "materialize"]) == 0


def test_a_new_file_that_is_not_text(overlaid: Env, capsys) -> None:
    main(["--root", str(overlaid.project.root), "materialize"])
    blob = overlaid.project.megatron_dir / "core" / "weights.py"
    blob.write_bytes(b"\xff\xfe\x00")
    before = {p: p.read_bytes() for p in overlaid.project.patches_dir.rglob("*") if p.is_file()}
    err = error_of(overlaid, capsys, "refresh")
    assert {p: p.read_bytes() for p in overlaid.project.patches_dir.rglob("*") if p.is_file()} == before
    assert commands(err.split("-> ", 1)[1]) == ["scripts/patchset refresh"]
    os.rename(blob, overlaid.project.root / "weights.bin")  # moved out of megatron/
    assert run_advice(overlaid, "scripts/patchset refresh", capsys) == 0


def test_a_new_file_where_a_patch_deletes_one(fake: Env, tmp_path: Path, capsys) -> None:
    deletes = ("diff --git a/megatron/training/train.py b/megatron/training/train.py\ndeleted file mode 100644\n"
               "--- a/megatron/training/train.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-def train():\n"
               "-    return 'upstream'\n")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                       "train.patch": patch_text("Drop training", deletes)})
    main(["--root", str(fake.project.root), "materialize"])
    (fake.project.megatron_dir / "training").mkdir(exist_ok=True)  # the patch emptied it
    (fake.project.megatron_dir / "training" / "train.py").write_text("def train():\n    return 'back'\n")
    err = error_of(fake, capsys, "refresh")
    assert "the megatron_core-0.18.2.tar.gz sdist has it" in err
    queue, export = commands(err.split("-> ", 1)[1])
    assert run_advice(fake, queue, capsys, DIR=str(tmp_path / "q")) == 0
    assert run_advice(fake, export, capsys, DIR=str(tmp_path / "q")) == 0
    assert fake.project.overlay_files() == []


def test_an_overlay_edit_under_a_patch_that_changes_it(overlaid: Env, tmp_path: Path, capsys) -> None:
    later = ("diff --git a/megatron/core/maxpool_allocator.py b/megatron/core/maxpool_allocator.py\n"
             "--- a/megatron/core/maxpool_allocator.py\n+++ b/megatron/core/maxpool_allocator.py\n"
             "@@ -1,7 +1,7 @@\n import logging\n \n logger = logging.getLogger(__name__)\n-POOL_LANES = 2\n"
             "+POOL_LANES = 'patched'\n \n \n class MaxPoolAllocator:\n")
    overlaid.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                           "train.patch": patch_text("Fork training", TRAIN_PATCH),
                           "lanes.patch": patch_text("Patch an overlay file", later)})
    main(["--root", str(overlaid.project.root), "materialize"])
    edited = overlaid.project.root / ALLOCATOR
    edited.write_text(edited.read_text().replace("POOL_LANES = 'patched'", "POOL_LANES = 'mine'"))
    before = {p: p.read_bytes() for p in overlaid.project.patches_dir.rglob("*") if p.is_file()}
    err = error_of(overlaid, capsys, "refresh")
    assert {p: p.read_bytes() for p in overlaid.project.patches_dir.rglob("*") if p.is_file()} == before
    lint, queue, export = commands(err.split("-> ", 1)[1])
    assert run_advice(overlaid, lint, capsys) == 1
    assert f"lanes.patch: touches {ALLOCATOR}, a file of the overlay" in capsys.readouterr().out
    assert run_advice(overlaid, queue, capsys, DIR=str(tmp_path / "q")) == 0
    assert run_advice(overlaid, export, capsys, DIR=str(tmp_path / "q")) == 0
    assert edited.read_text().count("POOL_LANES = 'mine'") == 1  # the edit is where it was


def test_a_queue_without_overlay_commit(overlaid: Env, tmp_path: Path, capsys) -> None:
    old = tmp_path / "old"
    main(["--root", str(overlaid.project.root), "queue", "--dir", str(old)])
    first = subprocess.run(["git", "-C", str(old), "rev-list", "--reverse", "patchset/base..HEAD"],
                           capture_output=True, text=True, check=True).stdout.split()[0]
    subprocess.run(["git", "-C", str(old), "-c", "user.name=t", "-c", "user.email=t@t", "rebase", "-q", "--onto",
                    "patchset/base", first], check=True)  # as a queue of an older tool: no overlay commit
    err = error_of(overlaid, capsys, "export", "--queue", str(old))
    (step,) = commands(err.split("-> ", 1)[1])
    assert run_advice(overlaid, step, capsys, DIR=str(tmp_path / "new")) == 0
    assert main(["--root", str(overlaid.project.root), "export", "--queue", str(tmp_path / "new")]) == 0
    assert (overlaid.project.overlay_dir / ALLOCATOR).is_file()


# --- The pinned sdist's sha256.


def git_checkout_of(env: Env) -> None:
    """Make the fake checkout a git repository with everything committed (for `git checkout` advice)."""
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=env.project.root, check=True, capture_output=True)


def test_a_wrong_pin_is_named_and_the_download_kept(fake: Env, monkeypatch, capsys) -> None:
    """The index publishes the downloaded file's sha256: the pin is wrong, not the download."""
    monkeypatch.delenv("MEGATRON_PATCHSET_SDIST")
    with package_index({fake.sdist.name: fake.sdist.read_bytes()}) as url:
        point_at_index(fake, url)
        git_checkout_of(fake)
        set_pin(fake, "0" * 64)  # a slip in patches/base.toml
        for _ in range(2):  # the same answer the second time: the download was kept, not fetched again
            err = error_of(fake, capsys, "materialize")
            assert "the file is the release, the pin is wrong" in err, err
            assert commands(err.split("-> ", 1)[1]) == ["git checkout patches/base.toml"]
        cached = Path(os.environ["MEGATRON_PATCHSET_CACHE"]) / fake.sdist.name
        assert sha256(cached) == sha256(fake.sdist)
        assert run_advice(fake, "git checkout patches/base.toml", capsys) == 0
    monkeypatch.setenv("MEGATRON_PATCHSET_OFFLINE", "1")  # the kept download is all it needs now
    assert main(["--root", str(fake.project.root), "materialize"]) == 0


def test_a_damaged_cached_sdist_is_named_not_the_pin(fake: Env, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("MEGATRON_PATCHSET_SDIST")
    cached = Path(os.environ["MEGATRON_PATCHSET_CACHE"]) / fake.sdist.name
    cached.parent.mkdir(parents=True)
    make_sdist(cached.parent, files={"megatron/core/__init__.py": "DAMAGED = 1\n", "megatron/training/t.py": ""})
    with package_index({fake.sdist.name: fake.sdist.read_bytes()}) as url:
        point_at_index(fake, url)
        err = error_of(fake, capsys, "materialize")
        assert "the pin is right and this file is damaged" in err and str(cached) in err
        assert commands(err.split("-> ", 1)[1])[0].startswith("pip download")
        cached.unlink()  # the way out: delete it, run again
        assert main(["--root", str(fake.project.root), "materialize"]) == 0


def test_a_mismatch_the_index_cannot_judge_says_how_to_tell(fake: Env, tmp_path: Path, monkeypatch, capsys) -> None:
    other = make_sdist(tmp_path, files={"megatron/core/__init__.py": "OTHER = 1\n", "megatron/training/t.py": ""})
    monkeypatch.setenv("MEGATRON_PATCHSET_SDIST", str(other))
    monkeypatch.setenv("MEGATRON_PATCHSET_OFFLINE", "1")
    err = error_of(fake, capsys, "materialize")
    assert "cannot be told here: offline" in err
    assert "if they are equal, the pin in patches/base.toml is wrong" in err and f"delete {other}" in err


def test_a_patch_saved_with_crlf_line_endings(fake: Env, tmp_path: Path, capsys) -> None:
    """A patch converted to CRLF: every verb that applies it names the line endings, not a rebase."""
    git_checkout_of(fake)
    alloc = fake.project.patches_dir / "alloc.patch"
    alloc.write_bytes(alloc.read_bytes().replace(b"\n", b"\r\n"))
    for verb in (["materialize"], ["check"], ["queue", "--dir", str(tmp_path / "q")]):
        err = error_of(fake, capsys, *verb)
        assert "alloc.patch does not apply: it was saved with CRLF (Windows) line endings" in err, (verb, err)
        assert "queue --dir" not in err, verb
    assert not (tmp_path / "q").exists() and not fake.project.megatron_dir.exists()
    steps = commands(err.split("-> ", 1)[1])
    assert steps == ["git checkout patches/alloc.patch", "scripts/patchset lint"]
    assert run_advice(fake, steps[1], capsys) == 1
    assert "alloc.patch: has CRLF line endings (line 1)" in capsys.readouterr().out
    assert run_advice(fake, steps[0], capsys) == 0
    assert main(["--root", str(fake.project.root), "materialize"]) == 0


def test_a_queue_folder_that_does_not_exist(fake: Env, tmp_path: Path, capsys) -> None:
    """`queue --continue` and `export` on a missing folder: make a queue (not: export the missing folder)."""
    missing = tmp_path / "nonexistent"
    for verb in (["queue", "--continue", "--dir", str(missing)], ["export", "--queue", str(missing)]):
        err = error_of(fake, capsys, *verb)
        assert f"{missing}: it does not exist, so it is not a patch queue" in err, err
        (step,) = commands(err.split("-> ", 1)[1])
        assert step == "scripts/patchset queue --dir DIR"
    assert run_advice(fake, step, capsys, DIR=str(missing)) == 0
    err = error_of(fake, capsys, "queue", "--continue", "--dir", str(missing))  # complete: nothing to continue
    (step,) = commands(err.split("-> ", 1)[1])
    assert step == f"scripts/patchset export --queue {missing}" and run_advice(fake, step, capsys) == 0


def test_a_killed_queue_continue_goes_on(fake: Env, tmp_path: Path, capsys) -> None:
    """`queue --continue` killed while applying a patch (its state says which, and on which commit): the next
    `--continue` goes on, after the half-applied patch is dropped or HEAD put back as the message says."""
    import json

    stops = ALLOC_PATCH.replace(" line_20 = 20\n+maxpool", " line_20 = 'changed upstream'\n+maxpool")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", stops),
                       "train.patch": patch_text("Fork training", TRAIN_PATCH)})
    queue = tmp_path / "q"
    err = error_of(fake, capsys, "queue", "--dir", str(queue))
    alloc = queue / "megatron/core/alloc.py"
    alloc.write_text(alloc.read_text().replace("line_20 = 20\n", "line_20 = 20\nmaxpool = True\n"))
    for rej in queue.rglob("*.rej"):
        rej.unlink()
    assert main(["--root", str(fake.project.root), "queue", "--continue", "--dir", str(queue)]) == 0
    state_file = queue / ".git/patchset-queue.json"
    state = json.loads(state_file.read_text())

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(queue), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    fixed = git("rev-parse", "HEAD~1")  # the fix of alloc.patch; train.patch after it
    killed = {**state, "pending": ["train.patch"], "resume_at": fixed,
              "texts": {"train.patch": (fake.project.patches_dir / "train.patch").read_text()}}
    state_file.write_text(json.dumps(killed))
    git("reset", "-q", "--hard", fixed)
    (queue / "megatron/training/train.py").write_text("def train():\n    return 'half'\n")  # killed mid-apply
    assert error_of(fake, capsys, "export", "--queue", str(queue))  # not before it is finished
    err = error_of(fake, capsys, "queue", "--continue", "--dir", str(queue))
    reset, rerun = commands(err.split("-> ", 1)[1])
    assert reset == f"git -C {queue} reset -q --hard"
    assert run_advice(fake, reset, capsys) == 0 and run_advice(fake, rerun, capsys) == 0
    assert "'fork'" in (queue / "megatron/training/train.py").read_text()
    # Killed again, and HEAD moved since (a reset too far): the message puts it back.
    state_file.write_text(json.dumps(killed))
    git("reset", "-q", "--hard", "HEAD~2")
    err = error_of(fake, capsys, "queue", "--continue", "--dir", str(queue))
    back, rerun, _ = commands(err.split("-> ", 1)[1])
    assert back == f"git -C {queue} reset --hard {fixed}"
    assert run_advice(fake, back, capsys) == 0 and run_advice(fake, rerun, capsys) == 0
    assert main(["--root", str(fake.project.root), "export", "--queue", str(queue)]) == 0
    assert "+maxpool = True" in (fake.project.patches_dir / "alloc.patch").read_text()
    assert "+    return 'fork'" in (fake.project.patches_dir / "train.patch").read_text()


def test_a_patch_saved_with_a_byte_order_mark(fake: Env, capsys) -> None:
    """A BOM before a patch's header: refused by name, and the command given removes it and nothing else."""
    alloc = fake.project.patches_dir / "alloc.patch"
    before = alloc.read_bytes()
    alloc.write_bytes(b"\xef\xbb\xbf" + before)
    err = error_of(fake, capsys, "materialize")
    assert "alloc.patch starts with a UTF-8 byte-order mark (BOM)" in err and not fake.project.megatron_dir.exists()
    (step,) = commands(err.split("-> ", 1)[1])
    assert run_advice(fake, step, capsys) == 0
    assert alloc.read_bytes() == before
    assert main(["--root", str(fake.project.root), "materialize"]) == 0


def test_stray_files_in_the_tree(overlaid: Env, capsys) -> None:
    """A .rej and an .orig beside the file a `git apply --reject` changed: named, never folded into the
    overlay; the command given deletes them, and refresh then folds the real edit alone."""
    root = overlaid.project.root
    assert main(["--root", str(root), "materialize"]) == 0
    init = root / "megatron" / "core" / "__init__.py"
    init.write_text("VALUE = 5\n")
    for name in ("__init__.py.rej", "__init__.py.orig"):
        (root / "megatron" / "core" / name).write_text("x\n")
    for verb in ("status", "refresh", "materialize", "diff"):
        err = error_of(overlaid, capsys, verb)
        assert "megatron/core/__init__.py.orig is a leftover of a failed or partial patch apply" in err, (verb, err)
        assert "megatron/core/__init__.py.rej is a leftover" in err, err
    assert not [p for p in overlaid.project.overlay_dir.rglob("*") if p.suffix in (".rej", ".orig")]
    (step,) = commands(err.split("-> ", 1)[1])
    assert step.startswith("rm ") and run_advice(overlaid, step, capsys) == 0
    assert main(["--root", str(root), "refresh", "--patch", "alloc"]) == 0
    assert "+VALUE = 5" in (overlaid.project.patches_dir / "alloc.patch").read_text()
    assert main(["--root", str(root), "status"]) == 0
