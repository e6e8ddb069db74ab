"""Turn a bucket layout into the planner report: unit table, per-allocator plans, FixedPool view.

Pure functions over :class:`~hfsdp.planner.layout.Layout` and the fork's ``double_buffer.plan``
module; the CLI prints :func:`format_report` and can dump :func:`report_dict` as JSON.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from hfsdp.planner import compare, fp8
from hfsdp.planner.layout import MFSDP, Layout, bucket_specs
from hfsdp.planner.pools import NO_POOL, pool_allocated
from hfsdp.usererror import UserError

MIB = 2**20


def _plan_mod():
    return importlib.import_module(f"{MFSDP}.double_buffer.plan")


def _rounded_unit_sizes(plan: Any, dtype: str) -> list[int]:
    """Each unit's ``dtype`` layout in unit order, rounded up with the plan's own alignment."""
    aligned = _plan_mod().aligned_numel
    layout = plan.unit_layout_numel[dtype]
    return [aligned(layout.get(u, 0), plan.align_bytes, plan.itemsize[dtype]) for u in plan.unit_ids]


def adjacent_pair_bytes(plan: Any) -> int:
    """Bytes of one arena per dtype sized by the largest pair of consecutive units.

    A what-if, not an implemented layout: the max-pool arena keeps two groups of the largest
    unit each. If only consecutive units (unit ids u, u+1) are ever live together, which is what
    the <=2-live-unit gate gives in forward and backward order, one arena holding group 0
    left-aligned and group 1 right-aligned would need max(layout[u] + layout[u+1]) per dtype.
    Each layout is rounded up to the plan's alignment (a right-aligned start must be aligned).
    """
    total = 0
    for dtype in plan.unit_layout_numel:
        sizes = _rounded_unit_sizes(plan, dtype)
        pairs = [a + b for a, b in itertools.pairwise(sizes)] or sizes
        total += max(pairs) * plan.itemsize[dtype]
    return total


DEFAULT_LANES = 3  # planned unless --plan-lanes says otherwise, when the model has that many units


def lanes_units_problem(layout: Layout, lanes: int, setting: str) -> str | None:
    """Why ``lanes`` lanes cannot serve ``layout``'s units (the runtime's sentence), or None."""
    return _plan_mod().lanes_units_problem(lanes, len(layout.units), setting=setting)


def lane_plans(specs: list[Any], lanes: Sequence[int] | None, align_bytes: int) -> dict[int, Any]:
    """The plan the max-pool allocators hold with ``--megatron-fsdp-max-pool-lanes N``, per N.

    ``double_buffer.plan.runtime_lane_plan`` is what the allocators call, so these are the runtime's
    plans (tested against a real buffer). A count the runtime refuses is refused here too;
    ``lanes`` None plans DEFAULT_LANES when the model has at least that many units, else none.
    """
    pm = _plan_mod()
    units = len({s.unit_id for s in specs if s.unit_id is not None})
    if lanes is None:
        lanes = (DEFAULT_LANES,) if units >= DEFAULT_LANES else ()
    for n in lanes:
        problem = pm.lanes_units_problem(n, units, setting=f"--plan-lanes {n}")
        if problem is not None:
            raise UserError(problem, "pass lane counts between 2 and the model's number of units")
    return {n: pm.runtime_lane_plan(specs, lanes=n, align_bytes=align_bytes) for n in lanes}


def plan_allocator(layout: Layout, allocator: str, *, align_bytes: int | None = None,
                   main_grads_dtype: torch.dtype | None = None,
                   grad_comm_dtype: torch.dtype | None = None,
                   lanes: Sequence[int] | None = None) -> dict[str, Any]:
    """Max-pool, lane, rank-matched, analytic-minimum and FixedPool results for one allocator.

    ``align_bytes`` defaults to the runtime's ``double_buffer.plan.DEFAULT_ALIGN_BYTES``; ``lanes``
    are the lane counts to plan (:func:`lane_plans`).
    """
    pm = _plan_mod()
    if align_bytes is None:
        align_bytes = pm.DEFAULT_ALIGN_BYTES
    specs = bucket_specs(layout, allocator, main_grads_dtype=main_grads_dtype,
                         grad_comm_dtype=grad_comm_dtype)
    maxpool = pm.plan_max_pool(specs, align_bytes=align_bytes)
    ranked = compare.plan_rank_matched(specs)
    fixed = compare.fixed_pool_outliers(specs)
    return {
        "allocator": allocator,
        "specs": specs,
        "maxpool": maxpool,
        "lanes": lane_plans(specs, lanes, align_bytes),
        "rank_matched": ranked,
        "analytic_minimum_bytes": compare.analytic_minimum_bytes(specs),
        "fixed_pool": fixed,
    }


def unit_table(layout: Layout) -> list[str]:
    """One line per unit: id, class, params, and per-dtype padded bucket sizes."""
    by_id = {b.bucket_id: b for b in layout.buckets}
    lines = [f"{'unit':>4}  {'class':<20} {'params':>12}  buckets (dtype: padded numel ...)  module"]
    for u in layout.units:
        per_dtype: dict[str, list[str]] = {}
        for bid in u.bucket_ids:
            b = by_id[bid]
            tag = f"{b.numel}" + ("e" if b.is_expert else "")
            per_dtype.setdefault(b.dtype.replace("torch.", ""), []).append(tag)
        cells = "; ".join(f"{d}: {' '.join(v)}" for d, v in per_dtype.items())
        lines.append(f"{u.unit_id:>4}  {u.cls:<20} {u.num_params:>12,}  {cells}  {u.name}")
    rest = [b for b in layout.buckets if b.unit_id is None]
    if rest:
        cells = " ".join(f"{b.dtype.replace('torch.', '')}:{b.numel}" for b in rest)
        lines.append(f"{'-':>4}  {'(non-unit)':<20} {sum(b.unpadded_numel for b in rest):>12,}  "
                     f"{cells}  (never pooled)")
    return lines


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f} MiB"


def lane_lines(result: dict[str, Any], cls: dict[int, str]) -> list[str]:
    """Per lane count: the pool against the max-pool arena plan, then each (lane, dtype) arena."""
    name, mp = result["allocator"], result["maxpool"]
    lines = []
    for n, lp in result["lanes"].items():
        layout_kind = ("shared, every lane sized by the largest unit" if n == 2
                       else f"unit i in lane i % {n}, each lane sized by its own largest unit")
        lines.append(f"[{name}] {f'{n}-lane plan':<20}: {_mib(lp.pool_bytes())}"
                     f"  ({lp.pool_bytes() / mp.pool_bytes():.3f} x max-pool arena plan; "
                     f"{n} units live; {layout_kind})")
        for (lane, dtype), numel in lp.arena_numel.items():
            setter = lp.setter[(lane, dtype)]
            members = [u for u, allowed in lp.allowed.items() if lane in allowed]
            lines.append(f"[{name}]   lane {lane} {dtype}: {numel:,} elems "
                         f"({_mib(lp.arena_bytes(lane, dtype))}), set by unit {setter} "
                         f"({cls.get(setter, '?')}) of {len(members)} units")
    return lines


def plan_lines(result: dict[str, Any], layout: Layout) -> list[str]:
    """Pool bytes per plan for one allocator, plus per-dtype arenas and FixedPool's outliers."""
    name = result["allocator"]
    mp, rm, fx = result["maxpool"], result["rank_matched"], result["fixed_pool"]
    minimum = result["analytic_minimum_bytes"]
    cls = {u.unit_id: u.cls for u in layout.units}
    lines = [
        f"[{name}] max-pool arena plan : {_mib(mp.pool_bytes())}"
        f"  ({mp.pool_bytes() / minimum:.3f} x analytic minimum)",
        f"[{name}] rank-matched (0.19) : {_mib(rm.pool_bytes())}"
        f"  ({rm.pool_bytes() / minimum:.3f} x analytic minimum)",
        f"[{name}] analytic minimum    : {_mib(minimum)}  ({mp.num_groups} x largest unit, per dtype)",
        f"[{name}] adjacent-pair bound : {_mib(adjacent_pair_bytes(mp))}"
        f"  ({adjacent_pair_bytes(mp) / minimum:.3f} x analytic minimum; what-if, not implemented:"
        " one arena per dtype sized by the largest pair of consecutive units)",
    ]
    for dtype in sorted(mp.arena_numel):
        setter = mp.setter[dtype]
        lines.append(
            f"[{name}]   {dtype}: arena {mp.arena_numel[dtype]:,} elems/group "
            f"({_mib(mp.arena_bytes(dtype))}), set by unit {setter} ({cls.get(setter, '?')}); "
            f"rank-matched slots {list(rm.slots.get(dtype, ()))}")
    lines += lane_lines(result, cls)
    pooled = ", ".join(f"{u}" for u in fx.pooled_unit_ids)
    outl = ", ".join(f"{u}:{cls.get(u, '?')}" for u in fx.outlier_unit_ids) or "none"
    lines.append(
        f"[{name}] 0.18.2 FixedPool    : pool {_mib(fx.pool_bytes)} for units [{pooled}] "
        f"({len(fx.pooled_unit_ids)}/{len(layout.units)}); outliers [{outl}] "
        f"= {_mib(fx.outlier_bytes)} outside the pool")
    return lines


def format_report(layout: Layout, results: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"Megatron-FSDP memory plan: strategy={layout.strategy} dp={layout.dp_size} "
        f"expert_dp={layout.expert_dp_size} params={layout.total_params:,} "
        f"units={len(layout.units)} buckets={len(layout.buckets)}",
        "unit classes: " + ", ".join(c.rsplit(".", 1)[1] for c in layout.unit_classes),
        "",
        *unit_table(layout),
        "",
        *([*fp8.report_lines(layout.fp8), ""] if layout.fp8 is not None else []),
    ]
    for r in results:
        if not pool_allocated(layout.dp_size):  # [Note: no pool at DP=1] in pools.py
            lines.append(f"[{r['allocator']}] no pool: {NO_POOL} (0 bytes planned)")
            continue
        lines += plan_lines(r, layout) + [""]
    if not pool_allocated(layout.dp_size):
        lines.append("")
    return lines


def no_pool_dict(result: dict[str, Any]) -> dict[str, Any]:
    """Allocator ``result`` in :func:`report_dict` where no pool is allocated: every pool (each lane
    count planned included) 0 bytes, no arena."""
    lanes = {str(n): {"pool_bytes": 0, "arena_numel": {}, "homes": {}} for n in result["lanes"]}
    return {"pool_allocated": False, "maxpool_pool_bytes": 0, "maxpool_arena_numel": {}, "maxpool_offsets": {},
            "maxpool_setter": {}, "rank_matched_pool_bytes": 0, "rank_matched_slots": {},
            "analytic_minimum_bytes": 0, "adjacent_pair_bound_bytes": 0, "lane_plans": lanes,
            "fixed_pool_pool_bytes": 0, "fixed_pool_pooled_units": [], "fixed_pool_outlier_units": [],
            "fixed_pool_outlier_bytes": 0}


def report_dict(layout: Layout, results: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON-ready summary (bytes as ints, plans as plain dicts)."""
    out: dict[str, Any] = {
        "strategy": layout.strategy,
        "dp_size": layout.dp_size,
        "expert_dp_size": layout.expert_dp_size,
        "total_params": layout.total_params,
        "unit_classes": list(layout.unit_classes),
        "units": [dict(unit_id=u.unit_id, name=u.name, cls=u.cls, params=u.num_params,
                       bucket_ids=list(u.bucket_ids)) for u in layout.units],
        "buckets": [dict(bucket_id=b.bucket_id, unit_id=b.unit_id, dtype=b.dtype,
                         is_expert=b.is_expert, numel=b.numel, unpadded_numel=b.unpadded_numel,
                         chunk_size_factor=b.chunk_size_factor, dp_size=b.dp_size)
                    for b in layout.buckets],
        "allocators": {},
    }
    if layout.fp8 is not None:  # [Note: FP8 parameters in the plan] in fp8.py
        out["fp8"] = fp8.report_dict(layout.fp8)
    if not pool_allocated(layout.dp_size):  # [Note: no pool at DP=1] in pools.py
        out["no_pool"] = NO_POOL
        out["allocators"] = {r["allocator"]: no_pool_dict(r) for r in results}
        return out
    for r in results:
        mp, rm, fx = r["maxpool"], r["rank_matched"], r["fixed_pool"]
        out["allocators"][r["allocator"]] = {
            "maxpool_pool_bytes": mp.pool_bytes(),
            "maxpool_arena_numel": dict(mp.arena_numel),
            "maxpool_offsets": {str(k): list(v) for k, v in sorted(mp.offsets.items())},
            "maxpool_setter": dict(mp.setter),
            "rank_matched_pool_bytes": rm.pool_bytes(),
            "rank_matched_slots": {d: list(s) for d, s in rm.slots.items()},
            "analytic_minimum_bytes": r["analytic_minimum_bytes"],
            "adjacent_pair_bound_bytes": adjacent_pair_bytes(mp),
            "lane_plans": {str(n): {
                "pool_bytes": lp.pool_bytes(),
                "arena_numel": {f"{lane}/{d}": v for (lane, d), v in lp.arena_numel.items()},
                "homes": {str(u): list(a) for u, a in lp.allowed.items()},
            } for n, lp in r["lanes"].items()},
            "fixed_pool_pool_bytes": fx.pool_bytes,
            "fixed_pool_pooled_units": list(fx.pooled_unit_ids),
            "fixed_pool_outlier_units": list(fx.outlier_unit_ids),
            "fixed_pool_outlier_bytes": fx.outlier_bytes,
        }
    return out
