"""pip keeps exactly one megatron: upstream wheel first, then the fork replaces it (and back).

Talks to the package index, so it runs only with HFSDP_NETWORK_TESTS=1 (.ci/run sets it).
A throw-away venv without torch is enough: ``--no-deps`` installs and ``find_spec`` checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from hfsdp.patchset.project import Project

PROJECT = Project.default()
pytestmark = pytest.mark.skipif(os.environ.get("HFSDP_NETWORK_TESTS") != "1",
                                reason="set HFSDP_NETWORK_TESTS=1 (needs PyPI)")

PROBE = """
import importlib.metadata as md, importlib.util, json, sys, pathlib
dists = [d.metadata['Name'] + '==' + d.version for d in md.distributions() if d.metadata['Name'] == 'megatron-core']
spec = importlib.util.find_spec('megatron.core')
site = [p for p in sys.path if p.endswith('site-packages')][0]
print(json.dumps({'dists': dists, 'origin': spec.origin if spec else None,
                  'site_copy': (pathlib.Path(site) / 'megatron' / 'core').exists()}))
"""


def _pip(py: Path, *args: str) -> None:
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _probe(py: Path, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, cwd=cwd, env=env, check=True)
    return json.loads(out.stdout)


def test_fork_replaces_upstream_wheel_and_vice_versa(tmp_path: Path) -> None:
    assert sys.version_info >= (3, 12)
    venv.EnvBuilder(with_pip=True).create(tmp_path / "venv")
    py = tmp_path / "venv" / "bin" / "python"
    pin = PROJECT.pin()
    _pip(py, "--no-deps", f"{pin.distribution}=={pin.version}")
    upstream = _probe(py, tmp_path)
    assert upstream["dists"] == [f"megatron-core=={pin.version}"] and upstream["site_copy"]

    _pip(py, "--no-deps", "-e", str(PROJECT.root))
    fork = _probe(py, tmp_path)
    assert fork["dists"] == [f"megatron-core=={pin.fork_version}"], fork
    assert not fork["site_copy"], "the upstream wheel's files were left behind"
    assert Path(fork["origin"]).resolve().is_relative_to(PROJECT.megatron_dir.resolve())

    _pip(py, "--no-deps", "-e", str(PROJECT.root))  # re-install: still one copy, tree untouched
    assert _probe(py, tmp_path)["dists"] == [f"megatron-core=={pin.fork_version}"]
