"""Golden-value files and comparisons, in Megatron's format and with Megatron's thresholds.

File: ``golden_values_{environment}_{platform}.json`` =
``{"<metric>": {"start_step": 1, "end_step": N, "step_interval": 1, "values": {"1": v, ...}}}``.

[Note: golden keys] A golden's (and a ``metrics.json``'s) top-level keys are metric names, each
one of ``logparse.METRIC_NAMES`` (what the log parser measures: one list), plus at most the one
reserved key ``ENVIRONMENT_KEY`` (``"environment"``), an object describing the environment the
golden was recorded in, which is no metric: every reader here leaves it out of the metrics. Any
other key (``"lm_loss"``, ``"lm loss "``) is refused naming it and the known names: a misspelt
metric would otherwise never be compared.

Thresholds (upstream ``CHECK_THRESHOLDS``, plus one deliberate change):
* ``lm loss`` and ``lm loss validation`` (``LOSS_METRICS``): exact (the recipes run
  ``--deterministic-mode``); the value compared is the one Megatron prints (``%.6E``), so
  "exact" means all printed digits agree.
* ``num-zeros``: rtol 0.20.  ``mem-*``: rtol 0.05 per step.
* ``iteration-time``: the median over steps after ``ITER_TIME_WARMUP`` steps may be at most
  ``ITER_TIME_MAX_RATIO`` (2.0) times the golden's; a faster run never fails. Upstream checks
  0.05 both ways on 100-step GPU-bound runs; ours are host-bound (see the Note below). A median
  more than ``ITER_TIME_NOTE_RTOL`` off the golden either way is reported
  (:func:`iteration_time_drift`), not failed. Override the ratio with
  ``HFSDP_ITER_TIME_MAX_RATIO``.

[Note: iteration time is a host measurement]
The 1-GPU cases take short steps, and most of an eager step is host-side Python and kernel
launches, so the same code, bits and GPU kind run at different speeds from one machine to the
next: rerun on later machine starts of the same GPU kind, a golden's own tree has missed its
recorded median by far more than ``ITER_TIME_NOTE_RTOL``, so a band that narrow both ways fails
correct runs (docs/results.md has the runs). Across machines a functional test can only answer a
coarse question: did the step get more than 2x slower, as when graphed steps fall back to eager
ones or an allocator falls back to per-step cudaMalloc? Smaller speed changes are the
benchmark's job, which measures both sides in one invocation on one host (docs/benchmark.md).
"""

from __future__ import annotations

import difflib
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfsdp.atomic import loads_strict, write_json_atomic
from hfsdp.functional import environment
from hfsdp.functional.logparse import METRIC_NAMES, Metrics
from hfsdp.usererror import UserError, quoted

ENVIRONMENT_KEY = environment.KEY  # "environment": the one top-level key that is no metric ([Note: golden keys])
ITER_TIME_WARMUP = 3
# Compared exactly (or within a resume's loss_rtol); the order is the one reports use.
LOSS_METRICS = ("lm loss", "lm loss validation")
RTOL = {"num-zeros": 0.20}
MEM_RTOL = 0.05
ITER_TIME_MAX_RATIO = 2.0  # a functional run fails only when its median step is this much slower
ITER_TIME_NOTE_RTOL = 0.15  # beyond this either way the driver prints a note: another machine, or a stale golden


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


def _json_number(value: float) -> float | str:
    """``value``, or for NaN and infinities their name (``"nan"``, ``"inf"``, ``"-inf"``): strict JSON
    has no such numbers ([Note: strict JSON] in hfsdp/atomic.py); ``float()`` reads the name back,
    and :func:`check_golden` refuses it as not finite."""
    return value if math.isfinite(value) else repr(float(value))


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
            "values": {str(s): _json_number(series[s]) for s in steps},
        }
    return out


class GoldenError(UserError):
    """A golden file that cannot be read or is not complete and finite; the message names it."""


def _steps_text(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    runs: list[str] = []
    for step in sorted(steps):
        if runs and runs[-1].split("-")[-1] == str(step - 1):
            runs[-1] = f"{runs[-1].split('-')[0]}-{step}"
        else:
            runs.append(str(step))
    return ", ".join(runs)


def _never_negative(name: str) -> bool:
    """Step times, memory and counts of zeros are never below 0 (losses may be)."""
    return name in ("iteration-time", "num-zeros") or name.startswith("mem-")


def _metric_problems(name: str, spec: Any) -> list[str]:
    """Why one metric's entry is not complete and finite (empty list: it is)."""
    if not isinstance(spec, dict):
        return [f"{name}: expected an object with start_step, end_step, step_interval and values"]
    values = spec.get("values")
    if not isinstance(values, dict):
        return [f"{name}: 'values' must be a mapping of step -> number, got {type(values).__name__}"]
    if not values:
        return [f"{name}: no values"]
    problems: list[str] = []
    steps: list[int] = []
    for key, value in values.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and key == str(int(key))):
            problems.append(f"{name}: step {key!r} is not a step as the driver writes it (a whole number, "
                            "no sign, spaces or leading zeros)")
            continue
        step = int(key)
        steps.append(step)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{name}: value at step {step} is not a finite JSON number ({value!r})")
        elif value < 0 and _never_negative(name):
            problems.append(f"{name}: value at step {step} is negative ({value!r}), which no run measures")
    bounds = [spec.get(k) for k in ("start_step", "end_step", "step_interval")]
    int_bounds = [b for b in bounds if isinstance(b, int) and not isinstance(b, bool)]
    if len(int_bounds) != len(bounds) or int_bounds[2] < 1:
        problems.append(f"{name}: start_step, end_step and step_interval must be integers (interval >= 1), "
                        f"got {bounds}")
    elif steps:
        start, end, interval = int_bounds
        expected = set(range(start, end + 1, interval))
        if missing := sorted(expected - set(steps)):
            problems.append(f"{name}: steps {_steps_text(missing)} missing between start_step {start} "
                            f"and end_step {end}")
        if extra := sorted(set(steps) - expected):
            problems.append(f"{name}: steps {_steps_text(extra)} lie outside start_step {start}..end_step {end} "
                            f"(interval {interval})")
    return problems


def unknown_names(obj: Any) -> list[str]:
    """The top-level keys of a golden object that are neither a metric the driver measures nor
    ``ENVIRONMENT_KEY`` ([Note: golden keys]); [] for an object that is no mapping."""
    if not isinstance(obj, dict):
        return []
    return [name for name in obj if name != ENVIRONMENT_KEY and name not in METRIC_NAMES]


def unknown_names_text(names: list[str]) -> str:
    """``['lm_loss']`` -> "'lm_loss' (did you mean 'lm loss'?), which is no metric name the driver measures
    (those are: ...)"."""
    shown = []
    for name in names:
        near = difflib.get_close_matches(name, METRIC_NAMES, n=1, cutoff=0.75)
        shown.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    which = "is no metric name" if len(names) == 1 else "are no metric names"
    return f"{', '.join(shown)}, which {which} the driver measures (those are: {', '.join(METRIC_NAMES)})"


def metric_names(obj: dict) -> list[str]:
    """A golden object's metric names: its keys but ``ENVIRONMENT_KEY``."""
    return [name for name in obj if name != ENVIRONMENT_KEY]


def check_golden(obj: Any, names: tuple[str, ...] | list[str]) -> list[str]:
    """Problems that make a golden object unusable for ``names``: every metric complete and finite."""
    if not isinstance(obj, dict):
        return [f"expected a JSON object of metrics, got {type(obj).__name__}"]
    problems: list[str] = []
    for name in names:
        if name not in obj:
            problems.append(f"{name}: missing")
        else:
            problems.extend(_metric_problems(name, obj[name]))
    return problems


def read_json(path: Path) -> Any:
    """A golden or metrics file as the driver writes it: strict JSON, one value for every key."""
    return loads_strict(path.read_text(encoding="utf-8"))


def _golden_json(path: Path) -> tuple[Any, str]:
    """A golden's JSON and the way to a new one; a GoldenError names a file that cannot be read."""
    fix = (f"re-record it with `python -m hfsdp.functional.run_case {quoted(path.parent)} --record` in the "
           "environment and on the platform it is for")
    try:
        return read_json(path), fix
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise GoldenError(f"golden {path} cannot be read as JSON: {exc}", fix) from exc


def read_golden(path: Path, names: tuple[str, ...] | list[str]) -> Metrics:
    """Load a golden file for ``names``; a GoldenError names the file and everything wrong with it."""
    path = Path(path)
    obj, fix = _golden_json(path)
    if unknown := unknown_names(obj):
        raise GoldenError(f"golden {path} names {unknown_names_text(unknown)}",
                          f"rename or remove {'it' if len(unknown) == 1 else 'them'} in {path} (the top-level keys "
                          f"are metric names and {ENVIRONMENT_KEY!r}), or {fix[0].lower()}{fix[1:]}")
    problems = check_golden(obj, names)
    if problems:
        raise GoldenError(f"golden {path} is not complete and finite: " + "; ".join(problems), fix)
    return from_golden({name: obj[name] for name in names})


def uncovered_steps(expected: Metrics, actual: Metrics, names: tuple[str, ...] | list[str]) -> list[str]:
    """Steps a run logged that the golden does not hold (a golden shorter than the run)."""
    out = []
    for name in names:
        beyond = sorted(set(actual.get(name, {})) - set(expected.get(name, {})))
        if beyond:
            last = max(expected.get(name, {}), default=None)
            out.append(f"{name}: the run logged steps {_steps_text(beyond)}, the golden stops at step {last}")
    return out


def from_golden(obj: dict) -> Metrics:
    """The metrics of a golden object (checked by :func:`check_golden`); ``ENVIRONMENT_KEY`` is no metric."""
    return {name: {int(k): float(v) for k, v in obj[name]["values"].items()} for name in metric_names(obj)}


def load(path: Path) -> Metrics:
    """Every metric of a golden (or metrics.json) file, each checked complete and finite."""
    path = Path(path)
    try:
        obj = read_json(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise GoldenError(f"{path} cannot be read as JSON: {exc}", "re-create it with the functional driver") from exc
    return read_golden(path, metric_names(obj) if isinstance(obj, dict) else [])


def read_environment(path: Path) -> environment.Environment | None:
    """The environment block of a golden or metrics file ([Note: the environment of a golden] in
    environment.py); None where the file records none. A block that is not one is a GoldenError."""
    path = Path(path)
    obj, fix = _golden_json(path)
    if not isinstance(obj, dict) or environment.KEY not in obj:
        return None
    try:
        return environment.from_json(obj[environment.KEY])
    except ValueError as exc:
        raise GoldenError(f"golden {path} has no usable environment block: {exc}", fix) from None


def save(path: Path, metrics: Metrics, names: tuple[str, ...] | list[str],
         env: environment.Environment | None = None) -> None:
    """Write atomically (a reader never sees half a file), with ``env`` as its environment block."""
    obj = to_golden(metrics, names)
    if env is not None:
        obj[environment.KEY] = env.to_json()
    write_json_atomic(path, obj, indent=2, sort_keys=True)


def incomplete_metrics(metrics: Metrics, names: tuple[str, ...] | list[str]) -> list[str]:
    """Why ``metrics`` cannot be recorded as a golden for ``names`` (empty list: it can)."""
    return check_golden(to_golden(metrics, names), names)


def iter_time_max_ratio() -> float:
    """``ITER_TIME_MAX_RATIO``, or ``HFSDP_ITER_TIME_MAX_RATIO`` when set (a number >= 1)."""
    raw = os.environ.get("HFSDP_ITER_TIME_MAX_RATIO")
    if raw is None:
        return ITER_TIME_MAX_RATIO
    try:
        ratio = float(raw)
    except ValueError:
        ratio = math.nan
    if not ratio >= 1.0:  # NaN fails too
        raise UserError(f"HFSDP_ITER_TIME_MAX_RATIO={raw!r} is not a number >= 1",
                        f"unset it (default {ITER_TIME_MAX_RATIO}) or give the largest slow-down "
                        "a run may have against its golden, e.g. 2.0")
    return ratio


def _iter_time_medians(expected: dict[int, float], actual: dict[int, float],
                       steps: list[int]) -> tuple[float, float] | None:
    """Median step time of golden and run after the warm-up (None: no such steps)."""
    exp_times = [expected[s] for s in steps if s > ITER_TIME_WARMUP]
    act_times = [actual[s] for s in steps if s > ITER_TIME_WARMUP and s in actual]
    if not exp_times or not act_times:
        return None
    return statistics.median(exp_times), statistics.median(act_times)


def iteration_time_drift(expected: Metrics, actual: Metrics) -> str | None:
    """A note when the run's median step is more than ``ITER_TIME_NOTE_RTOL`` off the golden's."""
    exp, act = expected.get("iteration-time"), actual.get("iteration-time")
    medians = _iter_time_medians(exp, act, sorted(exp)) if exp and act else None
    if medians is None or abs(medians[1] - medians[0]) <= ITER_TIME_NOTE_RTOL * medians[0]:
        return None
    me, ma = medians
    if me <= 0:  # a golden of zero-length steps: no ratio to give
        return (f"iteration-time median {ma * 1000:.1f} ms against the golden's {me * 1000:.1f} ms, which is "
                "no step time: a golden to re-record")
    return (f"iteration-time median {ma * 1000:.1f} ms is {ma / me:.2f}x the golden's {me * 1000:.1f} ms "
            f"(fails only above {iter_time_max_ratio()}x): another machine, or a golden to re-record")


# [Note: goldens of the several-ranks-per-GPU mode]
# Ranks that share a GPU compute the same bits as ranks on their own GPUs (every rank is its own
# process), so losses and num-zeros compare exactly across the two. Step times do not: the ranks
# time-slice one GPU and talk over loopback sockets. Per-rank memory is each process's own and is
# held within the mode; a real-GPU golden's memory was measured on other hardware and transports,
# so it is not held against the mode. Goldens recorded in the mode carry a platform name ending in ``SHARED_SUFFIX``
# (``dgx_h100_shared``): :func:`compared_metrics` says what each pairing compares.
SHARED_SUFFIX = "_shared"
NUMERICS = (*LOSS_METRICS, "num-zeros")


def is_shared_platform(platform: str) -> bool:
    return platform.endswith(SHARED_SUFFIX)


def compared_metrics(names: tuple[str, ...] | list[str], run_shared: bool,
                     golden_platform: str) -> tuple[list[str], list[str]]:
    """(compared, not compared) of a recipe's ``names`` for a run against a golden (see the note).

    Both on their own GPUs: everything. Both in the shared mode: everything but step times. One
    of each: losses and num-zeros only.
    """
    golden_shared = is_shared_platform(golden_platform)
    if not run_shared and not golden_shared:
        return list(names), []
    keep = [n for n in names if n in NUMERICS or (run_shared and golden_shared and n.startswith("mem-"))]
    return keep, [n for n in names if n not in keep]


def compare(expected: Metrics, actual: Metrics, names: tuple[str, ...] | list[str],
            steps: set[int] | None = None, loss_rtol: float = 0.0) -> list[Mismatch]:
    """Mismatches of ``actual`` against ``expected`` for ``names``; ``steps`` limits the steps.

    ``loss_rtol`` > 0 relaxes the ``LOSS_METRICS`` from identical to that relative tolerance
    (only a resume into another unit layout asks for it; recipe.py ``RESUME_COMPARE``).
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
            medians = _iter_time_medians(exp, act, wanted)
            if medians is None:
                problems.append(Mismatch(name, None, None, None, "no post-warm-up steps"))
                continue
            me, ma = medians
            if not ma <= iter_time_max_ratio() * me:  # NaN fails too
                problems.append(Mismatch(name, None, me, ma, f"median more than {iter_time_max_ratio()}x the golden's"))
            continue
        for step in wanted:
            if step not in act:
                problems.append(Mismatch(name, step, exp[step], None, "step missing"))
                continue
            e, a = exp[step], act[step]
            if name in LOSS_METRICS:
                if loss_rtol == 0.0 and e != a:
                    problems.append(Mismatch(name, step, e, a, "must be identical"))
                elif loss_rtol and not abs(a - e) <= loss_rtol * abs(e):  # NaN fails too
                    problems.append(Mismatch(name, step, e, a, f"rtol {loss_rtol}"))
            else:
                rtol = MEM_RTOL if name.startswith("mem-") else RTOL.get(name, 0.05)
                if abs(a - e) > rtol * abs(e) + (1.0 if name == "num-zeros" else 0.0):
                    problems.append(Mismatch(name, step, e, a, f"rtol {rtol}"))
    return problems
