"""Shared bounded multi-process harness for the NCCL-lifecycle CPU tests (gloo, 2 ranks)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

WORKER = Path(__file__).with_name("_dist_worker.py")
WORLD_SIZE = 2
JOB_TIMEOUT_S = 240  # hard bound per job; a normal run takes ~20-40 s, imports dominate


def free_ports(n: int) -> List[int]:
    """Distinct free TCP ports (bound together so they cannot collide with each other)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def child_env() -> Dict[str, str]:
    """Environment whose PYTHONPATH finds the same megatron tree as this pytest process."""
    import megatron.core  # `megatron` itself is a namespace package (no __file__)

    tree = str(Path(megatron.core.__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_ranks(scenario: str, out_dir: Path, n_ports: int) -> List[Dict[str, Any]]:
    """Start WORLD_SIZE worker processes, wait at most JOB_TIMEOUT_S, return per-rank JSON."""
    ports = [str(p) for p in free_ports(n_ports)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(r), str(WORLD_SIZE), str(out_dir), *ports],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD_SIZE)
    ]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{scenario} job exceeded {JOB_TIMEOUT_S} s (hang)")
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{log[-4000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="session")
def lifecycle_results(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    """One 2-rank gloo job running warmup, eager-group and teardown scenarios in sequence."""
    return run_ranks("lifecycle", tmp_path_factory.mktemp("lifecycle"), n_ports=4)
