"""Our entry points started by a Python that is not the project's environment (no torch) say so in
one sentence, with the way in, and exit 2 without a traceback ([Note: the project's environment] in
hfsdp/environment.py). A Python without torch is this one with ``import torch`` blocked (a
sitecustomize on PYTHONPATH), so the test does not depend on what else the machine has installed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from no_torch import BLOCK_TORCH

from hfsdp import environment

REPO_ROOT = Path(__file__).resolve().parents[3]

# (what the user types after `python`, the program name its error starts with)
ENTRY_POINTS = [
    (["pretrain_gpt.py", "--help"], "pretrain_gpt.py"),
    (["pretrain_hybrid.py", "--mock-data"], "pretrain_hybrid.py"),
    (["scripts/fsdp_memory_planner.py", "--help"], "fsdp_memory_planner"),
    (["scripts/benchmark_double_buffer.py", "--help"], "benchmark_double_buffer"),
    (["-m", "hfsdp.planner"], "python -m hfsdp.planner"),
    (["-m", "hfsdp.main_job"], "python -m hfsdp.main_job"),
    (["-m", "hfsdp.functional.run_case", "--help"], "run_case"),
    (["-m", "hfsdp.functional.batch", "--help"], "python -m hfsdp.functional.batch"),
    (["-m", "hfsdp.slurm.submit", "--help"], "submit"),
    (["-m", "hfsdp.launch", "--nproc", "1", "--", "pretrain_gpt.py"], "python -m hfsdp.launch"),
]


def without_torch(tmp_path: Path) -> dict[str, str]:
    """An environment in which this Python cannot import torch (and finds the repo's code)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TORCH)
    env = {k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}
    return {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}


@pytest.mark.parametrize("argv, prog", ENTRY_POINTS, ids=[" ".join(a) for a, _ in ENTRY_POINTS])
def test_an_entry_point_without_torch_names_the_environment(argv, prog, tmp_path):
    proc = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, env=without_torch(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    cause, fix = proc.stderr.rstrip("\n").split("\n")
    assert cause == (f"{prog}: error: this Python ({sys.executable}) cannot import torch, so it is not the "
                     "project's environment")
    assert fix.startswith("  -> ") and "bin/activate" in fix and "bin/python" in fix, fix


def test_the_way_in_runs_as_printed(tmp_path):
    """The commands the error suggests run as printed, from a folder outside a checkout whose path holds
    a space and a non-ASCII character: after the first, or with the second, Python imports torch."""
    checkout = tmp_path / "check out ö"
    checkout.symlink_to(REPO_ROOT, target_is_directory=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = without_torch(tmp_path)
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(REPO_ROOT), str(checkout))
    proc = subprocess.run([sys.executable, "-m", "hfsdp.main_job"], cwd=elsewhere, env=env,  # hfsdp via the path
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    suggested = re.findall(r"`([^`]+)`", proc.stderr.split("\n  -> ", 1)[1])
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if not (REPO_ROOT / ".venv" / "bin" / "python").is_file():  # a checkout set up elsewhere (VENV=...)
        assert "README's set-up commands" in proc.stderr
        return
    activate, python = suggested
    assert shlex.split(activate)[0] == "." and str(checkout) in activate
    check = "import sys, torch; print(sys.prefix)"
    entered = subprocess.run(["bash", "-c", f"{activate} && python -c {shlex.quote(check)}"], cwd=elsewhere,
                             env=clean, capture_output=True, text=True, timeout=300)
    started = subprocess.run([*shlex.split(python), "-c", check], cwd=elsewhere, env=clean, capture_output=True,
                             text=True, timeout=300)
    for done in (entered, started):
        assert done.returncode == 0, done.stderr[-3000:]
        assert Path(done.stdout.strip()).resolve() == (REPO_ROOT / ".venv").resolve()


def test_the_way_in_is_short_inside_the_checkout(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    if (REPO_ROOT / ".venv" / "bin" / "python").is_file():
        assert "`. .venv/bin/activate` first, or start it with `.venv/bin/python`" in environment.way_in()
    else:
        assert "`. .venv/bin/activate` or start the command with `.venv/bin/python`" in environment.way_in()


def test_this_python_is_the_environment():
    assert environment.environment_problem() is None


def test_an_older_python_is_named(monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 11, 7))
    monkeypatch.setattr(sys, "version", "3.11.7 (main)")
    assert environment.environment_problem() == f"this Python ({sys.executable}, 3.11.7) is older than 3.12"
