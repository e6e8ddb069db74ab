"""Benchmark result aggregation: medians over repeats, ratios vs the baseline, table, JSON.

Pure stdlib so it is unit-tested on CPU. One *run* is one fresh torchrun of one configuration;
a configuration's summary takes the median over its runs of each run's median step time.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from hfsdp.atomic import write_json_atomic
from hfsdp.planner.pools import NO_POOL, pool_allocated

BASELINE = "no_db"
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One fresh-process run of one configuration (timed steps only, warm-up excluded)."""

    config: str
    repeat: int
    step_times_s: tuple[float, ...]
    tokens_per_step: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    pool_bytes_measured: int | None = None  # bytes held by double-buffer pools at the end
    lm_loss: tuple[float | None, ...] = ()  # every step incl. warm-up; configs should agree
    maxpool_stats: dict[str, int] | None = None  # summed MaxPoolAllocator.stats()
    # Profiling passes only (rank 0): ncclSymk*/other kernel counts, per-step timeline, the
    # live set at the allocator peak. Kept as the worker wrote them.
    nccl_kernels: dict[str, Any] | None = None
    timeline: Any | None = None
    memory_peak: dict[str, Any] | None = None
    cuda_graph_captured: bool | None = None  # pretrain runs: a full-iteration graph ran
    torch: str | None = None  # pretrain runs: what the run report names (the run's machine)
    device: str | None = None
    startup_s: float | None = None  # pretrain runs: launch to step 2 ([Note: start-up time])

    def __post_init__(self) -> None:
        if not self.step_times_s:
            raise ValueError(f"run {self.config}#{self.repeat} has no timed steps")
        if any(t <= 0 for t in self.step_times_s):
            raise ValueError(f"run {self.config}#{self.repeat} has non-positive step times")

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)


@dataclasses.dataclass(frozen=True)
class ConfigSummary:
    config: str
    runs: int
    median_step_s: float
    min_run_median_s: float
    max_run_median_s: float
    tokens_per_s: float
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    pool_bytes_measured: int | None
    pool_bytes_planned: int | None
    analytic_minimum_bytes: int | None
    step_time_ratio: float | None = None  # vs baseline (lower is better)
    tokens_per_s_ratio: float | None = None
    peak_allocated_ratio: float | None = None
    peak_reserved_ratio: float | None = None


def median(values: Iterable[float]) -> float:
    vals = list(values)
    if not vals:
        raise ValueError("median of no values")
    return statistics.median(vals)


def interleaved_order(configs: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, config) launch order: every repeat runs every config, rotated per repeat.

    Rotation puts each config at each position once every len(configs) repeats, so slow drift
    (thermals, clocks, page cache) spreads over all configurations instead of one.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    n = len(configs)
    order = []
    for r in range(repeats):
        shift = r % n if n else 0
        for c in list(configs[shift:]) + list(configs[:shift]):
            order.append((r, c))
    return order


def summarize(runs: Sequence[RunResult], *, planned: dict[str, dict[str, int]] | None = None,
              baseline: str = BASELINE) -> list[ConfigSummary]:
    """One summary per config (first-seen order); ratios filled when the baseline ran."""
    planned = planned or {}
    by_config: dict[str, list[RunResult]] = {}
    for run in runs:
        by_config.setdefault(run.config, []).append(run)
    out = []
    for config, rs in by_config.items():
        run_medians = [r.median_step_s for r in rs]
        step = median(run_medians)
        tokens = rs[0].tokens_per_step
        if any(r.tokens_per_step != tokens for r in rs):
            raise ValueError(f"{config}: runs disagree on tokens per step")
        measured = [r.pool_bytes_measured for r in rs if r.pool_bytes_measured is not None]
        plan = planned.get(config, {})
        out.append(ConfigSummary(
            config=config,
            runs=len(rs),
            median_step_s=step,
            min_run_median_s=min(run_medians),
            max_run_median_s=max(run_medians),
            tokens_per_s=tokens / step,
            peak_allocated_bytes=max(r.peak_allocated_bytes for r in rs),
            peak_reserved_bytes=max(r.peak_reserved_bytes for r in rs),
            pool_bytes_measured=max(measured) if measured else None,
            pool_bytes_planned=plan.get("pool_bytes"),
            analytic_minimum_bytes=plan.get("analytic_minimum_bytes"),
        ))
    base = next((s for s in out if s.config == baseline), None)
    if base is None:
        return out
    return [dataclasses.replace(
        s,
        step_time_ratio=ratio(s.median_step_s, base.median_step_s),
        tokens_per_s_ratio=ratio(s.tokens_per_s, base.tokens_per_s),
        peak_allocated_ratio=ratio(s.peak_allocated_bytes, base.peak_allocated_bytes),
        peak_reserved_ratio=ratio(s.peak_reserved_bytes, base.peak_reserved_bytes),
    ) for s in out]


def ratio(value: float, base: float) -> float | None:
    """``value / base``; None where the baseline is 0 (a run report of 0 bytes, say): no ratio."""
    return value / base if base else None


def loss_agreement(runs: Sequence[RunResult], baseline: str = BASELINE) -> dict[str, Any]:
    """Per run: is its lm-loss sequence bit-identical to the baseline's reference sequence?

    Every run uses the same seed and data, so double buffering must not change a single bit.
    The reference is the most common baseline sequence (ties: first seen); a run that differs
    reports the first differing step (1-based). Runs without losses are left out.
    """
    seqs = [r.lm_loss for r in runs if r.config == baseline and r.lm_loss]
    if not seqs:
        return {"baseline": baseline, "reference": None, "runs": [],
                "held": sorted({r.config for r in runs if r.config != baseline})}
    counts: dict[tuple[float | None, ...], int] = {}
    for seq in seqs:
        counts[seq] = counts.get(seq, 0) + 1
    reference = max(counts, key=lambda seq: (counts[seq], -seqs.index(seq)))
    out = []
    for r in runs:
        if not r.lm_loss:
            continue
        first = next((i + 1 for i, (a, b) in enumerate(zip(r.lm_loss, reference, strict=False)) if a != b), None)
        if first is None and len(r.lm_loss) != len(reference):
            first = min(len(r.lm_loss), len(reference)) + 1
        out.append({"config": r.config, "repeat": r.repeat, "identical": first is None,
                    "first_divergent_step": first})
    return {"baseline": baseline, "reference": list(reference), "baseline_runs": len(seqs),
            "baseline_distinct_sequences": len(counts), "runs": out}


def format_loss_agreement(agreement: dict[str, Any]) -> list[str]:
    if agreement.get("reference") is None:
        held = agreement.get("held")
        return [f"loss agreement: no {agreement.get('baseline', BASELINE)} losses"
                + (f" to hold {', '.join(held)} to" if held else "")]
    baseline = agreement.get("baseline", BASELINE)
    if all(r["config"] == baseline for r in agreement["runs"]):  # nothing else held to it: its repeats alone
        if agreement["baseline_runs"] == 1:
            return [f"loss agreement: 1 {baseline} run and nothing held to it, nothing to compare"]
        return [f"loss agreement among {agreement['baseline_runs']} {baseline} runs: "
                + ("bit-identical" if agreement["baseline_distinct_sequences"] == 1
                   else f"{agreement['baseline_distinct_sequences']} distinct sequences")]
    lines = [f"loss agreement vs {agreement['baseline_runs']} {baseline} run(s) "
             f"({agreement['baseline_distinct_sequences']} distinct sequence(s)):"]
    for r in agreement["runs"]:
        verdict = ("bit-identical" if r["identical"]
                   else f"DIFFERS from step {r['first_divergent_step']}")
        lines.append(f"  {r['config']:<12} repeat {r['repeat']}: {verdict}")
    return lines


def format_pool_check(summaries: Sequence[ConfigSummary], runs: Sequence[RunResult],
                      baseline: str = BASELINE, *, dp_size: int) -> list[str]:
    """Per configuration with a planned pool: does the pool held equal the plan, how many home
    misses did its runs count (the max over runs of the summed allocator stats), and does its
    peak allocated memory exceed the baseline's by at most the planned pool (the pool is the
    only memory double buffering adds; the rest of a step's memory is the same). At data-parallel
    size ``dp_size`` 1 no pool exists ([Note: no pool at DP=1] in hfsdp/planner/pools.py), and the
    check says so instead of comparing with a plan."""
    base = next((s for s in summaries if s.config == baseline), None)
    pooled = pool_allocated(dp_size)
    lines = []
    for s in summaries:
        if s.pool_bytes_planned is None:
            continue
        misses = [r.maxpool_stats.get("home_misses", 0) for r in runs
                  if r.config == s.config and r.maxpool_stats]
        held = s.pool_bytes_measured
        if not pooled:
            verdict = (f"none ({NO_POOL})" if not held
                       else f"!= plan ({_fmt_mib(held)} MiB held, though {NO_POOL})")
        else:
            verdict = ("not measured" if held is None
                       else "= plan" if held == s.pool_bytes_planned
                       else f"!= plan ({_fmt_mib(held)} vs {_fmt_mib(s.pool_bytes_planned)} MiB)")
        memory = ""
        if base is not None and base.peak_allocated_bytes:
            extra = s.peak_allocated_bytes - base.peak_allocated_bytes
            bound = "within" if extra <= s.pool_bytes_planned else "MORE than"
            memory = (f"; peak allocated {extra / MIB:+,.1f} MiB over {baseline} "
                      f"({s.peak_allocated_bytes / base.peak_allocated_bytes:.3f}x)"
                      + (f", {bound} the planned pool" if pooled else ""))
        lines.append(f"  {s.config:<20} pool {verdict}; home misses "
                     f"{max(misses) if misses else 'not reported'}{memory}")
    return ["pool check:", *lines] if lines else []


def format_startup(runs: Sequence[RunResult]) -> list[str]:
    """Per configuration, each run's seconds from launch to step 2, in launch order."""
    by_config: dict[str, list[str]] = {}
    for r in runs:
        by_config.setdefault(r.config, []).append("-" if r.startup_s is None else f"{r.startup_s:.0f}")
    if all(v == "-" for vs in by_config.values() for v in vs):
        return []
    return ["start-up, launch to step 2 (s, per run):",
            *(f"  {c:<20} {' '.join(vs)}" for c, vs in by_config.items())]


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _fmt_mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MIB:,.1f}"


# Timing fields of a summary and of a run: what a several-ranks-per-GPU invocation leaves out.
SPEED_FIELDS = ("median_step_s", "min_run_median_s", "max_run_median_s", "tokens_per_s",
                "step_time_ratio", "tokens_per_s_ratio")
RUN_SPEED_FIELDS = ("step_times_s", "median_step_s")


def no_speed_note(ranks_per_gpu: int) -> str:
    """Why an invocation with ``ranks_per_gpu`` > 1 reports no step time."""
    return (f"no step times reported: {ranks_per_gpu} ranks share each GPU, time-slicing it and talking "
            "over loopback sockets, so their steps say nothing about speed; memory, pools and losses are "
            "each rank's own and stand (docs/several-ranks-per-gpu.md)")


def without_speed(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (:func:`to_json`) with every step time and throughput set to None."""
    out = dict(doc)
    for key in ("summary", "summary_te"):
        if key in out:
            out[key] = [{**s, **dict.fromkeys(SPEED_FIELDS)} for s in out[key]]
    out["runs"] = [{**r, **dict.fromkeys(RUN_SPEED_FIELDS)} for r in out["runs"]]
    return out


def format_table(summaries: Sequence[ConfigSummary], speed: bool = True) -> list[str]:
    """The summary table; ``speed`` False prints '-' for step times and throughput."""
    width = max([12, *(len(s.config) for s in summaries)])  # maxpool_lanes3_graph is 20
    head = (f"{'config':<{width}} {'runs':>4} {'step ms':>9} {'(min..max)':>17} {'tok/s':>10} "
            f"{'x base':>7} {'peak alloc MiB':>15} {'x base':>7} {'peak resv MiB':>14} "
            f"{'x base':>7} {'pool MiB':>9} {'plan MiB':>9} {'min MiB':>8}")
    lines = [head, "-" * len(head)]
    for s in summaries:
        step = f"{s.median_step_s * 1e3:.1f}" if speed else "-"
        spread = f"({s.min_run_median_s * 1e3:.1f}..{s.max_run_median_s * 1e3:.1f})" if speed else "-"
        tokens = f"{s.tokens_per_s:,.0f}" if speed else "-"
        lines.append(
            f"{s.config:<{width}} {s.runs:>4} {step:>9} {spread:>17} "
            f"{tokens:>10} {_fmt_ratio(s.tokens_per_s_ratio if speed else None):>7} "
            f"{_fmt_mib(s.peak_allocated_bytes):>15} {_fmt_ratio(s.peak_allocated_ratio):>7} "
            f"{_fmt_mib(s.peak_reserved_bytes):>14} {_fmt_ratio(s.peak_reserved_ratio):>7} "
            f"{_fmt_mib(s.pool_bytes_measured):>9} {_fmt_mib(s.pool_bytes_planned):>9} "
            f"{_fmt_mib(s.analytic_minimum_bytes):>8}")
    return lines


def to_json(summaries: Sequence[ConfigSummary], runs: Sequence[RunResult],
            meta: dict[str, Any], agreements: dict[str, Any] | None = None) -> dict[str, Any]:
    """The results document; ``agreements``: baseline -> loss agreement of the runs held to it
    (default: every run against ``no_db``)."""
    agreements = agreements if agreements is not None else {BASELINE: loss_agreement(runs)}
    return {
        "meta": meta,
        "loss_agreement": agreements.get(BASELINE, {"reference": None, "runs": []}),
        "loss_agreement_by_baseline": agreements,
        "summary": [dataclasses.asdict(s) for s in summaries],
        "runs": [dict(dataclasses.asdict(r), median_step_s=r.median_step_s) for r in runs],
    }


def write_json(path: str, doc: dict[str, Any]) -> None:
    """The results document as strict JSON, in one step ([Note: strict JSON] in hfsdp/atomic.py)."""
    write_json_atomic(path, doc)


def run_from_dict(d: dict[str, Any]) -> RunResult:
    """Inverse of the worker's JSON record."""
    return RunResult(
        config=d["config"], repeat=int(d["repeat"]),
        step_times_s=tuple(float(t) for t in d["step_times_s"]),
        tokens_per_step=int(d["tokens_per_step"]),
        peak_allocated_bytes=int(d["peak_allocated_bytes"]),
        peak_reserved_bytes=int(d["peak_reserved_bytes"]),
        pool_bytes_measured=(None if d.get("pool_bytes_measured") is None
                             else int(d["pool_bytes_measured"])),
        lm_loss=tuple(None if x is None else float(x) for x in d.get("lm_loss") or ()),
        maxpool_stats=d.get("maxpool_stats"),
        nccl_kernels=d.get("nccl_kernels"),
        timeline=d.get("timeline"),
        memory_peak=d.get("memory_peak"),
        cuda_graph_captured=d.get("cuda_graph_captured"),
        torch=d.get("torch"), device=d.get("device"),
        startup_s=None if d.get("startup_s") is None else float(d["startup_s"]),
    )


def machine(runs: Sequence[RunResult]) -> dict[str, str]:
    """The torch version(s) and device(s) the runs report, each joined when they differ."""
    out = {}
    for key in ("torch", "device"):
        values = sorted({v for v in (getattr(r, key) for r in runs) if v})
        if values:
            out[key] = ", ".join(values)
    return out
