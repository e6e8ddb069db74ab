"""Series review tools: ``lint --chains`` (a patch that rewrites lines an earlier one added), on the fake
project."""

from __future__ import annotations

import textwrap

import pytest
from patchset_fake import ALLOC_PATCH, TRAIN_PATCH, Env, patch_text

from hfsdp.patchset.cli import main


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
