"""The DP=2 rehearsal: at data-parallel size 1 nothing passes through the double buffer, so two
ranks share this GPU for a few steps of the max-pool run (graphed where it can be) against its
twin without double buffering, both deterministic. It reports the pool against the plan, the home
misses and whether the losses are bit-identical; it says nothing about speed."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hfsdp import te_determinism
from hfsdp.flagsets import GRAPH_FLAGS, MAXPOOL_FLAGS
from hfsdp.functional import logparse
from hfsdp.launch import fit, pretrain, torchrun
from hfsdp.main_job.logs import IN_PROCESS_LOG, shown, stderr_into
from hfsdp.main_job.runs import MIB, train
from hfsdp.planner import pools

REHEARSAL_NPROC = 2
# Both rehearsal runs: deterministic kernels and reductions (hfsdp/te_determinism.py; Triton's
# choice pinned), so the max-pool run must reproduce its twin bit for bit.
REHEARSAL_FLAGS = ("--deterministic-mode",)


@dataclass
class Rehearsal:
    """What the DP=2 rehearsal measured (None where a run gave nothing)."""

    steps: int
    identical_steps: int | None = None
    pool_bytes: int | None = None
    planned_pool_bytes: int | None = None
    home_misses: int | None = None
    peak_allocated: tuple[int, int] | None = None  # (no double buffer, max-pool), per rank
    failed: str | None = None

    def lines(self) -> list[str]:
        if self.failed:
            return [f"DP=2 rehearsal: {self.failed}"]
        loss = ("bit-identical at every step" if self.identical_steps == self.steps
                else f"DIFFERS: identical at {self.identical_steps} of {self.steps} steps")
        pool = ("pool not measured" if self.pool_bytes is None else
                f"pool {self.pool_bytes / MIB:.2f} MiB "
                + ("= plan" if self.pool_bytes == self.planned_pool_bytes
                   else f"!= plan {(self.planned_pool_bytes or 0) / MIB:.2f} MiB"))
        out = [f"DP=2 rehearsal (2 ranks on one GPU, {self.steps} steps): max-pool vs no double buffer: "
               f"lm loss {loss}; {pool}; home misses {self.home_misses}"]
        if self.peak_allocated:
            base, pooled = self.peak_allocated
            out.append(f"  peak allocated per rank: {pooled / MIB:,.0f} MiB with max-pool, {base / MIB:,.0f} MiB "
                       f"without ({pooled / base:.3f}x); step times of this mode are not speed")
        return out


def rehearse(base: Sequence[str], steps: int, graphed: bool, workdir: str) -> Rehearsal:
    """Data-parallel size 2 on this GPU: the max-pool run (graphed when ``graphed``) and its twin
    without double buffering, with run reports (pool, home misses, peaks) and the planned pool."""
    from hfsdp.training import run_report

    twin = [f for f in base if f not in MAXPOOL_FLAGS]
    runs = {"twin": [*twin, *REHEARSAL_FLAGS],
            "maxpool": [*base, *REHEARSAL_FLAGS, *(GRAPH_FLAGS if graphed else ())]}
    out = Rehearsal(steps=steps)
    placement = torchrun.Placement(nproc=REHEARSAL_NPROC, ranks_per_gpu=REHEARSAL_NPROC)
    # Pinned Triton choices: the DP=1 runs cached timed choices for some kernels only, and two
    # ranks timing one kernel at once may choose differently; pinned, both runs take the same.
    deterministic = te_determinism.env("pin")
    in_process = os.path.join(workdir, IN_PROCESS_LOG)
    with stderr_into(in_process):
        fits = fit.preflight(placement, pretrain.training_flags(runs["maxpool"], REHEARSAL_NPROC, steps),
                             environ={**deterministic, **os.environ})
    print(fits)
    reports: dict[str, dict] = {}
    losses: dict[str, dict[int, float]] = {}
    for name, flags in runs.items():
        log, report = os.path.join(workdir, f"dp2-{name}.log"), os.path.join(workdir, f"dp2-{name}.json")
        env = {**deterministic, run_report.ENV: report}
        if train(flags, REHEARSAL_NPROC, steps, log, REHEARSAL_NPROC, env) != 0:
            out.failed = f"the {name} run failed; the end of its output is above, {shown(Path(log))} holds all of it"
            return out
        try:
            reports[name] = run_report.read(report, REHEARSAL_NPROC)
        except (OSError, ValueError) as exc:  # read() names a file that is not a report
            out.failed = f"the {name} run left no complete run report ({exc})"
            return out
        losses[name] = logparse.parse_file(log).get("lm loss", {})
    same = [s for s in range(1, steps + 1) if s in losses["twin"] and losses["twin"][s] == losses["maxpool"].get(s)]
    out.identical_steps = len(same)
    pooled = reports["maxpool"]
    out.pool_bytes = pooled.get("pool_bytes_measured")
    out.home_misses = (pooled.get("maxpool_stats") or {}).get("home_misses")
    out.peak_allocated = (reports["twin"]["peak_allocated_bytes"], pooled["peak_allocated_bytes"])
    with stderr_into(in_process):
        out.planned_pool_bytes = pools.planned_maxpool_bytes(base, REHEARSAL_NPROC)
    return out
