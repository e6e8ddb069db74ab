"""Several bases in one checkout ([Note: bases] in hfsdp/patchset/project.py), and what each verdict of
``check --against`` promises ([Note: what each verdict promises] in check.py).

The fake checkout has its default base (0.18.2: ``patches/base.toml``, ``patches/series``) and a second
one, 0.19.2, in ``patches/bases/0.19.2/``: the shared ``alloc.patch`` and its own variant of ``train.patch``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from patchset_fake import ALLOC_PATCH, BASE_FILES, OTHER, TRAIN_PATCH, Env, make_sdist, patch_text, tree_digest

from hfsdp.patchset.check import check_against, upstream_commits
from hfsdp.patchset.cli import main
from hfsdp.patchset.project import Project
from hfsdp.patchset.stamp import read_stamp

CHECKOUT = Path(__file__).resolve().parents[3]


def cli(env: Env, *args: str) -> int:
    return main(["--root", str(env.project.root), *args])


def patches_digest(env: Env) -> dict[str, str]:
    return tree_digest(env.project.patches_dir)


GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


def rebase_queue(two: Env, queue: Path, todo_edit: str) -> None:
    """A queue of the second base, its commits rewritten by ``git rebase -i`` with ``todo_edit`` (a sed script)."""
    assert cli(two, "--base", OTHER, "queue", "--dir", str(queue)) == 0
    subprocess.run([*GIT, "rebase", "-q", "-i", "patchset/base"], cwd=queue, check=True, capture_output=True,
                   env={**os.environ, "GIT_SEQUENCE_EDITOR": f"sed -i '{todo_edit}'"})


def tree_file(env: Env, path: str) -> str:
    return (env.project.root / path).read_text()


def test_each_base_builds_from_its_own_pin_and_series(two: Env, monkeypatch, capsys) -> None:
    assert cli(two, "materialize") == 0
    stamp = read_stamp(two.project.root)
    assert stamp is not None and stamp.fork_version == "0.18.2+hfsdp.7"
    assert cli(two, "--base", OTHER, "materialize") == 0  # a pristine tree of the other base: rebuilt
    stamp = read_stamp(two.project.root)
    assert stamp is not None and (stamp.base_version, stamp.fork_version) == (OTHER, "0.19.2+hfsdp.1")
    assert tree_file(two, "megatron/training/train.py") == "def train():\n    return 'fork'\n"  # the variant
    assert "maxpool = True" in tree_file(two, "megatron/core/alloc.py")  # the shared patch
    assert [n for n, _ in stamp.patches] == ["alloc.patch", "train.patch"]
    capsys.readouterr()
    assert cli(two, "status") == 1  # the default base: the tree is of the other one, and status says so
    out = capsys.readouterr().out
    assert f"tree built from base {OTHER} (patches/bases/{OTHER}/), this command works on base 0.18.2" in out
    monkeypatch.setenv("HFSDP_BASE", OTHER)  # the install-time switch chooses the base of every verb too
    assert cli(two, "status") == 0
    assert "stamp:   up to date" in capsys.readouterr().out
    assert cli(two, "materialize") == 0
    assert "is up to date (0.19.2+hfsdp.1" in capsys.readouterr().out
    assert cli(two, "--base", "0.18.2", "materialize") == 0  # --base wins over HFSDP_BASE; back to the default
    assert tree_file(two, "megatron/training/train.py") == "def train():\n    return 'fork'\n"
    stamp = read_stamp(two.project.root)
    assert stamp is not None and stamp.base_version == "0.18.2"


def test_switching_bases_never_loses_an_edit(two: Env, capsys) -> None:
    assert cli(two, "materialize") == 0
    (two.project.root / "megatron/core/alloc.py").write_text("mine = 1\n")
    (two.project.root / "megatron/core/helpers.so").write_bytes(b"\x7fELF built here")
    before = tree_digest(two.project.megatron_dir)
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "materialize") == 2
    err = capsys.readouterr().err
    assert (f"was built from base 0.18.2 and has 1 local edit(s) that switching it to base {OTHER} would "
            "overwrite; nothing was changed") in err
    assert "`scripts/patchset --base 0.18.2 refresh`" in err and f"--base {OTHER} materialize --backup" in err
    assert tree_digest(two.project.megatron_dir) == before
    # The way out it names: the edited tree is kept whole, the new one carries what the tool did not make.
    assert cli(two, "--base", OTHER, "materialize", "--backup") == 0
    backups = sorted(two.project.root.glob("megatron.bak-*"))
    assert len(backups) == 1 and (backups[0] / "core/alloc.py").read_text() == "mine = 1\n"
    assert (two.project.megatron_dir / "core/helpers.so").read_bytes() == b"\x7fELF built here"
    # Back again from a pristine tree: rebuilt, the kept file carried over.
    assert cli(two, "materialize") == 0
    assert (two.project.megatron_dir / "core/helpers.so").read_bytes() == b"\x7fELF built here"
    stamp = read_stamp(two.project.root)
    assert stamp is not None and stamp.base_version == "0.18.2"


def test_refresh_on_another_base_writes_its_folder_only(two: Env, capsys) -> None:
    folder = two.project.patches_dir / "bases" / OTHER
    (folder / "series").write_text("# the later base\nalloc.patch\ntrain.patch  # its own variant\n"
                                   "# left out: gone.patch (upstream)\n")
    shared = {n: (two.project.patches_dir / n).read_bytes() for n in ("series", "alloc.patch", "train.patch")}
    assert cli(two, "--base", OTHER, "materialize") == 0
    # An edit of the base's own variant (train.patch) goes into that variant.
    (two.project.root / "megatron/training/train.py").write_text("def train():\n    return 'mine'\n")
    assert cli(two, "--base", OTHER, "refresh") == 0
    assert "+    return 'mine'" in (folder / "train.patch").read_text()
    # An edit of a file a shared patch owns (alloc.patch) becomes this base's variant of it.
    alloc = two.project.root / "megatron/core/alloc.py"
    alloc.write_text(alloc.read_text().replace("maxpool = True", "maxpool = 'later'"))
    assert cli(two, "--base", OTHER, "refresh") == 0
    assert "+maxpool = 'later'" in (folder / "alloc.patch").read_text()
    # A new patch joins this base's series; the series keeps its comments.
    alloc.write_text(alloc.read_text() + "extra = 1\n")
    assert cli(two, "--base", OTHER, "refresh", "--new", "extra", "--description", "An extra line") == 0
    assert (folder / "extra.patch").is_file()
    assert (folder / "series").read_text() == ("# the later base\nalloc.patch\ntrain.patch  # its own variant\n"
                                               "extra.patch\n# left out: gone.patch (upstream)\n")
    # The default base's files are untouched, and both bases still build.
    assert {n: (two.project.patches_dir / n).read_bytes() for n in shared} == shared
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "status") == 0 and "edits:   none" in capsys.readouterr().out
    assert cli(two, "materialize") == 0
    assert "maxpool = True" in alloc.read_text() and "extra" not in alloc.read_text()
    assert cli(two, "--base", OTHER, "materialize") == 0
    assert "maxpool = 'later'" in alloc.read_text() and alloc.read_text().endswith("extra = 1\n")


def test_another_base_never_writes_the_shared_overlay(two: Env, tmp_path: Path, capsys) -> None:
    assert cli(two, "--base", OTHER, "materialize") == 0
    (two.project.root / "megatron/core/mine.py").write_text("NEW = 1\n")  # a new file: an overlay edit
    before = patches_digest(two)
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "refresh") == 2
    err = capsys.readouterr().err
    assert ("megatron/core/mine.py would go to the overlay, which every base shares, but this tree is of base "
            f"{OTHER}") in err
    assert "`scripts/patchset --base 0.18.2 materialize --backup`" in err
    assert cli(two, "refresh") == 2  # the default base's refresh never folds a tree of the other base
    assert "built from other patches or overlay files" in capsys.readouterr().err
    assert patches_digest(two) == before
    # The same through a queue of that base: an overlay change is refused, nothing is written.
    queue = tmp_path / "q"
    rebase_queue(two, queue, "1s/^pick/edit/")  # stopped at the overlay commit
    (queue / "megatron/core/mine.py").write_text("NEW = 1\n")
    subprocess.run([*GIT, "add", "-A"], cwd=queue, check=True)
    subprocess.run([*GIT, "commit", "-q", "--amend", "--no-edit"], cwd=queue, check=True)
    subprocess.run([*GIT, "rebase", "--continue"], cwd=queue, check=True, capture_output=True,
                   env={**os.environ, "GIT_EDITOR": "true"})
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "export", "--queue", str(queue)) == 2
    assert "the queue changes the overlay (megatron/core/mine.py), which every base shares" in capsys.readouterr().err
    assert patches_digest(two) == before
    # diff shows the edit against the tree as built, from its own base, whichever base is chosen.
    for args in ((), ("--base", OTHER)):
        assert cli(two, *args, "diff") == 0
        assert "mine.py" in capsys.readouterr().out


def test_a_queue_of_another_base_exports_its_shared_patches_as_they_are(two: Env, tmp_path: Path, capsys) -> None:
    """alloc.patch applies to the second base two lines further down: the queue's diff has other line numbers,
    but the same change, so exporting the unchanged queue writes nothing (no variant of alloc.patch)."""
    before = patches_digest(two)
    queue = tmp_path / "q"
    assert cli(two, "--base", OTHER, "queue", "--dir", str(queue)) == 0
    diff = subprocess.run(["git", "show", "--format=", "HEAD~1"], cwd=queue, capture_output=True, text=True,
                          check=True).stdout
    assert "@@ -21," in diff, diff  # the queue's alloc commit, at the later release's lines (-19 in alloc.patch)
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "export", "--queue", str(queue)) == 0
    assert "already holds what" in capsys.readouterr().out
    assert patches_digest(two) == before


def test_a_queue_made_before_an_overlay_change_is_stale_not_an_overlay_change(two: Env, tmp_path: Path,
                                                                              capsys) -> None:
    queue = tmp_path / "q"
    assert cli(two, "--base", OTHER, "queue", "--dir", str(queue)) == 0
    (two.project.patches_dir / "overlay/megatron/core").mkdir(parents=True, exist_ok=True)
    (two.project.patches_dir / "overlay/megatron/core/pulled.py").write_text("PULLED = 1\n")  # a pull, say
    before = patches_digest(two)
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "export", "--queue", str(queue)) == 2
    err = capsys.readouterr().err
    assert "patches changed after the queue" in err and "which every base shares" not in err, err
    assert patches_digest(two) == before


def test_the_default_base_does_not_drop_a_patch_another_base_applies_from_patches(two: Env, tmp_path: Path,
                                                                                 capsys) -> None:
    queue = tmp_path / "q"
    assert cli(two, "queue", "--dir", str(queue)) == 0
    subprocess.run([*GIT, "rebase", "-q", "-i", "patchset/base"], cwd=queue, check=True, capture_output=True,
                   env={**os.environ, "GIT_SEQUENCE_EDITOR": "sed -i '/ alloc$/d'"})
    before = patches_digest(two)
    capsys.readouterr()
    assert cli(two, "export", "--queue", str(queue), "--drop", "alloc.patch") == 2
    err = capsys.readouterr().err
    assert f"--drop would delete alloc.patch (patches/bases/{OTHER}/series), which another base applies" in err
    assert patches_digest(two) == before


def test_export_of_another_base_drops_from_its_series_only(two: Env, tmp_path: Path, capsys) -> None:
    folder = two.project.patches_dir / "bases" / OTHER
    queue = tmp_path / "q"
    rebase_queue(two, queue, "/ alloc$/d")  # drop alloc (a shared patch) from this base's queue
    (queue / "megatron/training/train.py").write_text("def train():\n    return 'queued'\n")  # change its variant
    subprocess.run([*GIT, "commit", "-q", "-a", "--amend", "--no-edit"], cwd=queue, check=True)
    shared = tree_digest(two.project.patches_dir)
    shared = {k: v for k, v in shared.items() if "bases/" not in k}
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "export", "--queue", str(queue), "--drop", "alloc.patch") == 0
    assert (folder / "series").read_text() == "# the later base\ntrain.patch\n"
    assert "+    return 'queued'" in (folder / "train.patch").read_text()
    assert {k: v for k, v in tree_digest(two.project.patches_dir).items() if "bases/" not in k} == shared
    assert (two.project.patches_dir / "alloc.patch").is_file()  # the default base still has it


def test_queue_of_another_base(two: Env, tmp_path: Path, capsys) -> None:
    assert cli(two, "--base", OTHER, "queue", "--dir", str(tmp_path / "q")) == 0
    log = subprocess.run(["git", "log", "--format=%s"], cwd=tmp_path / "q", capture_output=True, text=True,
                         check=True).stdout.split()
    assert log == ["train", "alloc", "overlay", "base"]
    assert (tmp_path / "q/megatron/training/train.py").read_text() == "def train():\n    return 'fork'\n"


def test_a_base_folder_holding_a_patch_its_series_does_not_list_is_refused(two: Env, capsys) -> None:
    folder = two.project.patches_dir / "bases" / OTHER
    (folder / "extra.patch").write_text(patch_text("Extra", ALLOC_PATCH))
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "materialize") == 2
    assert (f"patches/bases/{OTHER}/series lists 2 patch(es) and patches/bases/{OTHER}/ holds 1 more it does "
            "not list (extra.patch)") in capsys.readouterr().err
    assert not two.project.megatron_dir.exists()
    assert cli(two, "--base", OTHER, "lint") == 1
    assert f"extra.patch: is in patches/bases/{OTHER}/ but not listed in patches/bases/{OTHER}/series" in \
        capsys.readouterr().out
    assert cli(two, "materialize") == 0  # the default base does not read the other's folder


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize("name", ["0.20.0", "../0.19.2", ""])
def test_a_base_the_checkout_does_not_have_is_a_sentence(two: Env, monkeypatch, capsys, how: str,
                                                          name: str) -> None:
    if how == "env":
        monkeypatch.setenv("HFSDP_BASE", name)
    args = ("--base", name) if how == "flag" else ()
    before = tree_digest(two.project.root)
    rc = cli(two, *args, "materialize")
    err = capsys.readouterr().err
    if how == "env" and name == "":
        assert rc == 0  # an empty HFSDP_BASE is unset: the default base
        return
    where = "--base" if how == "flag" else "HFSDP_BASE"
    assert rc == 2 and f"{where} {name!r} is not a base of this checkout (its bases: 0.18.2, {OTHER})" in err
    assert "Traceback" not in err and tree_digest(two.project.root) == before


def test_one_writer_at_a_time_whatever_the_base(two: Env, capsys) -> None:
    import fcntl

    with open(two.project.root / ".patchset.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("`scripts/patchset materialize` (pid 4242)")
        held.flush()
        capsys.readouterr()
        assert cli(two, "--base", OTHER, "materialize") == 2
        assert "pid 4242" in capsys.readouterr().err
    assert not two.project.megatron_dir.exists()


def test_install_version_follows_the_switch() -> None:
    """setup.py names the distribution's version from the chosen base (no build: HFSDP_SKIP_MATERIALIZE)."""
    versions = {}
    for base in ("", OTHER):
        env = {"PATH": "/usr/bin:/bin", "HFSDP_SKIP_MATERIALIZE": "1", "HFSDP_BASE": base}
        proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=CHECKOUT, env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        versions[base] = proc.stdout.strip().splitlines()[-1]
    default, other = Project(CHECKOUT).pin(), Project(CHECKOUT).with_base(OTHER).pin()
    assert versions == {"": default.fork_version, OTHER: other.fork_version}
    assert versions[OTHER].startswith(f"{OTHER}+hfsdp.")


# --- check --against: what each verdict promises


LATER_ALLOC = "".join(f"line_{i} = {i}\n" for i in range(21)) + "maxpool = True\n" + "".join(
    f"line_{i} = {i}\n" for i in range(21, 40))


def applies_cleanly(tree: Path, diff: str, reverse: bool = False) -> bool:
    """``git apply --check`` with git's default, exact context (no fuzz) on a plain folder."""
    args = ["git", "apply", "--check", *(["--reverse"] if reverse else []), "-"]
    return subprocess.run(args, cwd=tree, input=diff, text=True, capture_output=True).returncode == 0


def header(applied_upstream: str) -> str:
    return textwrap.dedent(f"""\
        Description: A change the later release may have
        Origin: vendor, hfsdp
        Bug: none
        Forwarded: no
        Applied-Upstream: {applied_upstream}
        Last-Update: 2026-11-21
        ---
        """)


def test_each_verdict_of_check_against_is_true(fake: Env, tmp_path: Path, capsys) -> None:
    # The later release has alloc.patch's change (upstream), changes train.py (the train patches conflict),
    # and changes a line two lines from the fuzzy patch's hunk (it would apply with fuzz 1: it conflicts).
    files = dict(BASE_FILES)
    files["megatron/core/alloc.py"] = LATER_ALLOC
    files["megatron/training/train.py"] = "def train():\n    return 'later'\n"
    files["megatron/core/__init__.py"] = "VALUE = 1\nOTHER = 2\nTHIRD = 3\nFOURTH = 4\n"
    store = tmp_path / "later"
    store.mkdir()
    sdist = make_sdist(store, version=OTHER, files=files)
    init_patch = textwrap.dedent("""\
        diff --git a/megatron/core/__init__.py b/megatron/core/__init__.py
        --- a/megatron/core/__init__.py
        +++ b/megatron/core/__init__.py
        @@ -1,2 +1,3 @@
         VALUE = 1
        +FORK = True
         OTHER = 2
        """)
    fuzzy_patch = textwrap.dedent("""\
        diff --git a/megatron/core/alloc.py b/megatron/core/alloc.py
        --- a/megatron/core/alloc.py
        +++ b/megatron/core/alloc.py
        @@ -30,4 +30,5 @@ line_29 = 29
         line_30 = 30
         line_31 = 31
        +fuzzy = True
         line_32 = 32
         line_33 = 33
        """)
    commit = "https://github.com/NVIDIA/Megatron-LM/commit/0123abcd"
    fake.write_series({
        "alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
        "train-declared.patch": header(f"0.19.0, {commit}") + TRAIN_PATCH,
        "init.patch": patch_text("Fork marker", init_patch),
    })
    files["megatron/core/alloc.py"] = LATER_ALLOC.replace("line_33 = 33", "line_33 = 'later'")
    fuzzy_sdist = make_sdist(tmp_path, version=OTHER, files=files)
    report = check_against(fake.project, str(sdist))
    assert {r.patch: r.state for r in report.patches} == {
        "alloc.patch": "upstream", "train-declared.patch": "declared", "init.patch": "applies"}
    release = tmp_path / "release"
    release.mkdir()
    for path, text in {**BASE_FILES, **files, "megatron/core/alloc.py": LATER_ALLOC}.items():
        (release / path).parent.mkdir(parents=True, exist_ok=True)
        (release / path).write_text(text)
    series = {p.name: p for p in fake.project.series()}
    for result in report.patches:  # each verdict, checked on the release by hand
        patch = series[result.patch]
        if result.state == "upstream":
            assert applies_cleanly(release, patch.diff, reverse=True)
        elif result.state == "declared":
            assert upstream_commits(patch.fields["Applied-Upstream"]) == [commit]
            assert not applies_cleanly(release, patch.diff, reverse=True)
        else:
            assert applies_cleanly(release, patch.diff)
    # A header naming only a release is no evidence: the patch conflicts, and the note says why.
    fake.write_series({"train-version-only.patch": header("0.19.0") + TRAIN_PATCH,
                       "fuzzy.patch": patch_text("Fuzzy", fuzzy_patch)})
    report = check_against(fake.project, str(fuzzy_sdist))
    states = {r.patch: (r.state, r.note) for r in report.patches}
    assert states["train-version-only.patch"][0] == "conflicts"
    assert "names no upstream commit, and the patch does not reverse-apply" in states["train-version-only.patch"][1]
    assert states["fuzzy.patch"] == ("conflicts", "")  # context differs two lines off: never applied with fuzz
    capsys.readouterr()
    assert cli(fake, "check", "--against", str(fuzzy_sdist)) == 1
    out = capsys.readouterr().out
    assert "  conflicts train-version-only.patch (megatron/training/train.py) [Applied-Upstream: 0.19.0 names" in out
    assert "0 declared upstream" in out and "2 conflict" in out


def test_upstream_commits() -> None:
    assert upstream_commits("0.19.0, https://github.com/NVIDIA/Megatron-LM/commit/adfe9e11d9") == [
        "https://github.com/NVIDIA/Megatron-LM/commit/adfe9e11d9"]
    assert upstream_commits("0.19.0, commit:adfe9e1") == ["commit:adfe9e1"]
    assert upstream_commits("0.19.0") == upstream_commits("no") == []
    assert upstream_commits("0.19.0, https://github.com/NVIDIA/Megatron-LM/pull/5462") == []  # a PR is no commit


def test_switching_with_edits_the_first_way_out_folds_them_into_their_base(two: Env, capsys) -> None:
    """The refusal's first command saves the edit in the base the tree was built from; the switch then runs."""
    assert cli(two, "materialize") == 0
    alloc = two.project.megatron_dir / "core" / "alloc.py"
    alloc.write_text(alloc.read_text().replace("maxpool = True", "maxpool = 'mine'"))
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "materialize") == 2
    fix = capsys.readouterr().err.split("-> ", 1)[1]
    steps = re.findall(r"`([^`]+)`", fix)
    assert steps == ["scripts/patchset --base 0.18.2 refresh", f"scripts/patchset --base {OTHER} materialize --backup"]
    assert main(["--root", str(two.project.root), *shlex.split(steps[0])[1:]]) == 0
    assert "+maxpool = 'mine'" in (two.project.patches_dir / "alloc.patch").read_text()  # shared by both bases
    assert cli(two, "--base", OTHER, "materialize") == 0
    assert "maxpool = 'mine'" in alloc.read_text() and not list(two.project.root.glob("megatron.bak-*"))


def test_the_benchmark_names_the_fork_by_the_base_its_tree_was_built_from(two: Env, monkeypatch) -> None:
    from hfsdp.bench.bases import fork_version

    monkeypatch.delenv("HFSDP_BASE", raising=False)
    assert fork_version(two.project.root) == "0.18.2+hfsdp.7"  # no tree yet: the default base's pin
    assert cli(two, "--base", OTHER, "materialize") == 0
    assert fork_version(two.project.root) == "0.19.2+hfsdp.1"  # the tree's base, though HFSDP_BASE is unset


def test_a_patch_that_does_not_apply_on_another_base_names_that_base_in_its_advice(two: Env, capsys) -> None:
    """The advice's queue, continue and export commands are the ones to run for that base."""
    variant = two.project.patches_dir / "bases" / OTHER / "train.patch"
    variant.write_text(variant.read_text().replace("def train():", "def train_renamed():"))
    capsys.readouterr()
    assert cli(two, "--base", OTHER, "materialize") == 2
    advice = capsys.readouterr().err
    for rest in ("queue --dir DIR", "queue --continue --dir DIR", "export --queue DIR"):
        assert f"`scripts/patchset --base {OTHER} {rest}`" in advice, advice
    capsys.readouterr()
    assert cli(two, "materialize") == 0  # the default base's patches still apply: its advice is never needed
