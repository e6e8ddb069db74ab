"""Nothing lost: each way the patch tooling once lost or silently reverted a user's work.

Driven through the command line (``hfsdp.patchset.cli.main``), as a user would meet them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from patchset_fake import ALLOC_PATCH, HEADER, Env, patch_text, save_during_build, tree_digest

from hfsdp.patchset.cli import main


def cli(env: Env, *args: str) -> int:
    return main(["--root", str(env.project.root), *args])


def patches_digest(env: Env) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(env.project.patches_dir.iterdir())}


def make_stale(env: Env) -> None:
    """A series change that touches no file of the tree (as a pull of a reworded header would)."""
    env.series_with(desc="Add maxpool flag, reworded")


def test_rebuild_keeps_what_the_tool_did_not_make(fake: Env, capsys) -> None:
    assert cli(fake, "materialize") == 0
    tree = fake.project.megatron_dir
    (tree / "NOTES.md").write_text("my notes\n")  # outside core/ and training/
    (tree / "legacy").mkdir()
    (tree / "legacy" / "old.py").write_text("x = 1\n")
    (tree / "core" / "helpers.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF built by me")
    (tree / "core" / "build.lock").write_text("")
    (tree / "core" / "mine.py").symlink_to("alloc.py")
    (tree / "training" / "scratch").mkdir()  # empty folder
    before = {p: tree_digest(tree).get(p) for p in ("NOTES.md", "legacy/old.py",
                                                      "core/helpers.cpython-312-x86_64-linux-gnu.so")}
    capsys.readouterr()
    assert cli(fake, "status") == 0
    out = capsys.readouterr().out
    assert "edits:   none" in out and "kept:    6 entries not made by this tool" in out
    make_stale(fake)
    assert cli(fake, "materialize") == 0  # stale stamp: a rebuild
    assert {p: tree_digest(tree).get(p) for p in before} == before
    assert (tree / "core" / "build.lock").exists() and os.readlink(tree / "core" / "mine.py") == "alloc.py"
    assert (tree / "training" / "scratch").is_dir()
    assert "maxpool = True" in (tree / "core" / "alloc.py").read_text()  # and the rebuild happened


def test_rebuild_refuses_when_the_new_tree_needs_a_kept_path(fake: Env, capsys) -> None:
    cli(fake, "materialize")
    tree = fake.project.megatron_dir
    (tree / "core" / "extra.so").write_bytes(b"mine")
    creates = ("diff --git a/megatron/core/extra.so b/megatron/core/extra.so\nnew file mode 100644\n"
               "--- /dev/null\n+++ b/megatron/core/extra.so\n@@ -0,0 +1 @@\n+theirs\n")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                       "extra.patch": patch_text("Add a file", creates)})
    capsys.readouterr()
    assert cli(fake, "materialize") == 2
    err = capsys.readouterr().err
    assert "megatron/core/extra.so" in err and "--backup" in err
    assert (tree / "core" / "extra.so").read_bytes() == b"mine"


def test_an_edit_saved_during_a_build_is_not_lost(fake: Env, monkeypatch, capsys) -> None:
    cli(fake, "materialize")
    make_stale(fake)
    edited = fake.project.megatron_dir / "core" / "__init__.py"
    save_during_build(monkeypatch, edited, "VALUE = 42  # saved in the editor while the tree was rebuilt\n")
    capsys.readouterr()
    assert cli(fake, "materialize") != 0
    assert "megatron/core/__init__.py" in capsys.readouterr().err
    assert edited.read_text() == "VALUE = 42  # saved in the editor while the tree was rebuilt\n"


def test_export_refuses_to_write_part_of_its_output(fake: Env, tmp_path: Path, capsys) -> None:
    import subprocess

    queue = tmp_path / "q"
    assert cli(fake, "queue", "--dir", str(queue)) == 0
    before = patches_digest(fake)
    git = ["git", "-C", str(queue), "-c", "user.name=t", "-c", "user.email=t@t"]
    # Rewrite the earlier patch, then give the later commit a subject that is not a patch name.
    alloc = queue / "megatron" / "core" / "alloc.py"
    subprocess.run([*git, "checkout", "-q", "HEAD~1"], check=True)
    alloc.write_text(alloc.read_text().replace("line_5 = 5\n", "line_5 = 55\n"))
    subprocess.run([*git, "commit", "-q", "-a", "--amend", "--no-edit"], check=True)
    subprocess.run([*git, "cherry-pick", "queue"], check=True, capture_output=True)
    subprocess.run([*git, "commit", "-q", "--amend", "-m", "Fork training (reworded)"], check=True)
    subprocess.run([*git, "branch", "-q", "-f", "queue", "HEAD"], check=True)
    subprocess.run([*git, "checkout", "-q", "queue"], check=True)
    capsys.readouterr()
    assert cli(fake, "export", "--queue", str(queue)) == 2
    assert "subject" in capsys.readouterr().err
    assert patches_digest(fake) == before


def test_following_the_does_not_apply_advice_loses_no_patch(fake: Env, tmp_path: Path, capsys) -> None:
    """A broken context line: materialize's advice (queue, fix, continue, export) must work."""
    cli(fake, "materialize")
    fake.series_with(ALLOC_PATCH.replace(" line_20 = 20\n", " line_20 = 2000\n"))
    capsys.readouterr()
    assert cli(fake, "materialize") == 2
    advice = capsys.readouterr().err
    assert "queue --dir DIR" in advice and "queue --continue --dir DIR" in advice and "export --queue DIR" in advice
    queue = tmp_path / "pq"
    assert cli(fake, "queue", "--dir", str(queue)) == 2  # stops at alloc.patch, the queue is usable
    stopped = capsys.readouterr().err
    assert "alloc.patch does not apply" in stopped and ".rej" in stopped
    # Before the fix, export refuses: the queue is stopped (the old tool deleted train.patch here).
    before = patches_digest(fake)
    assert cli(fake, "export", "--queue", str(queue)) == 2
    assert "stopped at alloc.patch" in capsys.readouterr().err and patches_digest(fake) == before
    # The user applies the rejected hunk by hand, as the message says.
    alloc = queue / "megatron" / "core" / "alloc.py"
    alloc.write_text(alloc.read_text().replace("line_20 = 20\n", "line_20 = 20\nmaxpool = True\n"))
    for rej in queue.rglob("*.rej"):
        rej.unlink()
    assert cli(fake, "queue", "--continue", "--dir", str(queue)) == 0
    assert cli(fake, "export", "--queue", str(queue)) == 0
    names = [n for n in (fake.project.patches_dir / "series").read_text().split() if n.endswith(".patch")]
    assert names == ["alloc.patch", "train.patch"]
    assert cli(fake, "materialize") == 0
    assert "maxpool = True" in (fake.project.megatron_dir / "core" / "alloc.py").read_text()
    assert "'fork'" in (fake.project.megatron_dir / "training" / "train.py").read_text()


def test_export_of_a_queue_lacking_patches_deletes_none(fake: Env, tmp_path: Path, capsys) -> None:
    import subprocess

    queue = tmp_path / "q"
    cli(fake, "queue", "--dir", str(queue))
    subprocess.run(["git", "-C", str(queue), "reset", "-q", "--hard", "HEAD~1"], check=True)  # train.patch gone
    before = patches_digest(fake)
    capsys.readouterr()
    assert cli(fake, "export", "--queue", str(queue)) == 2
    err = capsys.readouterr().err
    assert "train.patch" in err and "--drop train.patch" in err
    assert patches_digest(fake) == before
    assert cli(fake, "export", "--queue", str(queue), "--drop", "train.patch") == 0  # the advice works
    assert not (fake.project.patches_dir / "train.patch").exists()


def test_diff_after_a_pull_shows_only_the_local_edit(fake: Env, capsys) -> None:
    cli(fake, "materialize")
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 2  # mine\n")
    fake.series_with(ALLOC_PATCH.replace("+maxpool = True", "+maxpool = 'pulled'"))
    capsys.readouterr()
    assert cli(fake, "diff") == 0
    diff = capsys.readouterr().out
    assert "+VALUE = 2  # mine" in diff
    assert "maxpool" not in diff and "alloc.py" not in diff  # nothing that reverts the pulled change


def test_stamp_of_the_wrong_shape_is_a_sentence(fake: Env, capsys) -> None:
    cli(fake, "materialize")
    stamp = fake.project.megatron_dir / ".patchset-stamp.json"
    for text in ("[]", "null", '{"schema": 1, "patches": 3}', "{broken"):
        stamp.write_text(text)
        for verb in ("status", "materialize", "diff"):
            capsys.readouterr()
            assert cli(fake, verb) == 2, (text, verb)
            err = capsys.readouterr().err
            assert "is not one this tool wrote" in err and "Traceback" not in err, (text, verb, err)
    assert cli(fake, "materialize", "--backup") == 0  # the advice works, and keeps the old tree
    assert len(list(fake.project.root.glob("megatron.bak-*"))) == 1
    assert cli(fake, "status") == 0


@pytest.mark.parametrize("verb", [["status"], ["check"], ["diff"], ["lint"], ["diff", "--series"]])
def test_read_only_verbs_write_nothing_in_the_checkout(fake: Env, verb: list[str]) -> None:
    """The checkout is made read-only (which binds users other than root) and watched while the
    verb runs (which catches a scratch folder that comes and goes, also as root)."""
    import threading

    cli(fake, "materialize")
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 3\n")
    root = fake.project.root
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    digest = tree_digest(root)
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(p.name for p in root.iterdir())
            done.wait(0.002)

    watcher = threading.Thread(target=watch)
    os.chmod(root, 0o555)
    watcher.start()
    try:
        assert cli(fake, *verb) in (0, 1)
    finally:
        done.set()
        watcher.join()
        os.chmod(root, 0o755)
    assert sorted(seen) == sorted(p.name for p in root.iterdir()), "a scratch folder appeared in the checkout"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    assert tree_digest(root) == digest


def test_killed_builds_leave_nothing_behind_for_long(fake: Env, capsys) -> None:
    cli(fake, "materialize")
    root = fake.project.root
    (root / ".patchset-tmp-abc" / "queue").mkdir(parents=True)  # a build killed mid-way
    import shutil

    shutil.copytree(fake.project.megatron_dir, root / ".patchset-old-megatron-1-2")  # killed after the swap
    capsys.readouterr()
    assert cli(fake, "status") == 1
    out = capsys.readouterr().out
    assert ".patchset-tmp-abc" in out and ".patchset-old-megatron-1-2" in out
    make_stale(fake)
    assert cli(fake, "materialize") == 0
    assert not list(root.glob(".patchset-tmp-*")) and not list(root.glob(".patchset-old-*"))


def test_a_parked_tree_is_put_back_when_the_swap_did_not_finish(fake: Env) -> None:
    cli(fake, "materialize")
    root = fake.project.root
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 7  # mine\n")
    os.rename(fake.project.megatron_dir, root / ".patchset-old-megatron-1-2")  # killed between the renames
    assert cli(fake, "materialize") == 0  # restored first; up to date, so the edit is left alone
    assert (fake.project.megatron_dir / "core" / "__init__.py").read_text() == "VALUE = 7  # mine\n"
    assert not list(root.glob(".patchset-old-*"))


def test_a_parked_tree_with_edits_is_kept_as_a_backup(fake: Env) -> None:
    import shutil

    cli(fake, "materialize")
    root = fake.project.root
    shutil.copytree(fake.project.megatron_dir, root / ".patchset-old-megatron-1-2")
    (root / ".patchset-old-megatron-1-2" / "core" / "__init__.py").write_text("VALUE = 8  # mine\n")
    make_stale(fake)
    assert cli(fake, "materialize") == 0
    backups = list(root.glob("megatron.bak-*"))
    assert len(backups) == 1 and (backups[0] / "core" / "__init__.py").read_text() == "VALUE = 8  # mine\n"


def test_one_writer_at_a_time(fake: Env, capsys) -> None:
    import fcntl

    cli(fake, "materialize")
    make_stale(fake)
    with open(fake.project.root / ".patchset.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another writer is running
        held.write("`scripts/patchset export` (pid 4242)")
        held.flush()
        capsys.readouterr()
        for verb in (["materialize"], ["refresh"], ["export", "--queue", "/nowhere"]):
            assert cli(fake, *verb) == 2, verb
            err = capsys.readouterr().err
            assert "pid 4242" in err and "wait for it to finish" in err, err
    assert cli(fake, "materialize") == 0  # the lock ends with its holder


# --- Patch names: one rule ([Note: patch names] in series.py), refused before anything is written.

BAD_NAMES = ["#x", "a#b", "Upper", "tab\tname", "st*r?", "a..b", "../x", "x/y", "", "a b", ".hidden"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_refresh_new_refuses_a_name_that_is_not_a_patch_name(fake: Env, name: str, capsys) -> None:
    """`refresh --new '#x'` once wrote the series line '#x.patch', a comment: the edit vanished from the series."""
    cli(fake, "materialize")
    init = fake.project.megatron_dir / "core" / "__init__.py"
    init.write_text("VALUE = 6  # mine\n")
    before = patches_digest(fake)
    capsys.readouterr()
    assert cli(fake, "refresh", "--new", name, "--description", "d") == 2
    err = capsys.readouterr().err
    assert f"--new {name!r} is not a patch name" in err and "Traceback" not in err, err
    assert patches_digest(fake) == before  # no patch file, no series change
    assert init.read_text() == "VALUE = 6  # mine\n"
    assert cli(fake, "refresh", "--new", "value-six", "--description", "d") == 0  # a good name still works
    assert "+VALUE = 6  # mine" in (fake.project.patches_dir / "value-six.patch").read_text()
    assert cli(fake, "status") == 0


def test_refresh_patch_and_export_drop_refuse_names_that_are_not_patch_names(fake: Env, tmp_path: Path,
                                                                             capsys) -> None:
    cli(fake, "materialize")
    (fake.project.megatron_dir / "core" / "alloc.py").write_text("changed = True\n")
    queue = tmp_path / "q"
    assert cli(fake, "queue", "--dir", str(queue)) == 0
    before = patches_digest(fake)
    for args in (["refresh", "--patch", "#x"], ["refresh", "--patch", "Alloc"],
                 ["export", "--queue", str(queue), "--drop", "a#b.patch"],
                 ["export", "--queue", str(queue), "--drop", "../series"]):
        capsys.readouterr()
        assert cli(fake, *args) == 2, args
        err = capsys.readouterr().err
        assert f"{args[-2]} {args[-1]!r} is not a patch name" in err and "Traceback" not in err, (args, err)
        assert patches_digest(fake) == before
    assert (fake.project.megatron_dir / "core" / "alloc.py").read_text() == "changed = True\n"


def test_patch_names_on_the_command_line_take_either_form(fake: Env, tmp_path: Path) -> None:
    """NAME or NAME.patch, the same for --new, --patch and --drop (--new x.patch once made x.patch.patch or failed)."""
    cli(fake, "materialize")
    init = fake.project.megatron_dir / "core" / "__init__.py"
    init.write_text("VALUE = 2\n")
    assert cli(fake, "refresh", "--new", "value.patch", "--description", "d") == 0
    init.write_text("VALUE = 3\n")
    assert cli(fake, "refresh", "--patch", "value") == 0
    assert "+VALUE = 3" in (fake.project.patches_dir / "value.patch").read_text()
    assert not list(fake.project.patches_dir.glob("*.patch.patch"))
    queue = tmp_path / "q"
    assert cli(fake, "queue", "--dir", str(queue)) == 0
    subprocess.run(["git", "-C", str(queue), "reset", "-q", "--hard", "HEAD~1"], check=True)
    assert cli(fake, "export", "--queue", str(queue), "--drop", "value") == 0
    assert not (fake.project.patches_dir / "value.patch").exists()


@pytest.mark.parametrize("subject", ["Fork-training", "train#2", "train..x", "train\ttab", "train.patch.patch"])
def test_export_refuses_a_queue_commit_subject_that_is_not_a_patch_name(fake: Env, tmp_path: Path, subject: str,
                                                                        capsys) -> None:
    queue = tmp_path / "q"
    assert cli(fake, "queue", "--dir", str(queue)) == 0
    git = ["git", "-C", str(queue), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "-q", "--amend", "-m", f"{subject}\n\nDescription: renamed\n"], check=True)
    before = patches_digest(fake)
    capsys.readouterr()
    assert cli(fake, "export", "--queue", str(queue), "--drop", "train.patch") == 2
    err = capsys.readouterr().err
    assert "is not a patch name" in err and "Traceback" not in err, err
    assert patches_digest(fake) == before


@pytest.mark.parametrize("subject", ["added-thing", "added-thing.patch"])
def test_a_subject_with_or_without_its_suffix_names_one_patch(fake: Env, tmp_path: Path, subject: str) -> None:
    """A queue commit's subject is the patch name, written with ``.patch`` or without, as on the command
    line: never ``added-thing.patch.patch``."""
    queue = tmp_path / "q"
    assert cli(fake, "queue", "--dir", str(queue)) == 0
    git = ["git", "-C", str(queue), "-c", "user.name=t", "-c", "user.email=t@t"]
    header = HEADER.format(desc="Renamed")  # export writes a patch only with a valid DEP-3 header
    subprocess.run([*git, "commit", "-q", "--amend", "-m", f"{subject}\n\n{header}"], check=True)
    assert cli(fake, "export", "--queue", str(queue), "--drop", "train.patch") == 0
    names = (fake.project.patches_dir / "series").read_text().split()
    assert "added-thing.patch" in names and not any(n.endswith(".patch.patch") for n in names), names
    assert (fake.project.patches_dir / "added-thing.patch").is_file()
    assert not list(fake.project.patches_dir.glob("*.patch.patch"))


@pytest.mark.parametrize(("line", "shown"), [("x.patch.patch", "'x.patch.patch'"),
                                             ("Train.patch", "'Train.patch'"), ("a#b.patch", "'#' starts a comment"),
                                             ("tr ain.patch", "'tr ain.patch'"), ("x..y.patch", "'x..y.patch'")])
def test_a_series_line_that_is_not_a_patch_name_is_named(fake: Env, line: str, shown: str, capsys) -> None:
    (fake.project.patches_dir / line.split("#")[0]).write_text(patch_text("Fork training", "diff --git a/x b/x\n"))
    (fake.project.patches_dir / "series").write_text(f"# test series\nalloc.patch\n{line}\n")
    for verb in (["status"], ["lint"], ["materialize"], ["check"]):
        capsys.readouterr()
        assert cli(fake, *verb) == 2, verb
        err = capsys.readouterr().err
        assert "series:3:" in err and "is not a patch name" in err and shown in err, (verb, err)
        assert "Traceback" not in err
    assert not fake.project.megatron_dir.exists()


def test_a_new_patch_never_overwrites_an_unlisted_patch_file(fake: Env, capsys) -> None:
    cli(fake, "materialize")
    mine = fake.project.patches_dir / "wip.patch"
    mine.write_text("my only copy of a change\n")  # in patches/, not (yet) in the series
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 7\n")
    before = patches_digest(fake)
    capsys.readouterr()
    assert cli(fake, "refresh", "--new", "wip", "--description", "d") == 2
    err = capsys.readouterr().err
    assert "wip.patch" in err and "not in patches/series" in err, err
    assert patches_digest(fake) == before


# --- A symlinked megatron/ (`mv megatron X; ln -s X megatron`): refused, never read or written through.

def link_tree(env: Env) -> Path:
    """mv megatron X; ln -s X megatron. Returns the real folder."""
    root = env.project.root
    os.rename(root / "megatron", root / "X")
    os.symlink("X", root / "megatron")
    return root / "X"


def checkout_names(env: Env) -> list[str]:
    return sorted(p.name for p in env.project.root.iterdir() if p.name != ".patchset.lock")


LINK_CASES = [(["status"], False), (["diff"], False), (["refresh"], False),
              (["refresh", "--new", "mine", "--description", "d"], False), (["materialize"], False),
              (["materialize"], True), (["diff"], True)]


@pytest.mark.parametrize(("verb", "stale"), LINK_CASES)
def test_a_symlinked_tree_is_refused_and_left_alone(fake: Env, verb: list[str], stale: bool, capsys) -> None:
    """Through the link every file looked deleted: status listed them all, diff deleted them all."""
    cli(fake, "materialize")
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 4  # mine\n")
    real = link_tree(fake)
    if stale:
        make_stale(fake)
    before, patches, names = tree_digest(real), patches_digest(fake), checkout_names(fake)
    capsys.readouterr()
    assert cli(fake, *verb) == 2
    out, err = capsys.readouterr()
    assert f"{fake.project.megatron_dir} is a symbolic link to {real}" in err and "Traceback" not in err, err
    assert "deleted  megatron/" not in out + err and "deleted file mode" not in out  # no bogus listing or diff
    assert tree_digest(real) == before and (real / "core" / "__init__.py").read_text() == "VALUE = 4  # mine\n"
    assert os.readlink(fake.project.megatron_dir) == "X"
    assert patches_digest(fake) == patches and checkout_names(fake) == names


@pytest.mark.parametrize("verb", [["status"], ["diff"], ["refresh"], ["materialize"]])
def test_a_symlinked_folder_inside_the_tree_is_refused(fake: Env, verb: list[str], capsys) -> None:
    cli(fake, "materialize")
    core = fake.project.megatron_dir / "core"
    real = fake.project.root / "core-elsewhere"
    os.rename(core, real)
    os.symlink(real, core)
    make_stale(fake)  # so that materialize would rebuild
    before, patches = tree_digest(real), patches_digest(fake)
    capsys.readouterr()
    assert cli(fake, *verb) == 2
    out, err = capsys.readouterr()
    assert f"{core} is a symbolic link to {real}" in err and "Traceback" not in err, err
    assert "deleted  megatron/" not in out + err and "deleted file mode" not in out
    assert tree_digest(real) == before and os.readlink(core) == str(real) and patches_digest(fake) == patches


def test_verbs_that_do_not_read_the_tree_work_beside_a_symlinked_one(fake: Env, tmp_path: Path) -> None:
    cli(fake, "materialize")
    real = link_tree(fake)
    before = tree_digest(real)
    queue = tmp_path / "q"
    for verb in (["check"], ["lint"], ["diff", "--series"], ["queue", "--dir", str(queue)],
                 ["export", "--queue", str(queue)]):
        assert cli(fake, *verb) == 0, verb
    assert tree_digest(real) == before and os.readlink(fake.project.megatron_dir) == "X"


def test_an_up_to_date_materialize_cleans_up_after_a_killed_run(fake: Env, capsys) -> None:
    import fcntl
    import shutil

    cli(fake, "materialize")
    root = fake.project.root
    (root / ".patchset-tmp-abc" / "queue").mkdir(parents=True)  # a build killed mid-way
    shutil.copytree(fake.project.megatron_dir, root / ".patchset-old-megatron-1-2")  # killed after the swap
    with open(root / ".patchset.lock", "w") as held:  # while another writer runs, they may be its work: kept
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        capsys.readouterr()
        assert cli(fake, "materialize") == 0
        assert "is up to date" in capsys.readouterr().out
        assert (root / ".patchset-tmp-abc").is_dir() and (root / ".patchset-old-megatron-1-2").is_dir()
    assert cli(fake, "status") == 1
    assert cli(fake, "materialize") == 0  # up to date, and the lock is free: it cleans up
    out = capsys.readouterr().out
    assert "removed .patchset-tmp-abc" in out and "removed .patchset-old-megatron-1-2" in out
    assert "is up to date" in out
    assert not list(root.glob(".patchset-tmp-*")) and not list(root.glob(".patchset-old-*"))
    assert cli(fake, "status") == 0


def test_patches_moved_aside_by_a_killed_run_are_put_back(overlaid: Env, capsys) -> None:
    root = overlaid.project.root
    cli(overlaid, "materialize")
    before = tree_digest(overlaid.project.patches_dir)
    os.rename(overlaid.project.patches_dir, root / ".patchset-old-patches-1-2")  # killed between the renames
    capsys.readouterr()
    for verb in ("status", "lint", "diff"):
        assert cli(overlaid, verb) == 2
        err = capsys.readouterr().err
        assert "patches/ is missing: a writing command moved it aside to .patchset-old-patches-1-2" in err
        assert "`scripts/patchset materialize` puts it back first" in err
    assert cli(overlaid, "materialize") == 0
    assert "restored patches/ from .patchset-old-patches-1-2" in capsys.readouterr().out
    assert tree_digest(overlaid.project.patches_dir) == before and cli(overlaid, "status") == 0


def _killed_refresh(env: Env, after_swap: bool) -> tuple[bytes, dict[str, bytes]]:
    """A refresh of an edit, killed after writing its new stamp, before (or after) swapping patches/ in: the
    state it leaves, made by hand. Returns (the edited file's bytes, patches/ as the refresh wrote it)."""
    cli(env, "materialize")
    tree = env.project.megatron_dir
    (tree / "core" / "__init__.py").write_text("VALUE = 9  # mine\n")
    stamp, old = tree / ".patchset-stamp.json", patches_digest(env)
    old_stamp, saved = stamp.read_bytes(), {p.name: p.read_bytes() for p in env.project.patches_dir.iterdir()
                                            if p.is_file()}
    assert cli(env, "refresh", "--patch", "alloc") == 0
    new = patches_digest(env)
    os.rename(stamp, tree / ".patchset-stamp.next.json")
    stamp.write_bytes(old_stamp)
    if not after_swap:
        for name, data in saved.items():
            (env.project.patches_dir / name).write_bytes(data)
        assert patches_digest(env) == old
    return (tree / "core" / "__init__.py").read_bytes(), new if after_swap else old


@pytest.mark.parametrize("after_swap", [True, False])
def test_a_refresh_killed_around_its_swap(fake: Env, after_swap: bool, capsys) -> None:
    """Killed after patches/ was written: the next writer makes the new stamp the stamp (the edit is in the
    patch now); killed before: the new stamp goes, the edit is still an edit, and refresh folds it again."""
    edited, patches = _killed_refresh(fake, after_swap)
    capsys.readouterr()
    assert cli(fake, "status") == 1
    assert ".patchset-stamp.next.json: left by a killed run" in capsys.readouterr().out
    assert cli(fake, "refresh", "--patch", "alloc") == 0
    out = capsys.readouterr().out
    assert ("finished the stamp of a killed refresh" if after_swap else "removed the stamp of a refresh killed") in out
    assert (fake.project.megatron_dir / "core" / "__init__.py").read_bytes() == edited
    assert b"+VALUE = 9  # mine" in (fake.project.patches_dir / "alloc.patch").read_bytes()
    assert after_swap is (patches_digest(fake) == patches)
    assert cli(fake, "status") == 0 and not list(fake.project.megatron_dir.glob(".patchset-stamp.next*"))


def test_exporting_a_queue_twice_writes_nothing_the_second_time(fake: Env, tmp_path: Path, capsys,
                                                                  monkeypatch) -> None:
    """A second export of the same queue (or one after an export killed once it wrote patches/) finds
    patches/ holding what it exports: nothing is written, not even a new Last-Update."""
    queue = tmp_path / "q"
    cli(fake, "queue", "--dir", str(queue))
    (queue / "megatron/core/__init__.py").write_text("VALUE = 2\n")
    subprocess.run(["git", "-C", str(queue), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam",
                    "value-two\n\nDescription: Value two\nOrigin: vendor, hfsdp\nBug: none\nForwarded: no\n"
                    "Applied-Upstream: no\nLast-Update: 2020-01-01"], check=True)
    assert cli(fake, "export", "--queue", str(queue)) == 0
    first = patches_digest(fake)
    assert b"Last-Update: 2026-" in first["value-two.patch"]  # a new patch: dated by the export
    capsys.readouterr()
    from hfsdp.patchset import export as export_mod

    calls: list[str] = []
    real_holds = export_mod.holds
    monkeypatch.setattr(export_mod, "holds", lambda *a: calls.append("holds") or real_holds(*a))
    monkeypatch.setattr(export_mod, "validate", lambda *a: calls.append("validate"))
    assert cli(fake, "export", "--queue", str(queue)) == 0
    assert "patches/ already holds what" in capsys.readouterr().out
    assert patches_digest(fake) == first
    assert calls == ["holds"]  # read once; nothing is rebuilt for an export that writes nothing


def test_an_old_tree_that_cannot_be_deleted_is_named_as_kept_and_the_new_tree_stays(fake: Env, monkeypatch,
                                                                                    capsys) -> None:
    """The swap put the new tree in place; deleting the old one failed (an immutable file, say). The
    message says exactly that, and what is left of the old tree is a backup the user can see."""
    import shutil as real_shutil

    from hfsdp.patchset import guarded_swap

    assert cli(fake, "materialize") == 0
    fake.series_with(ALLOC_PATCH.replace("+maxpool = True", "+maxpool = 'pulled'"))
    rmtree = real_shutil.rmtree

    def refuse_old(path, *args, **kwargs):
        if Path(path).name.startswith(guarded_swap.OLD_PREFIX):
            raise PermissionError(1, "Operation not permitted", str(Path(path) / "core" / "fp8_utils.py"))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(guarded_swap.shutil, "rmtree", refuse_old)
    capsys.readouterr()
    assert cli(fake, "materialize") == 2
    err = capsys.readouterr().err
    (kept,) = fake.project.root.glob("megatron.bak-*")
    assert "is the new one; the old one could not be deleted (Operation not permitted" in err, err
    assert str(kept) in err and "nothing was left half-written" not in err
    # The file that could not be deleted is named where it is now (the parked folder is gone).
    assert f"{kept / 'core' / 'fp8_utils.py'}), and what is left" in err and guarded_swap.OLD_PREFIX not in err, err
    assert "maxpool = 'pulled'" in (fake.project.megatron_dir / "core" / "alloc.py").read_text()
    assert "maxpool = True" in (kept / "core" / "alloc.py").read_text()
    monkeypatch.setattr(guarded_swap.shutil, "rmtree", rmtree)
    assert cli(fake, "status") == 0  # up to date; the backup is the user's, no leftover of a killed run


@pytest.mark.parametrize("step", ["park-old", "place-new"])
@pytest.mark.parametrize("code", ["EBUSY", "EACCES"])
def test_a_tree_that_cannot_be_renamed_stays_the_old_one_and_the_message_says_so(fake: Env, monkeypatch, capsys,
                                                                                  step: str, code: str) -> None:
    """Renaming megatron/ aside (``park-old``: a mount point, a folder that cannot be written) or the new tree
    into its place (``place-new``) fails: megatron/ is the old tree, as it was, the new one is gone, no
    leftover of the swap remains, and the message says exactly that (no traceback for EBUSY either)."""
    import errno

    from hfsdp.patchset import guarded_swap

    assert cli(fake, "materialize") == 0
    before = tree_digest(fake.project.megatron_dir)
    fake.series_with(ALLOC_PATCH.replace("+maxpool = True", "+maxpool = 'pulled'"))
    tree = str(fake.project.megatron_dir)
    real = {name: getattr(os, name) for name in ("rename", "replace")}

    def refusing(name: str):
        def call(src, dst, *args, **kwargs):
            refused = (str(src) == tree if step == "park-old"  # the new tree comes from the build's scratch folder
                       else str(dst) == tree and guarded_swap.TMP_PREFIX in str(src))
            if refused:
                raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(src))
            return real[name](src, dst, *args, **kwargs)
        return call

    for name in real:
        monkeypatch.setattr(os, name, refusing(name))
    capsys.readouterr()
    assert cli(fake, "materialize") == 2
    err = capsys.readouterr().err
    why = "the old one could not be moved aside" if step == "park-old" else "the new one could not be moved in"
    assert f"the new megatron/ could not be put in place: {why}" in err, err
    assert f"{tree} is the old one, as it was, and the new one was discarded" in err, err
    assert "Traceback" not in err and "run `scripts/patchset materialize` again" in err, err
    assert tree_digest(fake.project.megatron_dir) == before
    assert [p.name for p in fake.project.root.iterdir() if p.name.startswith((".patchset-", "megatron."))] == []
    for name, function in real.items():
        monkeypatch.setattr(os, name, function)
    assert cli(fake, "materialize") == 0
    assert "maxpool = 'pulled'" in (fake.project.megatron_dir / "core" / "alloc.py").read_text()



def test_a_backup_that_cannot_be_named_leaves_the_old_tree_whole_and_says_where(fake: Env, monkeypatch, capsys) -> None:
    """``materialize --backup`` whose last rename (the parked old tree to megatron.bak-*) fails: the new tree is
    in place, the old one is whole under its parked name, and the message names both and the command that
    finishes the job, which works."""
    import errno
    import shlex
    import subprocess

    assert cli(fake, "materialize") == 0
    before = tree_digest(fake.project.megatron_dir)
    fake.series_with(ALLOC_PATCH.replace("+maxpool = True", "+maxpool = 'pulled'"))
    real = os.rename

    def refusing(src, dst, *args, **kwargs):
        if os.path.basename(str(dst)).startswith("megatron.bak-"):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refusing)
    capsys.readouterr()
    assert cli(fake, "materialize", "--backup") == 2
    monkeypatch.setattr(os, "rename", real)
    err = capsys.readouterr().err
    assert "is the new one; the old one, whole, could not be renamed to" in err and "Traceback" not in err, err
    assert "maxpool = 'pulled'" in (fake.project.megatron_dir / "core" / "alloc.py").read_text()
    (parked,) = [p for p in fake.project.root.iterdir() if p.name.startswith(".patchset-old-")]
    assert tree_digest(parked) == before and f"is kept as {parked}" in err
    command = err.split("rename it yourself (`", 1)[1].split("`", 1)[0]
    subprocess.run(shlex.split(command), check=True)
    (kept,) = list(fake.project.root.glob("megatron.bak-*"))
    assert tree_digest(kept) == before and not parked.exists()


def _refused_deletion(fake: Env, capsys) -> tuple[str, Path]:
    """materialize over a stale tree whose old copy keeps megatron/core/alloc.py: (stderr, the backup folder)."""
    capsys.readouterr()
    assert cli(fake, "materialize") == 2
    err = capsys.readouterr().err
    (kept,) = fake.project.root.glob("megatron.bak-*")
    assert "is the new one; the old one could not be deleted (Operation not permitted" in err, err
    return err, kept


def test_an_old_file_that_cannot_be_deleted_is_named_by_its_path_in_the_backup(fake: Env, monkeypatch,
                                                                               capsys) -> None:
    """rmtree's own error names the file relative to its folder (``alloc.py``), as an immutable file makes it do;
    the message names it where it is left: inside the backup folder."""
    import errno

    from hfsdp.patchset import guarded_swap

    assert cli(fake, "materialize") == 0
    fake.series_with(ALLOC_PATCH.replace("+maxpool = True", "+maxpool = 'pulled'"))
    unlink = os.unlink

    def immutable(path, *args, dir_fd=None, **kwargs):
        folder = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.path.dirname(str(path))
        if os.path.basename(str(path)) == "alloc.py" and guarded_swap.OLD_PREFIX in folder:
            raise PermissionError(errno.EPERM, "Operation not permitted", os.path.basename(str(path)))
        return unlink(path, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(os, "unlink", immutable)
    err, kept = _refused_deletion(fake, capsys)
    monkeypatch.setattr(os, "unlink", unlink)
    assert f"Operation not permitted: {kept / 'core' / 'alloc.py'}), and what is left" in err, err
    assert (kept / "core" / "alloc.py").is_file() and not (kept / "training").exists()  # the rest was deleted


def test_an_immutable_old_file_is_named_by_its_path_in_the_backup(fake: Env, capsys) -> None:
    """The same with a real immutable file (``chattr +i``: root with CAP_LINUX_IMMUTABLE, on a filesystem
    that has the flag)."""
    import shutil
    import subprocess

    assert cli(fake, "materialize") == 0
    alloc = fake.project.megatron_dir / "core" / "alloc.py"
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(alloc)],
                                                        capture_output=True).returncode != 0:
        pytest.skip("chattr +i is refused here: it needs root's CAP_LINUX_IMMUTABLE and a filesystem with the flag")
    kept = None
    try:
        fake.series_with(ALLOC_PATCH.replace("+maxpool = True", "+maxpool = 'pulled'"))
        err, kept = _refused_deletion(fake, capsys)
        assert f"Operation not permitted: {kept / 'core' / 'alloc.py'}), and what is left" in err, err
    finally:
        for path in (alloc, *([] if kept is None else [kept / "core" / "alloc.py"])):
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
