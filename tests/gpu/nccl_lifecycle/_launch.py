"""Bounded torchrun launcher shared by the NCCL-lifecycle GPU scripts (2 x H200).

Each experiment runs as ``torchrun --nproc-per-node 2 <script> --child <args>`` under a hard
timeout, so an NCCL hang is recorded as an outcome instead of eating the device budget.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

REPO_ROOT = Path(__file__).resolve().parents[3]
SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def assert_safety_env() -> None:
    """These machines must keep NVLink multicast off (bootstrap.sh exports the values)."""
    bad = {k: os.environ.get(k) for k, v in SAFETY_ENV.items() if os.environ.get(k) != v}
    assert not bad, f"unsafe environment, expected {SAFETY_ENV}, got {bad}"


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "/tmp/nccl_lifecycle_out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def torchrun(script: str, args: List[str], timeout_s: float, nproc: int = 2) -> Dict[str, Any]:
    """Run one 2-rank job; return rc, wall seconds, whether it timed out, and the output tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--max-restarts=0", script, "--child", *args]
    env = dict(os.environ)
    # torchrun puts the script's folder on sys.path, not the repo root with megatron/.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
    return {"cmd": " ".join(cmd[3:]), "rc": proc.returncode, "timed_out": timed_out,
            "wall_s": round(time.monotonic() - start, 2), "tail": out[-3000:]}


def write_results(name: str, results: Dict[str, Any]) -> Path:
    path = out_dir() / f"{name}.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    return path
