"""Golden-value files and comparisons, in Megatron's format and with Megatron's thresholds.

File: ``golden_values_{environment}_{platform}.json`` =
``{"<metric>": {"start_step": 1, "end_step": N, "step_interval": 1, "values": {"1": v, ...}}}``.

Thresholds (upstream ``CHECK_THRESHOLDS``, plus one deliberate change):
* ``lm loss``: exact (the recipes run ``--deterministic-mode``); the value compared is the one
  Megatron prints (``%.6E``), so "exact" means all printed digits agree.
* ``num-zeros``: rtol 0.20.  ``mem-*``: rtol 0.05 per step.
* ``iteration-time``: median over steps after ``ITER_TIME_WARMUP`` steps, rtol 0.15 (upstream uses
  0.05 with medians over steps 5-20 of 100-step GPU-bound runs). Our cases are tiny (< 100 ms
  per step), so an iteration is dominated by host-side Python/launch overhead, whose run-to-run
  jitter on a shared node is ~5-10 %; 0.05 would flake, 0.15 still catches a 2x regression
  such as an allocator falling back to per-step cudaMalloc. Override with
  ``HFSDP_ITER_TIME_RTOL``.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from hfsdp.functional.logparse import Metrics

ITER_TIME_WARMUP = 3
RTOL = {"num-zeros": 0.20}
MEM_RTOL = 0.05
ITER_TIME_RTOL_DEFAULT = 0.15


@dataclass(frozen=True)
class Mismatch:
    metric: str
    step: int | None
    expected: float | None
    actual: float | None
    why: str

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step is not None else "median"
        return f"{self.metric} @ {where}: expected {self.expected!r}, got {self.actual!r} ({self.why})"


def to_golden(metrics: Metrics, names: tuple[str, ...] | list[str]) -> dict:
    """Metrics -> golden JSON object (only ``names`` that were measured)."""
    out: dict = {}
    for name in names:
        series = metrics.get(name)
        if not series:
            continue
        steps = sorted(series)
        out[name] = {
            "start_step": steps[0],
            "end_step": steps[-1],
            "step_interval": (steps[1] - steps[0]) if len(steps) > 1 else 1,
            "values": {str(s): series[s] for s in steps},
        }
    return out


def from_golden(obj: dict) -> Metrics:
    return {name: {int(k): float(v) for k, v in spec["values"].items()} for name, spec in obj.items()}


def load(path: Path) -> Metrics:
    return from_golden(json.loads(Path(path).read_text()))


def save(path: Path, metrics: Metrics, names: tuple[str, ...] | list[str]) -> None:
    Path(path).write_text(json.dumps(to_golden(metrics, names), indent=2, sort_keys=True) + "\n")


def _iter_time_rtol() -> float:
    return float(os.environ.get("HFSDP_ITER_TIME_RTOL", ITER_TIME_RTOL_DEFAULT))


def compare(expected: Metrics, actual: Metrics, names: tuple[str, ...] | list[str],
            steps: set[int] | None = None, loss_rtol: float = 0.0) -> list[Mismatch]:
    """Mismatches of ``actual`` against ``expected`` for ``names``; ``steps`` limits the steps.

    ``loss_rtol`` > 0 relaxes ``lm loss`` from identical to that relative tolerance (only a
    resume into another unit layout asks for it; recipe.py ``RESUME_COMPARE``).
    """
    problems: list[Mismatch] = []
    for name in names:
        exp = expected.get(name)
        if exp is None:
            problems.append(Mismatch(name, None, None, None, "metric missing from golden"))
            continue
        act = actual.get(name, {})
        wanted = sorted(s for s in exp if steps is None or s in steps)
        if name == "iteration-time":
            e = [exp[s] for s in wanted if s > ITER_TIME_WARMUP]
            a = [act[s] for s in wanted if s > ITER_TIME_WARMUP and s in act]
            if not e or not a:
                problems.append(Mismatch(name, None, None, None, "no post-warm-up steps"))
                continue
            me, ma = statistics.median(e), statistics.median(a)
            if abs(ma - me) > _iter_time_rtol() * abs(me):
                problems.append(Mismatch(name, None, me, ma, f"median rtol {_iter_time_rtol()}"))
            continue
        for step in wanted:
            if step not in act:
                problems.append(Mismatch(name, step, exp[step], None, "step missing"))
                continue
            e, a = exp[step], act[step]
            if name == "lm loss":
                if loss_rtol == 0.0 and e != a:
                    problems.append(Mismatch(name, step, e, a, "must be identical"))
                elif loss_rtol and not abs(a - e) <= loss_rtol * abs(e):  # NaN fails too
                    problems.append(Mismatch(name, step, e, a, f"rtol {loss_rtol}"))
            else:
                rtol = MEM_RTOL if name.startswith("mem-") else RTOL.get(name, 0.05)
                if abs(a - e) > rtol * abs(e) + (1.0 if name == "num-zeros" else 0.0):
                    problems.append(Mismatch(name, step, e, a, f"rtol {rtol}"))
    return problems
