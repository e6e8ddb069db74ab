"""The sdist built from this repository carries patches/ (the overlay included) and not megatron/.

setup.py materializes megatron/ at install from the unpacked sdist, so the sdist must hold the pin,
the series, the patches and the overlay, and must not hold a materialized (unstamped) megatron/,
which the install would refuse as foreign. The file list comes from setuptools' own manifest
(``egg_info`` writes SOURCES.txt: the sdist's files), without building anything or the network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hfsdp.patchset.project import Project

PROJECT = Project.default()


def test_sdist_file_list_has_patches_and_the_overlay_but_no_megatron(tmp_path: Path) -> None:
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in ("setup.py", "MANIFEST.in", "pyproject.toml", "README.md"):
        shutil.copy2(PROJECT.root / name, copy / name)
    shutil.copytree(PROJECT.root / "hfsdp", copy / "hfsdp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PROJECT.root / "scripts", copy / "scripts")
    shutil.copytree(PROJECT.patches_dir, copy / "patches", ignore=shutil.ignore_patterns("overlay"))
    overlay = copy / "patches" / "overlay" / "megatron" / "core" / "fork"
    overlay.mkdir(parents=True)
    (overlay / "planner.py").write_text("PLAN = 1\n")
    (overlay / "table.json").write_text("{}\n")
    (overlay / "__pycache__").mkdir()
    (overlay / "__pycache__" / "planner.cpython-312.pyc").write_bytes(b"\0")
    (copy / "megatron" / "core").mkdir(parents=True)  # a materialized tree in the checkout
    (copy / "megatron" / "core" / "__init__.py").write_text("VALUE = 1\n")
    env = {**os.environ, "HFSDP_SKIP_MATERIALIZE": "1", "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info"], cwd=copy, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = set((copy / "megatron_core.egg-info" / "SOURCES.txt").read_text().split())
    series = Project(copy).series()
    assert {"patches/base.toml", "patches/series", *(f"patches/{p.name}" for p in series)} <= files
    assert {"patches/overlay/megatron/core/fork/planner.py", "patches/overlay/megatron/core/fork/table.json"} <= files
    assert not [f for f in files if f.startswith("megatron/") or f.endswith(".pyc")], sorted(files)
