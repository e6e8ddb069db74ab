"""Golden names per GPU kind and per base ([Note: golden names per base] in hfsdp/functional/platform.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hfsdp.functional import platform as P
from hfsdp.patchset.project import Project

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("device", "kind"), [
    ("NVIDIA H100 80GB HBM3", "dgx_h100"), ("NVIDIA H200", "dgx_h200"), ("NVIDIA B200", "dgx_b200"),
    ("NVIDIA L40S", "dgx_l40s"),
])
def test_gpu_kind_from_the_device_name(device: str, kind: str) -> None:
    assert P.gpu_kind(device) == kind


def test_a_tree_of_another_base_has_goldens_of_its_own(monkeypatch) -> None:
    default = Project(REPO_ROOT).pin().version
    for built_from, name in ((None, "dgx_h200"), (default, "dgx_h200"), ("0.19.2", "dgx_h200_mcore0.19.2")):
        stamp = None if built_from is None else SimpleNamespace(base_version=built_from)
        monkeypatch.setattr(P, "read_stamp", lambda root, stamp=stamp: stamp)
        assert P.platform("dgx_h200", REPO_ROOT) == name


def test_the_command_prints_the_name_run_functional_uses() -> None:
    """This checkout's tree (the default base in CI) adds nothing to a forced kind."""
    proc = subprocess.run([sys.executable, "-m", "hfsdp.functional.platform", "dgx_h100"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "dgx_h100" + P.base_suffix(REPO_ROOT)
