"""``scripts/fsdp_memory_planner.py --help`` is the planner's own options (usage naming each), then
where Megatron's flags are; ``--help-megatron`` lists every flag, the planner's first. Neither
prints upstream warnings."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from hfsdp.planner import setup

REPO_ROOT = Path(__file__).resolve().parents[3]
PLANNER = [sys.executable, str(REPO_ROOT / "scripts/fsdp_memory_planner.py")]
OWN = ("--plan-dp-size", "--plan-lanes", "--plan-json", "--fsdp-unit-modules", "--plan-align-bytes",
       "--plan-device-arch", "--plan-reference")


def own_options() -> set[str]:
    parser = setup.add_planner_args(argparse.ArgumentParser())
    return {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}


def test_help_is_the_planner_s_options_and_points_at_megatron_s():
    proc = subprocess.run([*PLANNER, "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    usage = proc.stdout.splitlines()[0]
    assert set(OWN) == own_options()
    assert all(option in usage for option in OWN), usage  # the usage line names every own option
    assert all(option in proc.stdout for option in OWN)
    assert "--help-megatron" in proc.stdout and "--hidden-size" not in proc.stdout  # no Megatron flag listed
    assert len(proc.stdout.splitlines()) < 60


def test_help_megatron_lists_every_flag_the_planner_s_first():
    proc = subprocess.run([*PLANNER, "--help-megatron"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr[-3000:]
    text = proc.stdout
    assert "--hidden-size" in text and "--megatron-fsdp-max-pool-double-buffer" in text
    assert max(text.index(o) for o in OWN) < text.index("--hidden-size")
