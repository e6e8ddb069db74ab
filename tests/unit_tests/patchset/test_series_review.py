"""Series review tools: ``lint --chains`` (a patch that rewrites lines an earlier one added) and ``prefixes``
(every prefix of the series imports, and passes its patch's smoke command), on the fake project."""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

import pytest
from patchset_fake import ALLOC_PATCH, HEADER, TRAIN_PATCH, Env, patch_text, tree_digest

from hfsdp.patchset.cli import main
from hfsdp.patchset.prefixes import parse_smoke

REPO = Path(__file__).resolve().parents[3]


def cli(env: Env, *args: str) -> int:
    return main(["--root", str(env.project.root), *args])


# alloc.py after alloc.patch: line_20 = 20 (line 21), maxpool = True (22), line_21 = 21 (23).
REWRITES_MAXPOOL = textwrap.dedent(
    """\
    diff --git a/megatron/core/alloc.py b/megatron/core/alloc.py
    --- a/megatron/core/alloc.py
    +++ b/megatron/core/alloc.py
    @@ -20,5 +20,5 @@ line_18 = 18
     line_19 = 19
     line_20 = 20
    -maxpool = True
    +maxpool = False
     line_21 = 21
     line_22 = 22
    """
)
ADDS_NEAR_MAXPOOL = textwrap.dedent(
    """\
    diff --git a/megatron/core/alloc.py b/megatron/core/alloc.py
    --- a/megatron/core/alloc.py
    +++ b/megatron/core/alloc.py
    @@ -20,5 +20,6 @@ line_18 = 18
     line_19 = 19
     line_20 = 20
     maxpool = True
    +maxpool_lanes = 2
     line_21 = 21
     line_22 = 22
    """
)
REWRITES_UPSTREAM = textwrap.dedent(
    """\
    diff --git a/megatron/core/alloc.py b/megatron/core/alloc.py
    --- a/megatron/core/alloc.py
    +++ b/megatron/core/alloc.py
    @@ -23,4 +23,4 @@ maxpool = True
     line_21 = 21
    -line_22 = 22
    +line_22 = 'twenty-two'
     line_23 = 23
     line_24 = 24
    """
)


def series(env: Env, **later: str) -> None:
    """alloc.patch, train.patch, then the named patches (name -> diff)."""
    env.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                      "train.patch": patch_text("Fork training", TRAIN_PATCH),
                      **{f"{name}.patch": patch_text(f"Later change {name}", diff) for name, diff in later.items()}})


def test_lint_chains_flags_a_patch_that_rewrites_a_line_an_earlier_patch_added(fake: Env, capsys) -> None:
    series(fake, tune=REWRITES_MAXPOOL)
    capsys.readouterr()
    assert cli(fake, "lint") == 0  # off unless asked for
    assert cli(fake, "lint", "--chains") == 1
    out = capsys.readouterr().out
    assert ("lint: tune.patch: rewrites 1 line(s) that the earlier alloc.patch added "
            "(megatron/core/alloc.py:22: 'maxpool = True'): a rewrite chain; fold this change into alloc.patch") in out
    assert "patchset: lint found 1 problem(s)" in out


@pytest.mark.parametrize("diff", [ADDS_NEAR_MAXPOOL, REWRITES_UPSTREAM], ids=["adds-near", "rewrites-upstream"])
def test_lint_chains_passes_a_patch_that_adds_next_to_an_earlier_patchs_lines(fake: Env, diff: str,
                                                                              capsys) -> None:
    series(fake, tune=diff)
    capsys.readouterr()
    assert cli(fake, "lint", "--chains") == 0, capsys.readouterr().out
    assert "patchset: lint clean (3 patches)" in capsys.readouterr().out


def test_lint_chains_is_not_checked_on_a_series_that_cannot_be_read(fake: Env, capsys) -> None:
    series(fake, tune=REWRITES_MAXPOOL)
    (fake.project.patches_dir / "train.patch").write_text("Description: x\n")
    capsys.readouterr()
    assert cli(fake, "lint", "--chains") == 1
    assert "lint: series: rewrite chains were not checked" in capsys.readouterr().out


# A module-level NameError at import, in the fake's megatron/core/__init__.py ("VALUE = 1").
BREAKS_IMPORT = textwrap.dedent(
    """\
    diff --git a/megatron/core/__init__.py b/megatron/core/__init__.py
    --- a/megatron/core/__init__.py
    +++ b/megatron/core/__init__.py
    @@ -1 +1,2 @@
     VALUE = 1
    +BROKEN = undefined_name
    """
)
CHANGES_VALUE = textwrap.dedent(
    """\
    diff --git a/megatron/core/__init__.py b/megatron/core/__init__.py
    --- a/megatron/core/__init__.py
    +++ b/megatron/core/__init__.py
    @@ -1 +1 @@
    -VALUE = 1
    +VALUE = 2
    """
)


def with_smoke(desc: str, diff: str, smoke: str) -> str:
    return HEADER.format(desc=desc) + f"X-Smoke: {smoke}\n---\n" + diff


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system's temporary folder for the test: prefixes must leave nothing there."""
    folder = tmp_path / "system-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_prefixes_names_the_patch_whose_prefix_fails_to_import(fake: Env, scratch: Path, capsys) -> None:
    """Patch 3 adds a NameError at import: prefixes 1-2 pass, 3 and 4 fail, and patch 3 is named; the
    checkout's megatron/ is neither read nor written, and the temporary trees are gone."""
    assert cli(fake, "materialize") == 0
    before = tree_digest(fake.project.megatron_dir)
    series(fake, broken=BREAKS_IMPORT, value=CHANGES_VALUE.replace("@@ -1 +1 @@", "@@ -1,2 +1,2 @@")
           + " BROKEN = undefined_name\n")
    capsys.readouterr()
    assert cli(fake, "prefixes", "--jobs", "2") == 1
    out = capsys.readouterr().out
    assert "[  1/4] alloc.patch" in out and "[  3/4] broken.patch" in out and "NameError" in out, out
    assert ("patchset: prefixes: patch 3 (broken.patch) breaks the tree: patches 1..3 fail (NameError: name "
            "'undefined_name' is not defined), patches 1..2 pass; 2 of 4 prefixes fail") in out, out
    assert "-> fix broken.patch so that the tree up to it works" in out
    assert tree_digest(fake.project.megatron_dir) == before
    assert list(scratch.iterdir()) == []


def test_prefixes_runs_each_patchs_smoke_command_with_smoke(fake: Env, scratch: Path, capsys) -> None:
    """The smoke of patch k runs on prefix k only, with --smoke: a passing one, a failing one (named), and a
    pytest node id of the checkout's tests."""
    passes = "python -c \"import megatron.training.train as t; assert t.train() == 'fork', t.train()\""
    fails = "python -c \"import megatron.core as c; assert c.VALUE == 3, f'VALUE is {c.VALUE}'\""
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                       "train.patch": with_smoke("Fork training", TRAIN_PATCH, passes),
                       "value.patch": with_smoke("Value two", CHANGES_VALUE, fails)})
    capsys.readouterr()
    assert cli(fake, "prefixes") == 0  # the imports alone pass
    assert "all 3 prefixes import megatron.core and megatron.training" in capsys.readouterr().out
    assert cli(fake, "prefixes", "--smoke") == 1
    out = capsys.readouterr().out
    assert "[  2/3] train.patch" in out and "train.patch (" in out and "AssertionError: VALUE is 2" in out, out
    assert "patch 3 (value.patch) breaks the tree: patches 1..3 fail (AssertionError: VALUE is 2)" in out, out
    assert list(scratch.iterdir()) == []


def test_prefixes_trees_are_stamped_as_what_they_are(overlaid: Env, scratch: Path, capsys) -> None:
    """With the fork's own import guard (the real fork_info.py, hooked into megatron/core/__init__.py), each
    prefix tree passes it: its stamp lists patches 1..k and its version says it is a prefix."""
    guard = (REPO / "patches" / "overlay" / "megatron" / "core" / "fork_info.py").read_text()
    overlaid.write_overlay({"megatron/core/fork_info.py": guard})
    hook = textwrap.dedent(
        """\
        diff --git a/megatron/core/__init__.py b/megatron/core/__init__.py
        --- a/megatron/core/__init__.py
        +++ b/megatron/core/__init__.py
        @@ -1 +1,3 @@
        +from megatron.core.fork_info import verify_tree, fork_version, applied_patches
        +verify_tree()
         VALUE = 1
        """)
    check = ("python -c \"import megatron.core.fork_info as f; assert f.fork_version() == '0.18.2+hfsdp.7.prefix.2', "
             "f.fork_version(); assert f.applied_patches() == ['guard.patch', 'train.patch'], f.applied_patches()\"")
    overlaid.write_series({"guard.patch": patch_text("Guard", hook),
                           "train.patch": with_smoke("Fork training", TRAIN_PATCH, check)})
    capsys.readouterr()
    assert cli(overlaid, "prefixes", "--smoke", "--jobs", "1") == 0, capsys.readouterr().out


@pytest.mark.parametrize("value", ["pytest -x", "python -c", "python -c 'a' 'b'", "tests/../x.py", "python -c 'x",
                                   "make check"])
def test_a_smoke_command_of_another_form_is_refused_by_prefixes_and_lint(fake: Env, value: str, capsys) -> None:
    with pytest.raises(ValueError):
        parse_smoke(value)
    fake.write_series({"alloc.patch": with_smoke("Add maxpool flag", ALLOC_PATCH, value),
                       "train.patch": patch_text("Fork training", TRAIN_PATCH)})
    capsys.readouterr()
    assert cli(fake, "prefixes", "--smoke") == 2
    assert f"alloc.patch: X-Smoke {value!r} is not a smoke command" in capsys.readouterr().err
    assert cli(fake, "lint") == 1
    assert f"lint: alloc.patch: X-Smoke {value!r} is not a smoke command" in capsys.readouterr().out


def test_smoke_forms() -> None:
    assert parse_smoke("python -c 'import x'").words == ("import x",)
    assert parse_smoke("python -m pkg.mod --flag 1").words == ("pkg.mod", "--flag", "1")
    assert parse_smoke("tests/unit_tests/x/test_y.py::test_z[a-b]").kind == "pytest"


def test_prefixes_makes_one_work_tree_at_a_time(fake: Env, scratch: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys) -> None:
    """`git worktree add` reads every work tree's metadata while it makes one, so two at once can fail
    each other: the workers' adds never overlap (each is slowed here so that unserialized ones would)."""
    import threading
    import time

    from hfsdp.patchset import gitops

    real_git, active, overlaps = gitops.git, [0], []
    guard = threading.Lock()

    def git(args, *rest, **kwargs):
        if args[:2] != ["worktree", "add"]:
            return real_git(args, *rest, **kwargs)
        with guard:
            active[0] += 1
            overlaps.append(active[0])
        try:
            time.sleep(0.3)
            return real_git(args, *rest, **kwargs)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(gitops, "git", git)
    assert cli(fake, "materialize") == 0
    series(fake)
    capsys.readouterr()
    assert cli(fake, "prefixes", "--jobs", "2") == 0, capsys.readouterr()
    assert overlaps == [1, 1], f"work trees made at once: {overlaps}"
