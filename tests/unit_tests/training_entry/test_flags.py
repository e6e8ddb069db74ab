"""``python -m hfsdp.flags``: the fork's flags, read off the patches, described by the real parser."""

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
    assert "--megatron-fsdp-max-pool-lanes N" in proc.stdout and "--nccl-comm-warmup" in proc.stdout
    assert len(lines) == 1 + len(flags.fork_flag_names())  # a header, then one line per flag
    lanes = next(line for line in lines if line.startswith("--megatron-fsdp-max-pool-lanes"))
    assert lanes.split()[2:4] == ["2", "Lanes"]  # the default, then what it does


def test_added_flags_reads_added_definitions_only():
    patch = "\n".join([
        "diff --git a/megatron/training/arguments.py b/megatron/training/arguments.py",
        "+    group.add_argument('--new-flag', type=int, default=2,",
        "-    group.add_argument('--old-flag', action='store_true')",
        "     group.add_argument('--kept-flag')",
        "diff --git a/megatron/training/config/common_config.py b/megatron/training/config/common_config.py",
        "+    new_field: bool = False",
        "diff --git a/megatron/core/some_module.py b/megatron/core/some_module.py",
        "+    maxpool_lanes: int = 2,",
    ])
    assert flags.added_flags([patch]) == {"--new-flag", "--new-field"}
