"""mamba_ssm is required by the test command unless HFSDP_WITH_MAMBA=0 opts out.

scripts/setup_env.sh is driven with a stand-in interpreter: a `python` that runs the real one,
except that `-m pip` only records what it was asked (and "builds" or "installs" a fake wheel) and
mamba_ssm is a folder on PYTHONPATH that imports once the fake wheel is installed. The pytest side
(the ``mamba`` marker, tests/unit_tests/conftest.py) runs a real Mamba test with mamba_ssm hidden.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

FAKE_PIP = '''\
import os, re, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
if os.environ.get("FAKE_PIP_FAIL") and re.search(os.environ["FAKE_PIP_FAIL"], " ".join(args)):
    sys.exit(1)
if args[0] == "wheel":
    Path(args[args.index("-w") + 1], "mamba_ssm-2.3.2.post1-py3-none-any.whl").write_text("")
if args[0] == "install" and any(a.endswith(".whl") for a in args) and os.environ.get("FAKE_WHEEL_WORKS") == "1":
    package = Path(os.environ["FAKE_MAMBA"], "mamba_ssm")
    (package / "__init__.py").write_text("")
    (package / "ops" / "triton").mkdir(parents=True)
    for name in ("__init__", "ops/__init__", "ops/triton/__init__", "ops/triton/ssd_combined",
                 "ops/triton/layernorm_gated"):
        (package / f"{name}.py").write_text("")
'''


def stand_in(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment that runs setup_env.sh on the stand-in interpreter (mamba_ssm not importable)."""
    venv_bin, mamba, site = tmp_path / "venv" / "bin", tmp_path / "mamba", tmp_path / "site"
    for folder in (venv_bin, mamba / "mamba_ssm", site):
        folder.mkdir(parents=True)
    (mamba / "mamba_ssm" / "__init__.py").write_text(
        "raise ModuleNotFoundError('mamba_ssm (stand-in: not installed)')\n")
    (tmp_path / "fake_pip.py").write_text(FAKE_PIP)
    python = venv_bin / "python"
    python.write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m pip" ]; then shift 2; exec {sys.executable} {tmp_path / "fake_pip.py"} "$@"; fi
case "$*" in *sysconfig*) echo {site}; exit 0;; esac
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_WITH_MAMBA", "HFSDP_MAMBA_WHEEL", "PYTHONPATH")}
    # No prebuilt wheel: the checkout's .gpu-wheels/ (a GPU set-up's) must not decide what is tested.
    (tmp_path / "no-wheels").mkdir()
    env.update(VENV=str(tmp_path / "venv"), PYTHONPATH=str(mamba), FAKE_MAMBA=str(mamba),
               HFSDP_WHEEL_DIR=str(tmp_path / "no-wheels"),
               FAKE_PIP_LOG=str(tmp_path / "pip.log"), **extra)
    return env


def run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def pip_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("fail, works", [
    ("^install .*huggingface_hub", "1"), ("^wheel ", "1"), (r"^install .*\.whl$", "1"), ("", "0"),
], ids=["build-requirements-fail", "build-fails", "install-fails", "installed-but-does-not-import"])
def test_setup_env_fails_when_mamba_cannot_be_installed(tmp_path: Path, fail: str, works: str) -> None:
    proc = run("scripts/setup_env.sh", stand_in(tmp_path, HFSDP_WITH_MAMBA="1", FAKE_PIP_FAIL=fail,
                                                FAKE_WHEEL_WORKS=works))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "mamba_ssm does not import the way Megatron imports it" in proc.stderr, proc.stderr
    assert "stand-in: not installed" in proc.stderr or fail == "", proc.stderr  # the cause, as Python saw it
    assert "HFSDP_WITH_MAMBA=0" in proc.stderr, proc.stderr
    assert "megatron-core" not in proc.stdout  # stopped there


def test_setup_env_builds_and_installs_mamba(tmp_path: Path) -> None:
    proc = run("scripts/setup_env.sh", stand_in(tmp_path, HFSDP_WITH_MAMBA="1", FAKE_WHEEL_WORKS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    calls = pip_calls(tmp_path)
    assert any(c.startswith("wheel ") and "mamba-ssm==2.3.2.post1" in c for c in calls), calls
    assert any(c.startswith("install ") and c.endswith("mamba_ssm-2.3.2.post1-py3-none-any.whl") for c in calls)
    assert (tmp_path / "site" / "selective_scan_cuda.py").is_file()


@pytest.mark.parametrize("with_mamba", ["0", "1"])
def test_setup_env_leaves_mamba_alone_when_opted_out_or_present(tmp_path: Path, with_mamba: str) -> None:
    env = stand_in(tmp_path, HFSDP_WITH_MAMBA=with_mamba)
    if with_mamba == "1":  # already importable
        env["PYTHONPATH"] = ""
    proc = run("scripts/setup_env.sh", env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not [c for c in pip_calls(tmp_path) if "mamba" in c or c.startswith("wheel")]


def test_setup_env_refuses_an_unknown_choice(tmp_path: Path) -> None:
    proc = run("scripts/setup_env.sh", stand_in(tmp_path, HFSDP_WITH_MAMBA="yes"))
    assert proc.returncode == 2 and "HFSDP_WITH_MAMBA must be 0 or 1, got 'yes'" in proc.stderr, proc.stderr


def test_the_test_command_requires_mamba_by_default(tmp_path: Path) -> None:
    proc = run("scripts/run_tests.sh", stand_in(tmp_path, FAKE_PIP_FAIL="^wheel "))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "run_tests:" not in proc.stdout and "HFSDP_WITH_MAMBA=1, and mamba_ssm" in proc.stderr


MAMBA_TEST = "tests/unit_tests/training_entry/test_entry.py::test_hybrid_provider_builds_on_cpu"


@pytest.mark.parametrize("opt_out", [True, False], ids=["HFSDP_WITH_MAMBA=0", "default"])
def test_a_mamba_test_without_mamba_skips_only_when_opted_out(tmp_path: Path, opt_out: bool) -> None:
    env = stand_in(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(REPO_ROOT)))
    env.pop("HFSDP_CI", None)  # the opt-out's own skip is the subject here, not CI's skip rule
    if opt_out:
        env["HFSDP_WITH_MAMBA"] = "0"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", MAMBA_TEST],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    if opt_out:
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout[-3000:]
        assert "HFSDP_WITH_MAMBA=0 opts out of the Mamba tests" in proc.stdout, proc.stdout[-3000:]
    else:
        assert proc.returncode == 1, proc.stdout[-3000:]
        assert "mamba_ssm does not import the way Megatron imports it" in proc.stdout, proc.stdout[-3000:]
        assert "stand-in: not installed" in proc.stdout and "HFSDP_WITH_MAMBA=0" in proc.stdout
