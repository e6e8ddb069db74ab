"""Probe table of the set-up scripts' environment (``scripts/run_main.sh``, ``scripts/run_tests.sh``,
``scripts/setup_env.sh``, ``scripts/run_base_tests.sh``): each junk value a user may give a variable they read,
the exit status and the one sentence. None may print bash's own error line or a traceback, install anything
or touch a folder of the user's.

Every row runs on the stand-in interpreter of test_mamba_required.py (``VENV`` whose ``python -m pip``
only records its calls), so no row can reach the network even if a refusal regressed; rows that give
``VENV`` themselves point it at a folder nothing may be made in. ``{tmp}`` is the test's folder; ``{old}``
stands in for a Python < 3.12 (it fails the version check), ``{folder}`` is a folder, ``{mine}`` a folder
of the user's holding a file, ``{file}`` a file; their paths hold a space and a non-ASCII letter.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from test_mamba_required import REPO_ROOT, pip_calls, stand_in

SETUP_DONE = "HFSDP_SETUP_DONE must be 0 or 1"
NOT_A_PYTHON = "is not a Python >= 3.12 that runs here"

ROWS = [
    # (script, environment, what stderr says)
    ("run_main.sh", {"HFSDP_SETUP_DONE": "yes"}, f"run_main: error: {SETUP_DONE}, got 'yes'"),
    ("run_main.sh", {"HFSDP_SETUP_DONE": "true", "HFSDP_PY": "{python}"}, f"{SETUP_DONE}, got 'true'"),
    ("run_main.sh", {"HFSDP_SETUP_DONE": "2"}, f"{SETUP_DONE}, got '2'"),
    ("run_main.sh", {"HFSDP_SETUP_DONE": "1", "HFSDP_PY": ""}, "HFSDP_PY names no interpreter to use"),
    ("run_main.sh", {"HFSDP_SETUP_DONE": "1", "HFSDP_PY": "{folder}"}, f"HFSDP_PY={{folder}} {NOT_A_PYTHON}"),
    ("run_main.sh", {"HFSDP_SETUP_DONE": "1", "HFSDP_PY": "{old}"}, f"HFSDP_PY={{old}} {NOT_A_PYTHON}"),
    ("run_main.sh", {"HFSDP_SETUP_DONE": "1", "HFSDP_PY": "{tmp}/no such é/python"}, NOT_A_PYTHON),
    ("run_main.sh", {"HFSDP_WITH_MAMBA": "yes"}, "HFSDP_WITH_MAMBA must be 0 or 1, got 'yes'"),
    ("run_tests.sh", {"HFSDP_WITH_MAMBA": "on"}, "HFSDP_WITH_MAMBA must be 0 or 1, got 'on'"),
    ("setup_env.sh", {"HFSDP_WITH_MAMBA": " 1"}, "HFSDP_WITH_MAMBA must be 0 or 1, got ' 1'"),
    # A PYTHON that is set is the interpreter asked for: never another one found instead.
    ("setup_env.sh", {"VENV": "{tmp}/new venv é", "PYTHON": "/nonexistent/python3.12"},
     f"setup_env: PYTHON=/nonexistent/python3.12 {NOT_A_PYTHON}"),
    ("setup_env.sh", {"VENV": "{tmp}/new venv é", "PYTHON": "{folder}"}, f"PYTHON={{folder}} {NOT_A_PYTHON}"),
    ("setup_env.sh", {"VENV": "{tmp}/new venv é", "PYTHON": "{old}"}, f"PYTHON={{old}} {NOT_A_PYTHON}"),
    # venv writes bin/, lib/ and pyvenv.cfg into VENV: never into a folder of the user's.
    ("setup_env.sh", {"VENV": "{mine}"}, "VENV={mine} is a folder that is neither empty nor a virtual environment"),
    ("setup_env.sh", {"VENV": "{file}"}, "VENV={file} is not a folder"),
    ("run_tests.sh", {"VENV": "{mine}"}, "is a folder that is neither empty nor a virtual environment"),
    ("run_base_tests.sh", {}, "run_base_tests: no test subset is listed for base ''"),  # no base given
]


@pytest.mark.parametrize(("script", "variables", "says"), ROWS,
                         ids=[f"{s}:{' '.join(f'{k}={v}' for k, v in e.items())}" for s, e, _ in ROWS])
def test_junk_in_the_environment_is_one_sentence(tmp_path: Path, script: str, variables: dict[str, str],
                                                 says: str) -> None:
    import sys

    old = tmp_path / "old pythön" / "python3.11"
    old.parent.mkdir()
    old.write_text("#!/bin/sh\nexit 1\n")
    old.chmod(0o755)
    mine, folder, afile = tmp_path / "my földer", tmp_path / "a földer", tmp_path / "a fïle"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    folder.mkdir()
    afile.write_text("mine\n")
    places = {"tmp": str(tmp_path), "old": str(old), "folder": str(folder), "mine": str(mine), "file": str(afile),
              "python": sys.executable}
    env = stand_in(tmp_path)
    for key in ("HFSDP_SETUP_DONE", "HFSDP_PY", "PYTHON"):
        env.pop(key, None)
    env["PYENV_ROOT"] = str(tmp_path / "no pyenv")  # no interpreter found elsewhere may stand in
    env.update({key: value.format(**places) for key, value in variables.items()})
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / script)], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert says.format(**places) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not re.search(r"line \d+: |command not found|No such file", done.stderr)
    assert pip_calls(tmp_path) == [], "refused after installing"
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != "pip.log")
    assert after == before, "refused after writing"
    assert (mine / "notes.txt").read_text() == "mine\n" and afile.read_text() == "mine\n"
    assert os.listdir(mine) == ["notes.txt"]
