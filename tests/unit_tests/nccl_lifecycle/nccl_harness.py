"""Bounded multi-process harness for the NCCL-lifecycle CPU tests (gloo, 2 ranks).

A plain module with a unique name (not conftest) so test files can import it whatever other
conftest.py files the same pytest run loads.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest  # pytest.fail on a hung job
from rendezvous import file_init_methods

WORKER = Path(__file__).with_name("_dist_worker.py")
WORLD_SIZE = 2
JOB_TIMEOUT_S = 240  # hard bound per job; a normal run takes ~20-40 s, imports dominate


def child_env() -> dict[str, str]:
    """Environment whose PYTHONPATH finds the same megatron tree as this pytest process, and the
    unit-test helpers (a test file run as its own worker imports this module)."""
    import megatron.core  # `megatron` itself is a namespace package (no __file__)

    tree = str(Path(megatron.core.__file__).resolve().parents[2])
    helpers = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, helpers, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_ranks(scenario: str, out_dir: Path, n_inits: int, worker: Path = WORKER,
              timeout_s: float = JOB_TIMEOUT_S) -> list[dict[str, Any]]:
    """Start WORLD_SIZE ``worker`` processes (argv: scenario rank world out_dir init_method...),
    wait at most ``timeout_s``, return each rank's ``rank<r>.json`` from out_dir.

    A worker gets ``n_inits`` ``file://`` init methods, one per ``init_process_group`` it calls
    (see ``rendezvous``: no TCP port is picked, so none can be taken by another process)."""
    inits = file_init_methods(out_dir, n_inits)
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), scenario, str(r), str(WORLD_SIZE), str(out_dir), *inits],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD_SIZE)
    ]
    deadline = time.monotonic() + timeout_s
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{scenario} job exceeded {timeout_s} s (hang)")
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{log[-4000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
