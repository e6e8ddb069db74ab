"""The TE GPU scripts' CPU-checkable behaviour: what run_functional.sh hands the batch runner, and
refusing to run without Transformer Engine or without a GPU (this machine has neither)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp.nvls_guard import NVLS_SAFE_ENV

REPO_ROOT = Path(__file__).resolve().parents[3]
CASES = REPO_ROOT / "tests/functional_tests/test_cases"


def script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OUT", "HFSDP_FUNCTIONAL_OUT", "STAGES", "HFSDP_GPU_ENV_READY")}
    path = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    # The scripts call `python`/`python3`: the interpreter running these tests (CI does not
    # activate its venv).
    bin_path = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env.update(NVLS_SAFE_ENV, PYTHONPATH=path, PATH=bin_path, OUT=str(tmp_path / "out"),
               HFSDP_GPU_SITE=str(tmp_path / "site"))
    env.update(extra)
    return env


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, ["--ranks-per-gpu", "1", "--jobs", "1"]),
    ({"RANKS_PER_GPU": "2", "JOBS": "3", "NPROC": "4"}, ["--ranks-per-gpu", "2", "--jobs", "3", "--nproc", "4"]),
])
def test_run_functional_hands_the_cases_to_the_batch_runner(tmp_path: Path, extra: dict, expected: list) -> None:
    """run_functional.sh --record-missing with the batch runner stood in by a fake `python`; which
    golden each case is held to or records is the batch runner's (tests/unit_tests/functional)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m hfsdp.functional.batch" ]; then
  echo "$*" >> {calls}; exit 0
fi
exec {sys.executable} "$@"
""")
    (bin_dir / "python").chmod(0o755)
    cases = ["hybrid/hybrid_mcore_te_fsdp_1gpu_eager_no_db", "hybrid/hybrid_mcore_local_fsdp_1gpu_eager_no_db"]
    env = script_env(tmp_path, PLATFORM="dgx_h100", HFSDP_FUNCTIONAL_OUT=str(tmp_path / "work"),
                     PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **extra)
    proc = subprocess.run(["bash", "tests/gpu/run_functional.sh", "--record-missing", *cases], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = calls.read_text().splitlines()
    args = line.split()
    assert args[2:4] == [f"tests/functional_tests/test_cases/{c}" for c in cases]
    assert "--record-missing" in args and args[args.index("--platform") + 1] == "dgx_h100"
    for name, value in zip(expected[::2], expected[1::2], strict=True):
        assert args[args.index(name) + 1] == value, (name, line)
    assert (tmp_path / "out" / "functional.tgz").is_file()


def test_run_te_refuses_without_transformer_engine(tmp_path: Path) -> None:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    from hfsdp.training.requirements import importable

    if importable("transformer_engine") and importable("causal_conv1d"):
        pytest.skip("Transformer Engine and causal-conv1d are installed here")
    proc = subprocess.run(["bash", "tests/gpu/run_te.sh"], cwd=REPO_ROOT, env=script_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-2000:]
    assert "run_te: not importable:" in text and "nothing run" in text, text[-2000:]
    assert not (tmp_path / "out" / "functional_summary.txt").exists()


def test_fused_mamba_script_needs_a_gpu(tmp_path: Path) -> None:
    """Two ranks on 2 GPUs or sharing 1 (hfsdp.launch); with none, the launcher says so first."""
    import torch

    if torch.cuda.device_count() >= 1:
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(["bash", "tests/gpu/run_fused_mamba_fixedpool.sh"], cwd=REPO_ROOT, env=script_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr  # the script tees the launcher's output
    assert proc.returncode == 2 and "this machine has none" in text, text[-2000:]
    assert not list((tmp_path / "out").glob("fused_mamba_*_*.json"))
