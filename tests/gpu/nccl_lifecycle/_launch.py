"""Bounded torchrun launcher shared by the NCCL-lifecycle GPU scripts (2 ranks; 1 or 2 GPUs).

Each experiment runs as ``torchrun --nproc-per-node 2 <script> --child <args>`` under a hard
timeout (hfsdp.proc.run_group: stacks, then SIGTERM, then SIGKILL of the whole group), so an
NCCL hang is recorded as an outcome, with each rank's stacks, instead of eating the device budget.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from tests/gpu/nccl_lifecycle

from hfsdp.launch import torchrun as launch  # noqa: E402
from hfsdp.nvls_guard import assert_guard  # noqa: E402
from hfsdp.proc import run_group  # noqa: E402

# Stacks, then SIGTERM, then SIGKILL fit inside a job's timeout: run_all.sh's outer limits add up
# the child timeouts, so a hang must not take longer than its timeout.
STACK_GRACE_S, TERM_GRACE_S = 3.0, 5.0


def assert_nvls_guard() -> None:
    """These machines must keep NVLink multicast off (run_all.sh exports and checks the values)."""
    assert_guard()


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "/tmp/nccl_lifecycle_out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def torchrun(script: str, args: list[str], timeout_s: float, nproc: int = 2) -> dict[str, Any]:
    """Run one ``nproc``-rank job; return rc, wall seconds, whether it timed out, and the output tail.

    With fewer GPUs than ranks, the ranks share them ([Note: several ranks on one GPU] in
    hfsdp/launch/torchrun.py).
    """
    import torch

    gpus = max(torch.cuda.device_count(), 1)
    placement = launch.Placement(nproc=nproc, ranks_per_gpu=launch.ranks_per_gpu_for(nproc, gpus))
    cmd = launch.command(placement, [script, "--child", *args])
    env = dict(os.environ)
    # torchrun puts the script's folder on sys.path, not the repo root with megatron/.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    lines: list[str] = []
    ended = run_group(cmd, timeout_s=max(timeout_s - STACK_GRACE_S - TERM_GRACE_S, 1.0), env=env,
                      on_line=lines.append, stack_grace_s=STACK_GRACE_S, term_grace_s=TERM_GRACE_S)
    out = "".join(lines)
    return {"cmd": " ".join(cmd[3:]), "ranks_per_gpu": placement.ranks_per_gpu, "rc": ended.returncode,
            "timed_out": ended.timed_out,
            "signals": ended.signals, "wall_s": round(ended.seconds, 2), "tail": out[-3000:]}


def write_results(name: str, results: dict[str, Any]) -> Path:
    path = out_dir() / f"{name}.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    return path
