"""The product's launchers pass the caller's environment through unchanged; ``--env`` adds to it.

NVLink multicast is the user's choice: NCCL_NVLS_ENABLE=1 in the caller's environment must arrive
unchanged in the job, and only our GPU test scripts (tests/gpu) pin and check the guard.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp.functional import run_case
from hfsdp.launch.env import job_env, parse_assignments
from hfsdp.nvls_guard import NVLS_SAFE_ENV, guard_violations
from hfsdp.slurm import sbatch
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
SMOKE = REPO_ROOT / "tests/functional_tests/test_cases/smoke/cpu_gloo_smoke"
PRINT_ENV = ("import os; print('NVLS=' + os.environ.get('NCCL_NVLS_ENABLE', '<unset>'), "
             "'X=' + os.environ.get('X', '<unset>'))")


def test_parse_assignments():
    assert parse_assignments(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    for bad in ("A", "=1", "1A=2", "A B=1"):
        with pytest.raises(UserError, match="is not KEY=VALUE"):
            parse_assignments([bad])
    assert job_env({"A": "1", "B": "2"}, {"B": None, "C": "3"}, {"A": "9"}) == {"A": "9", "C": "3"}


def test_functional_driver_passes_the_callers_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = run_case.run_env({"OMP_NUM_THREADS": "1"})
    assert env["NCCL_NVLS_ENABLE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert not set(NVLS_SAFE_ENV) - {"NCCL_NVLS_ENABLE"} & set(env) - set(os.environ)  # nothing forced
    rec = run_case.run_logged([sys.executable, "-c", PRINT_ENV], env, tmp_path / "run1.log", timeout_s=60)
    assert rec.returncode == 0 and "NVLS=1 X=<unset>" in (tmp_path / "run1.log").read_text()
    # --env wins over both the caller and the case's ENV_VARS.
    env = run_case.run_env({"NCCL_NVLS_ENABLE": "1"}, parse_assignments(["NCCL_NVLS_ENABLE=0", "X=y"]))
    run_case.run_logged([sys.executable, "-c", PRINT_ENV], env, tmp_path / "run2.log", timeout_s=60)
    assert "NVLS=0 X=y" in (tmp_path / "run2.log").read_text()


FAKE_SRUN = """#!/bin/bash
# srun stand-in: drop srun's own options, run the command once (one node, one task).
while [[ "${1:-}" == --* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = "#!/bin/bash\necho localhost\n"
# Stands in for `python -m hfsdp.functional.run_case ...` inside the job: records what it got.
FAKE_PYTHON = """#!/bin/bash
echo "NVLS=${NCCL_NVLS_ENABLE-<unset>} X=${X-<unset>}" \
  "MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST-<unset>}" > "$FAKE_OUT"
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize(("env_opt", "expected"), [
    ({}, "NVLS=1 X=<unset> MULTICAST=<unset>"),
    ({"NCCL_NVLS_ENABLE": "0", "X": "a b"}, "NVLS=0 X=a b MULTICAST=<unset>"),
])
def test_sbatch_job_gets_the_callers_environment(tmp_path, env_opt, expected):
    """Run the generated script's body with stand-ins for srun/scontrol and the driver."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "srun", FAKE_SRUN)
    _executable(bin_dir / "scontrol", FAKE_SCONTROL)
    fake_python = _executable(tmp_path / "fake_python", FAKE_PYTHON)
    spec = sbatch.JobSpec(case_dir=SMOKE, repo_root=REPO_ROOT, log_dir=tmp_path / "logs", use_gpus=False,
                          python=str(fake_python), env=env_opt)
    script = sbatch.write_sbatch(spec)
    mentions = re.findall(r".*(?:NVLS|MULTICAST).*", script.read_text())
    # Only what --env named: exported, and passed to the driver (where it wins over ENV_VARS).
    assert [m.split(" --")[0] for m in mentions] == (
        ["export NCCL_NVLS_ENABLE=0", 'RUN_CASE=("$PY" -m hfsdp.functional.run_case "$CASE"'] if env_opt else [])
    assert not env_opt or "--env NCCL_NVLS_ENABLE=0 --env 'X=a b')" in mentions[1]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NCCL_NVLS_ENABLE": "1",
           "FAKE_OUT": str(tmp_path / "seen"), "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}
    env.pop("TORCH_SYMM_MEM_DISABLE_MULTICAST", None)
    env.pop("X", None)
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "seen").read_text().strip() == expected


def test_submit_env_option_reaches_the_script(tmp_path):
    from hfsdp.slurm.submit import main

    assert main([str(SMOKE), "--log-dir", str(tmp_path), "--dry-run", "--cpu",
                 "--env", "NCCL_NVLS_ENABLE=0", "--env", "NCCL_DEBUG=INFO"]) == 0
    text = next(tmp_path.glob("*.sbatch")).read_text()
    assert "export NCCL_NVLS_ENABLE=0" in text and "export NCCL_DEBUG=INFO" in text
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in text


def test_product_launchers_do_not_import_the_gpu_test_guard():
    """hfsdp.nvls_guard belongs to tests/gpu; no product module may use it to force the guard."""
    imports = re.compile(r"^\s*(from hfsdp\.nvls_guard |from hfsdp import .*\bnvls_guard\b|import hfsdp\.nvls_guard)",
                         re.M)
    users = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "hfsdp").rglob("*.py")
                   if p.name != "nvls_guard.py" and imports.search(p.read_text()))
    assert users == []
    for name in ("run_case.py", "sbatch.py", "run.py"):
        for path in (REPO_ROOT / "hfsdp").rglob(name):
            assert "NCCL_NVLS_ENABLE" not in path.read_text(), path


GPU_SCRIPTS = sorted((REPO_ROOT / "tests/gpu").glob("*.sh")) + [REPO_ROOT / "tests/gpu/nccl_lifecycle/run_all.sh"]


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_our_gpu_scripts_set_and_check_the_guard(script):
    """Each GPU script exports the three switches and refuses to run when they are not in force."""
    text = script.read_text()
    exports = " ".join(f"{k}={v}" for k, v in NVLS_SAFE_ENV.items())
    assert f"export {exports}" in text, f"{script.name} does not export {exports}"
    assert "-m hfsdp.nvls_guard" in text, f"{script.name} does not check the guard"
    assert text.index(f"export {exports}") < text.index("-m hfsdp.nvls_guard"), "checked before it is set"


def test_the_guard_check_refuses_and_passes():
    env = {k: v for k, v in os.environ.items() if k not in NVLS_SAFE_ENV}
    bad = subprocess.run([sys.executable, "-m", "hfsdp.nvls_guard"], cwd=REPO_ROOT,
                         env={**env, "NCCL_NVLS_ENABLE": "1"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "NCCL_NVLS_ENABLE" in bad.stderr
    good = subprocess.run([sys.executable, "-m", "hfsdp.nvls_guard"], cwd=REPO_ROOT, env={**env, **NVLS_SAFE_ENV},
                          capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert guard_violations({**env, **NVLS_SAFE_ENV}) == {}
