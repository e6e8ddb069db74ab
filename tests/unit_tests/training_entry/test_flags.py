"""``python -m hfsdp.flags``: the fork's flags, read off the parser's fork group, described by the real parser."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from no_torch import BLOCK_TORCH

from hfsdp import flags

REPO_ROOT = Path(__file__).resolve().parents[3]
PRISTINE_OPTIONS = """
import argparse
from megatron.training.arguments import add_megatron_arguments
parser = argparse.ArgumentParser()
add_megatron_arguments(parser)
print("\\n".join(s for a in parser._actions for s in a.option_strings))
"""

# The fork group on each base: a base whose release lacks what a flag drives, or declares the flag
# itself, gets only the others (fork_args.add_fork_args' ``only``).
FORK_FLAGS = {
    "0.18.2": {"--megatron-fsdp-max-pool-double-buffer", "--megatron-fsdp-max-pool-lanes",
               "--fsdp-db-use-persist-buf-on-alloc-fail", "--nccl-comm-warmup"},
    "0.19.2": {"--nccl-comm-warmup", "--megatron-fsdp-max-pool-lanes"},
}


def tree_base() -> str:
    """The release the materialized tree is built on (``0.19.2`` of ``0.19.2+hfsdp.1``)."""
    import megatron.core

    return str(megatron.core.__version__).partition("+")[0]


@pytest.fixture(scope="module")
def pristine_options(pristine_megatron: Path) -> set[str]:
    """Every option string of the parser of the pinned release itself (no overlay, no patches)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PRISTINE_OPTIONS], cwd=pristine_megatron,
                          env={**env, "PYTHONPATH": str(pristine_megatron)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(proc.stdout.split())


def test_every_flag_the_patches_add_is_listed(pristine_options):
    """The fork's flags are exactly the options the materialized parser has and the release's lacks."""
    from hfsdp.training.entry import megatron_parser

    parser = megatron_parser()
    ours = {s for a in parser._actions for s in a.option_strings}
    listed = {s for a in flags.fork_actions(parser, flags.fork_flag_names()) for s in a.option_strings}
    assert ours - pristine_options  # the series adds flags at all
    assert listed == ours - pristine_options


def rows_on(base: str) -> list[flags.Row]:
    return [r for r in flags.PRETRAIN if base in r.where]


def holds(parser: argparse.ArgumentParser, action: argparse.Action, row: flags.Row) -> None:
    """The row says what the parser says: what the option takes, its default, its help's first words."""
    help_text = " ".join(parser._get_formatter()._expand_help(action).split())
    assert ("" if action.nargs == 0 else flags.metavar(action)) == row.takes, (row, action)
    assert flags.default_text(action) == row.default or f"(default {row.default})" in help_text, (row, action)
    assert flags.what_it_does(parser, action).startswith(row.meaning.removesuffix(" …")), (row, help_text)


def test_the_listing_is_the_fork_group_of_the_real_parser():
    """PRETRAIN's rows for the materialized base are the fork group's flags, each with the parser's
    metavar, default and first words of help; the upstream values it names are among the flag's choices."""
    parser = flags.megatron_parser()
    rows = rows_on(tree_base())
    own = [r for r in rows if r.option not in flags.UPSTREAM_VALUES]
    assert {r.option for r in own} == flags.fork_flag_names(parser) == FORK_FLAGS[tree_base()]
    by_option = {s: a for a in parser._actions for s in a.option_strings}
    for row in own:
        holds(parser, by_option[row.option], row)
    for option, value in flags.UPSTREAM_VALUES.items():
        row = next(r for r in rows if r.option == option)
        action = by_option[option]
        assert row.takes == value and value in action.choices and flags.default_text(action) == row.default
    assert {b for r in flags.PRETRAIN for b in r.where} <= set(flags.BASES)


class Captured(BaseException):
    """Raised by a patched ``parse_args`` to hand a launcher's parser to the test (not an Exception:
    run_cli lets it through)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def launcher_parser(name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The argparse parser the launcher ``name`` (flags.LAUNCHER_NAMES) parses its command line with."""
    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    if name == "run_case":
        from hfsdp.functional.run_case import main as run
    elif name == "batch":
        from hfsdp.functional.batch import main as run
    elif name == "benchmark":
        from hfsdp.bench.run import parse as run
    elif name == "submit":
        from hfsdp.slurm.submit import main as run
    else:
        from hfsdp.launch.__main__ import parse as run
    with pytest.raises(Captured) as caught:
        run(["--help"])
    monkeypatch.undo()
    return caught.value.parser


@pytest.mark.parametrize("name", sorted(flags.LAUNCHER_NAMES))
def test_every_launcher_takes_the_options_listed_for_it(name, monkeypatch):
    parser = launcher_parser(name, monkeypatch)
    by_option = {s: a for a in parser._actions for s in a.option_strings}
    rows = [r for r in flags.LAUNCHERS if name in r.where]
    assert rows
    for row in rows:
        assert row.option in by_option, f"{flags.LAUNCHER_NAMES[name]} has no {row.option}"
        holds(parser, by_option[row.option], row)
    # And what a launcher takes that the listing names is listed for it, not only for the others.
    listed = {r.option for r in flags.LAUNCHERS}
    assert listed & set(by_option) == {r.option for r in rows}


def test_the_reference_examples_rows_are_its_parser():
    from hfsdp.training.reference_flags import flag_parser

    parser = flag_parser()
    by_option = {s: a for a in parser._actions for s in a.option_strings}
    assert set(by_option) == {r.option for r in flags.EXAMPLES}
    for row in flags.EXAMPLES:
        holds(parser, by_option[row.option], row)


def test_the_cli_lists_every_row_without_megatron_or_torch(tmp_path):
    """The listing imports neither Megatron nor torch: it runs with torch unimportable, quickly."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(BLOCK_TORCH)
    check = ("import sys; from hfsdp import flags; rc = flags.main([]); "
             "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')); "
             "sys.exit(rc or (f'imported {heavy}' if heavy else 0))")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}
    proc = subprocess.run([sys.executable, "-c", check], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 4 + len(flags.PRETRAIN) + len(flags.EXAMPLES) + len(flags.LAUNCHERS)  # headers, rows
    for row in (*flags.PRETRAIN, *flags.EXAMPLES, *flags.LAUNCHERS):
        assert any(line.split()[:1] == [row.option] and row.meaning in line for line in lines), row
    warmup = next(line for line in lines if line.split()[0] == "--nccl-comm-warmup")
    assert warmup.split()[1:3] == ["off", "Before"]  # the default, then what it does
    assert any(line.split()[:3] == ["--cuda-graph-impl", "full_iteration", "none"] for line in lines)
    assert any(line.split()[:3] == ["--ranks-per-gpu", "N", "1"] for line in lines)




def test_the_fork_group_holds_the_flags_and_help_shows_it():
    """--help prints the fork's flags under their own group (fork_args.py), and hfsdp.flags reads that
    group: what it lists is the group's actions, whatever group upstream code puts flags in."""
    from megatron.training import fork_args

    parser = flags.megatron_parser()
    group = fork_args.fork_group(parser)
    assert group is not None and group.title == flags.GROUP_TITLE == fork_args.GROUP_TITLE
    names = {s for a in group._group_actions for s in a.option_strings}
    assert names == flags.fork_flag_names(parser) == FORK_FLAGS[tree_base()]
    help_text = parser.format_help()
    section = help_text[help_text.index(fork_args.GROUP_TITLE + ":"):]
    section = section[:section.index("\n\n", section.index("--nccl-comm-warmup"))]
    assert all(name in section for name in names), section
    # Each flag is declared once: the factory leaves the config field to the fork group.
    assert sum(a.dest == "nccl_comm_warmup" for a in parser._actions) == 1


def test_a_parser_without_the_fork_group_is_one_sentence():
    import argparse

    from hfsdp.usererror import UserError

    with pytest.raises(UserError, match="has no argument group 'hfsdp \\(fork\\)'"):
        flags.fork_flag_names(argparse.ArgumentParser())


def test_a_base_gets_only_the_flags_it_names():
    """``only`` keeps a subset of the group, in the group's order; a name the group lacks is an error."""
    import argparse

    from megatron.training import fork_args

    parser = fork_args.add_fork_args(argparse.ArgumentParser(), only=["--nccl-comm-warmup"])
    assert flags.fork_flag_names(parser) == {"--nccl-comm-warmup"}
    assert parser.parse_args(["--nccl-comm-warmup"]).nccl_comm_warmup is True
    with pytest.raises(ValueError, match="'--no-such-flag'"):
        fork_args.add_fork_args(argparse.ArgumentParser(), only=["--nccl-comm-warmup", "--no-such-flag"])
