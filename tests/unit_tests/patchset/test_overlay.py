"""The overlay (patches/overlay/): materialize, stamp, status, refresh, diff and the Project API.

Driven through the command line where a user would meet the behaviour, on the fake project with
an overlay of two files (``overlaid``: OVERLAY_FILES beside the two-patch series).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from patchset_fake import ALLOC_PATCH, OVERLAY_FILES, TRAIN_PATCH, Env, patch_text, tree_digest

from hfsdp.patchset import export as export_mod
from hfsdp.patchset.cli import main
from hfsdp.patchset.errors import PatchsetError, SeriesError
from hfsdp.patchset.materialize import materialize, tree_status
from hfsdp.patchset.overlay import text_sha256
from hfsdp.patchset.queue import make_queue
from hfsdp.patchset.refresh import refresh
from hfsdp.patchset.stamp import read_stamp

ALLOCATOR = "megatron/core/maxpool_allocator.py"
TEARDOWN = "megatron/training/fork/teardown.py"


def cli(env: Env, *args: str) -> int:
    return main(["--root", str(env.project.root), *args])


def quiet(*_: object) -> None:
    pass


def patches_digest(env: Env) -> dict[str, str]:
    """Every file under patches/ (the overlay included) -> sha256."""
    return tree_digest(env.project.patches_dir)


def patch_files(env: Env) -> dict[str, bytes]:
    """The patch files and series, byte for byte (the overlay left out)."""
    return {p.name: p.read_bytes() for p in sorted(env.project.patches_dir.iterdir()) if p.is_file()}


def overlay_on_disk(env: Env) -> dict[str, str]:
    root = env.project.overlay_dir
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


# --- materialize and the stamp


def test_materialize_copies_the_overlay_and_stamps_it(overlaid: Env) -> None:
    assert materialize(overlaid.project, log=quiet) is True
    tree = overlaid.project.root
    for path, text in OVERLAY_FILES.items():
        assert (tree / path).read_text() == text
    assert "maxpool = True" in (tree / "megatron/core/alloc.py").read_text()  # and the series on top
    stamp = read_stamp(overlaid.project.root)
    assert stamp is not None
    assert stamp.overlay == tuple((p, text_sha256(t)) for p, t in sorted(OVERLAY_FILES.items()))
    assert stamp.overlay_texts == OVERLAY_FILES
    assert {ALLOCATOR, TEARDOWN} <= set(stamp.files)
    data = json.loads((overlaid.project.megatron_dir / ".patchset-stamp.json").read_text())
    assert data["schema"] == 4 and [e["path"] for e in data["overlay"]] == sorted(OVERLAY_FILES)
    st = tree_status(overlaid.project)
    assert st.up_to_date and st.edits == {} and st.overlay_files == 2 and st.changed_overlay == {}


def test_the_queue_is_base_then_overlay_then_patches(overlaid: Env, tmp_path: Path) -> None:
    queue = make_queue(overlaid.project, tmp_path / "q")
    subjects = subprocess.run(["git", "-C", str(queue.repo), "log", "--reverse", "--format=%s"],
                              capture_output=True, text=True, check=True).stdout.split()
    assert subjects == ["base", "overlay", "alloc", "train"]
    added = subprocess.run(["git", "-C", str(queue.repo), "diff", "--name-status", "patchset/base", queue.overlay],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert added == [f"A\t{ALLOCATOR}", f"A\t{TEARDOWN}"]


@pytest.mark.parametrize("change", ["changed", "new", "removed"])
def test_a_changed_added_or_removed_overlay_file_makes_the_tree_stale(overlaid: Env, change: str, capsys) -> None:
    assert cli(overlaid, "materialize") == 0
    extra = "megatron/core/extra.py"
    if change == "changed":
        overlaid.write_overlay({ALLOCATOR: OVERLAY_FILES[ALLOCATOR] + "POOL_SLOTS = 4\n"})
        path = ALLOCATOR
    elif change == "new":
        overlaid.write_overlay({extra: "EXTRA = True\n"})
        path = extra
    else:
        (overlaid.project.overlay_dir / TEARDOWN).unlink()
        path = TEARDOWN
    capsys.readouterr()
    assert cli(overlaid, "status") == 1
    out = capsys.readouterr().out
    assert "overlay: " in out and "1 changed since the tree was built" in out
    assert f"  [{change:7}] {path}" in out and "stamp:   STALE" in out and "edits:   none" in out
    assert cli(overlaid, "materialize") == 0  # no edits: rebuilt
    tree = overlaid.project.root
    assert (tree / path).exists() == (change != "removed")
    assert tree_status(overlaid.project).up_to_date and tree_status(overlaid.project).edits == {}


def test_a_schema_2_stamp_is_a_tree_built_without_overlay(overlaid: Env, capsys) -> None:
    """The tool before the overlay wrote schema 2 and copied no overlay: such a tree is stale once the checkout
    has overlay files, and is rebuilt; without overlay files it is current."""
    stamp_path = overlaid.project.megatron_dir / ".patchset-stamp.json"
    overlay = overlaid.project.overlay_dir
    os.rename(overlay, overlaid.project.root / "overlay-aside")
    assert cli(overlaid, "materialize") == 0
    data = json.loads(stamp_path.read_text())
    for key in ("overlay", "overlay_texts"):
        del data[key]
    data["schema"] = 2
    stamp_path.write_text(json.dumps(data))
    assert tree_status(overlaid.project).up_to_date  # no overlay then, none now
    os.rename(overlaid.project.root / "overlay-aside", overlay)
    st = tree_status(overlaid.project)
    assert not st.up_to_date and st.changed_overlay == {ALLOCATOR: "new", TEARDOWN: "new"}
    assert cli(overlaid, "materialize") == 0
    assert json.loads(stamp_path.read_text())["schema"] == 4 and tree_status(overlaid.project).up_to_date
    data = json.loads(stamp_path.read_text())
    data["schema"] = 5  # a newer tool's stamp: not read as anything
    stamp_path.write_text(json.dumps(data))
    capsys.readouterr()
    assert cli(overlaid, "status") == 2
    err = capsys.readouterr().err
    assert "is not one this tool wrote (schema 5" in err and "materialize --backup" in err


@pytest.mark.parametrize("inputs", ["0" * 64, "not a digest", None])
def test_a_schema_4_stamp_with_inputs_sha256_is_read_and_it_is_ignored(overlaid: Env, inputs: str | None,
                                                                       capsys) -> None:
    """Earlier tools wrote ``inputs_sha256`` (a digest of patches/ the tree recomputed on import): this one writes
    none, and reads a stamp that has one, whatever its value, as the same tree."""
    assert cli(overlaid, "materialize") == 0
    stamp_path = overlaid.project.megatron_dir / ".patchset-stamp.json"
    data = json.loads(stamp_path.read_text())
    assert data["schema"] == 4 and "inputs_sha256" not in data
    before = read_stamp(overlaid.project.root)
    stamp_path.write_text(json.dumps({**data, "inputs_sha256": inputs}))
    assert read_stamp(overlaid.project.root) == before
    assert tree_status(overlaid.project).up_to_date
    capsys.readouterr()
    assert cli(overlaid, "materialize") == 0 and "is up to date" in capsys.readouterr().out


def test_an_overlay_file_over_a_base_file_is_refused(overlaid: Env, capsys) -> None:
    assert cli(overlaid, "materialize") == 0
    before = tree_digest(overlaid.project.megatron_dir)
    overlaid.write_overlay({"megatron/core/alloc.py": "replaced = True\n"})
    capsys.readouterr()
    for verb in (["materialize"], ["check"], ["diff", "--series"]):
        assert cli(overlaid, *verb) == 2, verb
        err = capsys.readouterr().err
        assert "patches/overlay/megatron/core/alloc.py" in err and "only adds files" in err, err
        assert "Traceback" not in err
    assert tree_digest(overlaid.project.megatron_dir) == before


@pytest.mark.parametrize("entry", ["outside", "link", "binary", "built"])
def test_what_cannot_be_an_overlay_file_is_refused_with_a_sentence(overlaid: Env, entry: str, capsys) -> None:
    overlay = overlaid.project.overlay_dir
    name = {"outside": "README.md", "link": "megatron/core/link.py", "binary": "megatron/core/blob.py",
            "built": "megatron/core/helpers.so"}[entry]
    if entry == "outside":
        (overlay / name).write_text("notes\n")
    elif entry == "link":
        (overlay / name).symlink_to("maxpool_allocator.py")
    elif entry == "binary":
        (overlay / name).write_bytes(b"\xff\xfe\x00")
    else:
        (overlay / name).write_bytes(b"\x7fELF")
    capsys.readouterr()
    for verb in (["materialize"], ["status"], ["overlay"]):
        assert cli(overlaid, *verb) == 2, verb
        err = capsys.readouterr().err
        assert f"patches/overlay/{name}" in err and "Traceback" not in err, (verb, err)
    assert not overlaid.project.megatron_dir.exists()
    assert cli(overlaid, "lint") == 1  # the way out names it, with every other problem
    assert f"lint: overlay: patches/overlay/{name}" in capsys.readouterr().out


# --- status and edits


def test_status_marks_edits_of_overlay_files(overlaid: Env, capsys) -> None:
    assert cli(overlaid, "materialize") == 0
    tree = overlaid.project.root
    (tree / ALLOCATOR).write_text(OVERLAY_FILES[ALLOCATOR] + "POOL_SLOTS = 4\n")
    (tree / TEARDOWN).unlink()
    (tree / "megatron/core/new_module.py").write_text("NEW = 1\n")
    (tree / "megatron/core/__init__.py").write_text("VALUE = 2\n")
    capsys.readouterr()
    assert cli(overlaid, "status") == 1
    out = capsys.readouterr().out
    assert f"  modified {ALLOCATOR} (overlay)" in out
    assert f"  deleted  {TEARDOWN} (overlay)" in out
    assert "  added    megatron/core/new_module.py (overlay)" in out
    assert "  modified megatron/core/__init__.py\n" in out  # an upstream file: goes to a patch
    assert "stamp:   up to date" in out


# --- refresh


def test_refresh_writes_overlay_edits_back_and_leaves_the_patches_alone(overlaid: Env) -> None:
    assert cli(overlaid, "materialize") == 0
    before = patch_files(overlaid)
    tree = overlaid.project.root
    (tree / ALLOCATOR).write_text(OVERLAY_FILES[ALLOCATOR] + "POOL_SLOTS = 4\n")
    (tree / TEARDOWN).unlink()  # the last file of megatron/training/fork/
    (tree / "megatron/core/sub").mkdir()
    (tree / "megatron/core/sub/new_module.py").write_text("NEW = 1\n")
    assert cli(overlaid, "refresh", "--new", "unused", "--description", "d") == 0  # --new: nothing upstream
    assert patch_files(overlaid) == before  # every patch file and the series, byte for byte
    assert overlay_on_disk(overlaid) == {ALLOCATOR: OVERLAY_FILES[ALLOCATOR] + "POOL_SLOTS = 4\n",
                                         "megatron/core/sub/new_module.py": "NEW = 1\n"}
    assert not (overlaid.project.overlay_dir / "megatron/training").exists()  # emptied folders go too
    st = tree_status(overlaid.project)
    assert st.up_to_date and st.edits == {}
    assert refresh(overlaid.project, log=quiet) == ""  # nothing left to fold
    assert cli(overlaid, "materialize") == 0 and tree_status(overlaid.project).edits == {}


def test_refresh_splits_overlay_and_upstream_edits(overlaid: Env) -> None:
    materialize(overlaid.project, log=quiet)
    tree = overlaid.project.root
    alloc = tree / "megatron/core/alloc.py"
    alloc.write_text(alloc.read_text().replace("line_30 = 30\n", "line_30 = 30\nuse_pool = True\n"))
    (tree / TEARDOWN).write_text("def tear_down():\n    return 'cleaner'\n")
    (tree / "megatron/training/fork/helpers.py").write_text("HELP = 1\n")
    assert refresh(overlaid.project, log=quiet) == "alloc.patch"  # the owner of the upstream edit
    patch = (overlaid.project.patches_dir / "alloc.patch").read_text()
    assert "+use_pool = True" in patch and "teardown" not in patch and "helpers" not in patch
    on_disk = overlay_on_disk(overlaid)
    assert on_disk[TEARDOWN] == "def tear_down():\n    return 'cleaner'\n"
    assert on_disk["megatron/training/fork/helpers.py"] == "HELP = 1\n"
    assert tree_status(overlaid.project).up_to_date and tree_status(overlaid.project).edits == {}
    assert cli(overlaid, "lint") == 0


def test_refresh_with_a_new_file_in_an_empty_overlay(fake: Env) -> None:
    """The first overlay file of a checkout: patches/overlay/ is made."""
    materialize(fake.project, log=quiet)
    (fake.project.megatron_dir / "core" / "mine.py").write_text("MINE = 1\n")
    assert refresh(fake.project, log=quiet) == ""
    assert overlay_on_disk(fake) == {"megatron/core/mine.py": "MINE = 1\n"}
    assert fake.project.overlay_files() == ["megatron/core/mine.py"]
    assert tree_status(fake.project).up_to_date


def test_refresh_is_all_or_nothing_when_validation_fails(overlaid: Env, monkeypatch, capsys) -> None:
    materialize(overlaid.project, log=quiet)
    tree = overlaid.project.root
    (tree / ALLOCATOR).write_text("POOL = 'edited'\n")
    (tree / "megatron/core/alloc.py").write_text("changed = True\n")
    before, tree_before = patches_digest(overlaid), tree_digest(overlaid.project.megatron_dir)

    def broken(*_: object, **__: object) -> None:
        raise PatchsetError("the exported overlay and patches would not rebuild the queue's tree", "report it")

    monkeypatch.setattr(export_mod, "validate", broken)
    capsys.readouterr()
    assert cli(overlaid, "refresh") == 2
    assert patches_digest(overlaid) == before and tree_digest(overlaid.project.megatron_dir) == tree_before
    assert not list(overlaid.project.root.glob(".patchset-*"))


def test_refresh_interrupted_while_writing_leaves_patches_and_overlay_whole(overlaid: Env, monkeypatch) -> None:
    materialize(overlaid.project, log=quiet)
    (overlaid.project.root / ALLOCATOR).write_text("POOL = 'edited'\n")
    before = patches_digest(overlaid)
    real = export_mod.swap_in

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # Ctrl-C after the new patches/ was built, before it is swapped in

    monkeypatch.setattr(export_mod, "swap_in", interrupted)
    with pytest.raises(KeyboardInterrupt):
        refresh(overlaid.project, log=quiet)
    assert patches_digest(overlaid) == before
    assert not list(overlaid.project.root.glob(".patchset-tmp-*"))
    monkeypatch.setattr(export_mod, "swap_in", real)
    assert refresh(overlaid.project, log=quiet) == ""  # the edit is still there, and folds now
    assert overlay_on_disk(overlaid)[ALLOCATOR] == "POOL = 'edited'\n"


def test_an_overlay_edit_saved_in_patches_during_refresh_is_not_lost(overlaid: Env, monkeypatch, capsys) -> None:
    from hfsdp.patchset import refresh as refresh_mod

    materialize(overlaid.project, log=quiet)
    (overlaid.project.root / ALLOCATOR).write_text("POOL = 'tree'\n")
    source = overlaid.project.overlay_dir / TEARDOWN
    real = refresh_mod.plan_export

    def plan(*args: object, **kwargs: object):  # noqa: ANN202
        source.write_text("def tear_down():\n    return 'saved meanwhile'\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(refresh_mod, "plan_export", plan)
    capsys.readouterr()
    assert cli(overlaid, "refresh") == 2
    err = capsys.readouterr().err
    assert f"patches/overlay/{TEARDOWN}" in err and "changed while the replacement was being built" in err, err
    assert source.read_text() == "def tear_down():\n    return 'saved meanwhile'\n"
    assert (overlaid.project.overlay_dir / ALLOCATOR).read_text() == OVERLAY_FILES[ALLOCATOR]


def test_refresh_refuses_edits_on_a_tree_built_from_another_overlay(overlaid: Env, capsys) -> None:
    cli(overlaid, "materialize")
    (overlaid.project.root / ALLOCATOR).write_text("POOL = 'mine'\n")
    overlaid.write_overlay({TEARDOWN: "def tear_down():\n    return 'pulled'\n"})  # a pull
    before = patches_digest(overlaid)
    capsys.readouterr()
    assert cli(overlaid, "refresh") == 2
    assert "diff > my.patch" in capsys.readouterr().err
    assert patches_digest(overlaid) == before


def test_refresh_reserved_name(fake: Env, capsys) -> None:
    cli(fake, "materialize")
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 4\n")
    capsys.readouterr()
    assert cli(fake, "refresh", "--new", "overlay", "--description", "d") == 2
    err = capsys.readouterr().err
    assert "'overlay' is not a patch name" in err and "not 'overlay'" in err


def test_refresh_of_a_series_that_still_creates_files(fake: Env) -> None:
    """Until a series is moved to the overlay, edits of files a patch creates still fold into that patch."""
    creates = ("diff --git a/megatron/core/made.py b/megatron/core/made.py\nnew file mode 100644\n"
               "--- /dev/null\n+++ b/megatron/core/made.py\n@@ -0,0 +1 @@\n+MADE = 1\n")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                       "made.patch": patch_text("Make a file", creates)})
    materialize(fake.project, log=quiet)
    (fake.project.megatron_dir / "core" / "made.py").write_text("MADE = 2\n")
    assert refresh(fake.project, log=quiet) == "made.patch"
    assert "+MADE = 2" in (fake.project.patches_dir / "made.patch").read_text()
    assert fake.project.overlay_files() == []


# --- diff


def test_diff_shows_overlay_edits_against_the_tree_as_built(overlaid: Env, capsys) -> None:
    cli(overlaid, "materialize")
    tree = overlaid.project.root
    (tree / ALLOCATOR).write_text(OVERLAY_FILES[ALLOCATOR].replace("POOL_LANES = 2", "POOL_LANES = 3"))
    (tree / "megatron/core/new_module.py").write_text("NEW = 1\n")
    overlaid.write_overlay({TEARDOWN: "def tear_down():\n    return 'pulled'\n"})  # a pull, after the build
    capsys.readouterr()
    assert cli(overlaid, "diff") == 0
    diff = capsys.readouterr().out
    assert "-POOL_LANES = 2\n+POOL_LANES = 3" in diff
    assert "new file mode" in diff and "+NEW = 1" in diff
    assert "teardown" not in diff and "pulled" not in diff  # nothing that reverts the pulled change
    work = tree / "applied"
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    for path, text in OVERLAY_FILES.items():  # the tree as built, then the diff: the edited tree
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
    subprocess.run(["git", "apply", "-"], cwd=work, input=diff, text=True, check=True)
    assert (work / ALLOCATOR).read_text() == (tree / ALLOCATOR).read_text()


def test_diff_series_shows_the_overlay_then_the_patches(overlaid: Env, capsys) -> None:
    capsys.readouterr()
    assert cli(overlaid, "diff", "--series") == 0
    out = capsys.readouterr().out
    files = [line.split(" b/")[1] for line in out.splitlines() if line.startswith("diff --git ")]
    assert files == [ALLOCATOR, TEARDOWN, "megatron/core/alloc.py", "megatron/training/train.py"]
    head = out[:out.index("megatron/core/alloc.py")]
    assert head.count("new file mode") == 2 and "+class MaxPoolAllocator:" in head


# --- the Project API and the overlay verb


def test_project_lists_the_overlay_and_the_overlay_verb_prints_it(overlaid: Env, capsys) -> None:
    overlaid.write_overlay({"megatron/core/data/table.json": "{}\n"})
    cache = overlaid.project.overlay_dir / "megatron/core/__pycache__"
    cache.mkdir()
    (cache / "maxpool_allocator.cpython-312.pyc").write_bytes(b"\0")  # caches are not overlay files
    expected = ["megatron/core/data/table.json", ALLOCATOR, TEARDOWN]
    assert overlaid.project.overlay_dir == overlaid.project.root / "patches" / "overlay"
    assert overlaid.project.overlay_files() == expected
    capsys.readouterr()
    assert cli(overlaid, "overlay") == 0
    assert capsys.readouterr().out.splitlines() == expected
    for path in expected:  # each is where `materialize` puts it, relative to the checkout
        assert not (overlaid.project.root / path).exists()
    materialize(overlaid.project, log=quiet)
    assert all((overlaid.project.root / path).is_file() for path in expected)


def test_a_stamp_with_forged_overlay_texts_is_refused(overlaid: Env, capsys) -> None:
    cli(overlaid, "materialize")
    stamp_path = overlaid.project.megatron_dir / ".patchset-stamp.json"
    data = json.loads(stamp_path.read_text())
    data["overlay_texts"][ALLOCATOR] = "forged\n"
    stamp_path.write_text(json.dumps(data))
    capsys.readouterr()
    assert cli(overlaid, "diff") == 2
    assert "overlay texts do not match" in capsys.readouterr().err


def test_materialize_refuses_over_an_edited_overlay_file(overlaid: Env) -> None:
    """An edit of an overlay file is an edit like any other: a rebuild never overwrites it."""
    materialize(overlaid.project, log=quiet)
    (overlaid.project.root / TEARDOWN).write_text("mine = True\n")
    overlaid.write_overlay({ALLOCATOR: "pulled = True\n"})
    with pytest.raises(PatchsetError) as info:
        materialize(overlaid.project, log=quiet)
    assert TEARDOWN in info.value.cause
    assert (overlaid.project.root / TEARDOWN).read_text() == "mine = True\n"


def test_patch_names_reserve_overlay(fake: Env) -> None:
    (fake.project.patches_dir / "overlay.patch").write_text(patch_text("x", TRAIN_PATCH))
    (fake.project.patches_dir / "series").write_text("overlay.patch\n")
    with pytest.raises(SeriesError, match="is not a patch name"):
        fake.project.series()
