"""Planned double-buffer pools: the planner run as a CPU-only subprocess, and what its plan says.

Both the benchmark (hfsdp/bench/run.py) and the main job's rehearsal (hfsdp/main_job/rehearsal.py)
compare the pool a run held with the plan; this module is what they share, so that neither reaches
into the other.

[Note: no pool at DP=1] At data-parallel size 1 Megatron-FSDP never all-gathers a unit, so nothing
passes through the double buffer and no pool is allocated. The planner plans 0 bytes of pool there
and says so (:func:`hfsdp.planner.report.format_report`), and every tool that compares a measured
pool with the plan says it in the words of :data:`NEVER_GATHERED`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

NEVER_GATHERED = "at data-parallel size 1 Megatron-FSDP never all-gathers a unit"
NO_POOL = f"{NEVER_GATHERED}, so no double-buffer pool is allocated"
PLAN_NICENESS = 10  # the planner yields the CPU to the runs it overlaps


def pool_allocated(dp_size: int) -> bool:
    """Whether a double-buffer pool exists at data-parallel size ``dp_size`` (see the note)."""
    return dp_size > 1


def planner_command(flags: Sequence[str], dp_size: int, out: str, lanes: Sequence[int] = ()) -> list[str]:
    """The planner (``python -m hfsdp.planner``) for ``flags`` at ``dp_size``, its JSON plan to ``out``;
    ``lanes``: the lane counts to plan besides the default."""
    return [sys.executable, "-m", "hfsdp.planner", *flags, "--plan-dp-size", str(dp_size),
            *(["--plan-lanes", ",".join(map(str, lanes))] if lanes else []), "--plan-json", out]


def start_planner(flags: Sequence[str], dp_size: int, out: str, env: Mapping[str, str], stderr: IO[Any],
                  lanes: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """:func:`planner_command` started without a GPU (``CUDA_VISIBLE_DEVICES`` empty), at a lower CPU
    priority, its output to ``stderr`` (a file: nobody reads it while it runs)."""
    return subprocess.Popen(planner_command(flags, dp_size, out, lanes),
                            env={**env, "CUDA_VISIBLE_DEVICES": ""}, stdout=subprocess.DEVNULL, stderr=stderr,
                            preexec_fn=lambda: os.nice(PLAN_NICENESS))


def total(plan: Mapping[str, Any], key: str) -> int:
    """``key`` (a byte figure of each allocator) summed over the plan's allocators."""
    return sum(a[key] for a in plan["allocators"].values())


def lanes_pool_bytes(plan: Mapping[str, Any], lanes: int) -> int:
    """The ``lanes``-lane pool of the plan, summed over its allocators."""
    return sum(a["lane_plans"][str(lanes)]["pool_bytes"] for a in plan["allocators"].values())
