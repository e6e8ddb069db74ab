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
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hfsdp.atomic import loads_strict

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


class PlannerRun:
    """One planner run (:func:`planner_command`) started now, in a temporary folder of its own: without a
    GPU (``CUDA_VISIBLE_DEVICES`` empty), at a lower CPU priority (it yields the CPU to the runs it
    overlaps), its output in a file (nobody reads it while the runs go on). :meth:`result` waits for
    it; :meth:`stop` ends it if it still runs and removes its folder. ``see_gpus``: leave the GPUs
    visible, for a plan made after the runs whose Transformer Engine layers need CUDA to be built."""

    def __init__(self, flags: Sequence[str], dp_size: int, env: Mapping[str, str], lanes: Sequence[int] = (),
                 see_gpus: bool = False) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="hfsdp-plan-")
        self.path = os.path.join(self._tmp.name, "plan.json")
        with open(self.path + ".err", "w") as err:
            self.proc = subprocess.Popen(planner_command(flags, dp_size, self.path, lanes),
                                         env=dict(env) if see_gpus else {**env, "CUDA_VISIBLE_DEVICES": ""},
                                         stdout=subprocess.DEVNULL,
                                         stderr=err, preexec_fn=lambda: os.nice(PLAN_NICENESS))

    def result(self) -> tuple[dict[str, Any] | None, str]:
        """(the plan, "") once the planner ended, or (None, the end of what it said) when it failed."""
        if self.proc.wait() != 0:
            return None, Path(self.path + ".err").read_text(errors="replace")[-2000:]
        return loads_strict(Path(self.path).read_text(encoding="utf-8")), ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._tmp.cleanup()


def planned_maxpool_bytes(flags: Sequence[str], dp_size: int, env: Mapping[str, str] | None = None,
                          see_gpus: bool = False) -> int | None:
    """The max-pool double buffer's planned pool (weights + grads) for ``flags`` at ``dp_size``: one
    :class:`PlannerRun` (``see_gpus`` as there) to its end; None, what the planner said printed, when it failed."""
    run = PlannerRun(flags, dp_size, os.environ if env is None else env, see_gpus=see_gpus)
    try:
        plan, said = run.result()
    finally:
        run.stop()
    if plan is None:
        print("planner failed; continuing without the planned pool:\n" + said)
        return None
    return total(plan, "maxpool_pool_bytes")


def total(plan: Mapping[str, Any], key: str) -> int:
    """``key`` (a byte figure of each allocator) summed over the plan's allocators."""
    return sum(a[key] for a in plan["allocators"].values())


def lanes_pool_bytes(plan: Mapping[str, Any], lanes: int) -> int:
    """The ``lanes``-lane pool of the plan, summed over its allocators."""
    return sum(a["lane_plans"][str(lanes)]["pool_bytes"] for a in plan["allocators"].values())
