"""``python -m hfsdp.flags``: the fork's flags, read off the parser's fork group, described by the real parser."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_cli_prints_one_line_per_flag_and_no_warnings():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "hfsdp.flags"], cwd="/", env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 + len(flags.fork_flag_names()) == 1 + len(FORK_FLAGS[tree_base()])  # a header, a line a flag
    warmup = next(line for line in lines if line.startswith("--nccl-comm-warmup"))
    assert warmup.split()[1:3] == ["off", "Before"]  # the default, then what it does
    if "--megatron-fsdp-max-pool-lanes" in FORK_FLAGS[tree_base()]:
        lanes = next(line for line in lines if line.startswith("--megatron-fsdp-max-pool-lanes N"))
        assert lanes.split()[2:4] == ["2", "Lanes"]


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
