# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""What other pools would cost for the same buckets, for the planner's comparison only.

The runtime never needs these (it plans and holds only the max-pool, double_buffer/plan.py): upstream
0.19's rank-matched slots, the analytic minimum, and what 0.18.2's FixedPoolAllocator would pool. They
read the runtime's bucket specs and rules through the plan module, so they compare like with like.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PLAN = "megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.plan"


def _pm() -> Any:
    return importlib.import_module(PLAN)


@dataclass(frozen=True)
class RankMatchedPlan:
    """Upstream 0.19 slot plan: per dtype, slot r = max over units of the r-th largest."""

    slots: dict[str, tuple[int, ...]]  # dtype -> slot sizes in elements (non-increasing)
    slot_setter: dict[str, tuple[tuple[int, int], ...]]  # dtype -> (unit, bucket) per slot
    itemsize: dict[str, int]
    align_bytes: int = 1
    num_groups: int = 2  # the plan module's NUM_BUFFER_GROUPS ([Note: double buffer], live units)

    def pool_bytes(self) -> int:
        """Every group; each slot rounded up to ``align_bytes`` like a separate allocation."""
        aligned_numel = _pm().aligned_numel
        total = 0
        for dtype, sizes in self.slots.items():
            size = self.itemsize[dtype]
            total += sum(aligned_numel(n, self.align_bytes, size) for n in sizes) * size
        return self.num_groups * total


@dataclass(frozen=True)
class FixedPoolReport:
    """What 0.18.2 FixedPoolAllocator would do with these buckets."""

    classes: tuple[tuple[int, ...], ...]  # equality classes of units, first-seen order
    mode_class: tuple[int, ...]  # pooled units (largest class, ties to first unit)
    pooled_unit_ids: tuple[int, ...]
    outlier_unit_ids: tuple[int, ...]
    pool_bytes: int  # groups x representative slots (max padded size per position)
    outlier_bytes: int  # bytes of outlier-unit buckets (dynamic or persistent fallback)


def plan_rank_matched(
    buckets: Iterable[Any], *, align_bytes: int = 1, num_groups: int | None = None
) -> RankMatchedPlan:
    """Upstream 0.19 MaxPool slots (largest first, bucket-id tie-break), for comparison."""
    pm = _pm()
    groups = pm.buffer_groups(num_groups)
    specs = pm._validated(buckets)
    units = pm._unit_buckets(specs)
    slots: dict[str, list[int]] = defaultdict(list)
    setter: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for unit_id in sorted(units):
        per_dtype: dict[str, list[Any]] = defaultdict(list)
        for b in units[unit_id]:
            per_dtype[b.dtype].append(b)
        for dtype, bs in per_dtype.items():
            ranked = sorted(bs, key=lambda b: (-b.numel, b.bucket_id))
            for r, b in enumerate(ranked):
                if r == len(slots[dtype]):
                    slots[dtype].append(0)
                    setter[dtype].append((unit_id, b.bucket_id))
                if b.numel > slots[dtype][r]:
                    slots[dtype][r] = b.numel
                    setter[dtype][r] = (unit_id, b.bucket_id)
    itemsize = {b.dtype: b.itemsize for b in specs if b.unit_id is not None}
    return RankMatchedPlan(
        slots={d: tuple(slots[d]) for d in sorted(slots)},
        slot_setter={d: tuple(setter[d]) for d in sorted(setter)},
        itemsize={d: itemsize[d] for d in sorted(itemsize)},
        align_bytes=align_bytes,
        num_groups=groups,
    )


def analytic_minimum_bytes(buckets: Iterable[Any], num_groups: int | None = None) -> int:
    """Groups x sum over dtypes of the largest unit's bytes of that dtype (no alignment)."""
    pm = _pm()
    groups = pm.buffer_groups(num_groups)
    units = pm._unit_buckets(pm._validated(buckets))
    per_dtype: dict[str, int] = defaultdict(int)
    for bs in units.values():
        unit_bytes: dict[str, int] = defaultdict(int)
        for b in bs:
            unit_bytes[b.dtype] += b.nbytes
        for dtype, n in unit_bytes.items():
            per_dtype[dtype] = max(per_dtype[dtype], n)
    return groups * sum(per_dtype.values())


def fixed_pool_outliers(buckets: Iterable[Any], num_groups: int | None = None) -> FixedPoolReport:
    """Replicate 0.18.2 FixedPoolAllocator's unit classes, mode choice and pool size."""
    pm = _pm()
    groups = pm.buffer_groups(num_groups)
    specs = pm._validated(buckets)
    pm._unit_buckets(specs)  # same "no units" error as the planners
    units: dict[int, list[Any]] = {}
    for b in specs:  # insertion order = first bucket id of each unit, as in FixedPool
        if b.unit_id is not None:
            units.setdefault(b.unit_id, []).append(b)

    def equal(a: list[Any], c: list[Any]) -> bool:
        return len(a) == len(c) and all(
            x.dtype == y.dtype and x.unpadded_numel == y.unpadded_numel for x, y in zip(a, c, strict=True)
        )

    classes: list[tuple[int, ...]] = []
    mode: tuple[int, ...] = ()
    for bs in units.values():
        cls = tuple(u for u in units if equal(units[u], bs))
        if cls not in classes:
            classes.append(cls)
        if len(cls) > len(mode):  # strict: ties go to the first unit
            mode = cls
    rep = units[mode[0]]
    pool = 0
    for pos, b in enumerate(rep):
        pool += max(units[u][pos].numel for u in mode) * b.itemsize
    outliers = tuple(u for u in units if u not in mode)
    return FixedPoolReport(
        classes=tuple(classes),
        mode_class=mode,
        pooled_unit_ids=tuple(sorted(mode)),
        outlier_unit_ids=tuple(sorted(outliers)),
        pool_bytes=groups * pool,
        outlier_bytes=sum(b.nbytes for u in outliers for b in units[u]),
    )
