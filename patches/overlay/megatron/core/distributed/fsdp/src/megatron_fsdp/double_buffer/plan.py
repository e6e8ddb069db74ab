# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Pure planner for Megatron-FSDP double buffers, and the buffer rules it shares.

Stdlib only (no torch import) so it can be unit-tested and reused by offline tools.
Dtypes are names such as ``"torch.bfloat16"``; ``"float8"`` is the dtype of an FP8
parameter group, planned as ``"torch.uint8"`` (the FP8 weight-buffer dtype).

Buffer rules: the dtype each allocator is asked for and the alignment of pool offsets.
``ParamAndGradBuffer`` and the offline memory planner both call these functions, so
they cannot disagree.

The arena layout is [Note: double buffer], plan; the lanes, its lanes and homes. With the shared
groups the pool is NUM_BUFFER_GROUPS x (largest unit per dtype) + alignment. What other pools
would cost for the same buckets is the offline planner's comparison (hfsdp/planner/compare.py),
not the runtime's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

FLOAT8 = "float8"  # ParameterGroup.dtype of an FP8 parameter group
FLOAT8_PLANNED = "torch.uint8"  # FP8 weight buffers hold the raw bytes
FLOAT8_GRAD = "torch.bfloat16"  # FP8 groups' main grads unless main_grads_dtype is set
DEFAULT_ALIGN_BYTES = 256  # alignment of every bucket offset inside an arena

# The buffer groups of the shared pool, so the FSDP units that may hold double-buffer memory at
# once; the one source of that number for FixedPoolAllocator, MaxPoolAllocator, every plan below
# and ParamAndGradBuffer.live_unit_limit ([Note: double buffer], live units).
NUM_BUFFER_GROUPS = 2


def buffer_groups(num_groups: int | None = None) -> int:
    """``num_groups``, or NUM_BUFFER_GROUPS when None; a double buffer needs at least 2."""
    groups = NUM_BUFFER_GROUPS if num_groups is None else num_groups
    if not isinstance(groups, int) or groups < 2:
        raise ValueError(
            f"a double-buffer pool needs an integer number of buffer groups >= 2, got "
            f"{groups!r}: with one group no unit can be fetched while another is live"
        )
    return groups


def planned_dtype_name(dtype: object) -> str:
    """Dtype of a group's weight buffers: its own, except ``"float8"`` -> ``"torch.uint8"``."""
    name = str(dtype)
    return FLOAT8_PLANNED if name == FLOAT8 else name


def grad_dtype_name(group_dtype: object, main_grads_dtype: object | None = None) -> str:
    """Main-grad dtype of a group: ``main_grads_dtype`` when set, else bf16 for FP8 groups,
    else the group's dtype."""
    if main_grads_dtype is not None:
        return str(main_grads_dtype)
    name = str(group_dtype)
    return FLOAT8_GRAD if name == FLOAT8 else name


def grad_alloc_dtype_name(grad_dtype: object, grad_comm_dtype: object | None = None) -> str:
    """Dtype the grad allocators are asked for: ``grad_comm_dtype`` when set, else the
    main-grad dtype."""
    return str(grad_dtype if grad_comm_dtype is None else grad_comm_dtype)


def round_up(n: int, step: int) -> int:
    """Smallest multiple of ``step`` that is >= ``n``."""
    return -(-n // step) * step


def align_elems(align_bytes: int, itemsize: int) -> int:
    """Smallest element count whose byte size covers ``align_bytes`` (the offset step)."""
    return max(1, -(-align_bytes // itemsize))


def aligned_numel(numel: int, align_bytes: int, itemsize: int) -> int:
    """``numel`` rounded up to the offset step, so that whatever follows it is aligned."""
    return round_up(numel, align_elems(align_bytes, itemsize))


@dataclass(frozen=True)
class BucketSpec:
    """One bucket as seen by one allocator.

    ``numel`` is the padded size actually requested at runtime (``bucket_index.size``);
    ``unpadded_numel`` is the sum of parameter numels (what FixedPool compares).
    ``unit_id`` None marks a non-unit bucket, which is never pooled.
    """

    bucket_id: int
    unit_id: int | None
    dtype: str
    numel: int
    itemsize: int
    unpadded_numel: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", planned_dtype_name(self.dtype))
        if self.unpadded_numel is None:
            object.__setattr__(self, "unpadded_numel", self.numel)

    @property
    def nbytes(self) -> int:
        """Padded size in bytes."""
        return self.numel * self.itemsize


@dataclass(frozen=True)
class MaxPoolPlan:
    """Arena plan for one allocator (see module docstring)."""

    arena_numel: dict[str, int]  # dtype -> elements per buffer group
    offsets: dict[int, tuple[str, int]]  # bucket_id -> (dtype, element offset in arena)
    setter: dict[str, int]  # dtype -> unit whose layout set the arena size
    unit_ids: tuple[int, ...]
    itemsize: dict[str, int]
    align_bytes: int = DEFAULT_ALIGN_BYTES
    buckets: dict[int, BucketSpec] = field(default_factory=dict)  # planned unit buckets
    unit_layout_numel: dict[str, dict[int, int]] = field(default_factory=dict)
    num_groups: int = NUM_BUFFER_GROUPS  # [Note: double buffer], live units

    def arena_bytes(self, dtype: str) -> int:
        """Bytes of one group's arena for ``dtype``."""
        return self.arena_numel[dtype] * self.itemsize[dtype]

    def pool_bytes(self) -> int:
        """Total pool bytes: every buffer group, all dtypes."""
        return self.num_groups * sum(self.arena_bytes(d) for d in self.arena_numel)


def _validated(buckets: Iterable[BucketSpec]) -> list[BucketSpec]:
    """Sorted by bucket id, with clear errors on malformed input."""
    specs = list(buckets)
    seen: dict[int, BucketSpec] = {}
    itemsize: dict[str, int] = {}
    for b in specs:
        if not isinstance(b, BucketSpec):
            raise ValueError(f"expected BucketSpec, got {type(b).__name__}: {b!r}")
        if b.bucket_id in seen:
            raise ValueError(f"duplicate bucket id {b.bucket_id}: {seen[b.bucket_id]} and {b}")
        seen[b.bucket_id] = b
        if b.bucket_id < 0:
            raise ValueError(f"bucket id must be >= 0: {b}")
        if b.unit_id is not None and b.unit_id < 0:
            raise ValueError(f"unit id must be None or >= 0: {b}")
        if b.numel <= 0:
            raise ValueError(f"bucket {b.bucket_id} has numel {b.numel} <= 0: {b}")
        if b.itemsize <= 0:
            raise ValueError(f"bucket {b.bucket_id} has itemsize {b.itemsize} <= 0: {b}")
        if b.unpadded_numel is None or not 0 < b.unpadded_numel <= b.numel:
            raise ValueError(
                f"bucket {b.bucket_id}: unpadded_numel {b.unpadded_numel} must be in "
                f"(0, numel={b.numel}]: {b}"
            )
        if itemsize.setdefault(b.dtype, b.itemsize) != b.itemsize:
            raise ValueError(
                f"dtype {b.dtype} has inconsistent itemsize: {itemsize[b.dtype]} vs "
                f"{b.itemsize} (bucket {b.bucket_id})"
            )
    return sorted(specs, key=lambda b: b.bucket_id)


def _unit_buckets(specs: list[BucketSpec]) -> dict[int, list[BucketSpec]]:
    units: dict[int, list[BucketSpec]] = defaultdict(list)
    for b in specs:
        if b.unit_id is not None:
            units[b.unit_id].append(b)
    if not units:
        raise ValueError(
            f"no FSDP unit buckets to plan ({len(specs)} buckets, all non-unit); "
            "max-pool double buffering needs at least one FSDP unit"
        )
    return units


def plan_max_pool(
    buckets: Iterable[BucketSpec],
    *,
    align_bytes: int = DEFAULT_ALIGN_BYTES,
    num_groups: int | None = None,
) -> MaxPoolPlan:
    """Arena plan: per dtype, arena = max over units of the unit's aligned layout.

    ``num_groups`` defaults to NUM_BUFFER_GROUPS ([Note: double buffer], live units).
    """
    if align_bytes < 1:
        raise ValueError(f"align_bytes must be >= 1, got {align_bytes}")
    groups = buffer_groups(num_groups)
    specs = _validated(buckets)
    units = _unit_buckets(specs)
    itemsize = {b.dtype: b.itemsize for b in specs if b.unit_id is not None}
    offsets: dict[int, tuple[str, int]] = {}
    layout: dict[str, dict[int, int]] = defaultdict(dict)
    for unit_id in sorted(units):
        cursor: dict[str, int] = defaultdict(int)
        for b in units[unit_id]:  # bucket-id order
            start = aligned_numel(cursor[b.dtype], align_bytes, b.itemsize)
            offsets[b.bucket_id] = (b.dtype, start)
            cursor[b.dtype] = start + b.numel
        for dtype, end in cursor.items():
            layout[dtype][unit_id] = end
    arena_numel: dict[str, int] = {}
    setter: dict[str, int] = {}
    for dtype in sorted(layout):
        # Largest layout wins; ties go to the smallest unit id (deterministic).
        unit_id, numel = min(layout[dtype].items(), key=lambda kv: (-kv[1], kv[0]))
        arena_numel[dtype] = numel
        setter[dtype] = unit_id
    return MaxPoolPlan(
        arena_numel=arena_numel,
        offsets=offsets,
        setter=setter,
        unit_ids=tuple(sorted(units)),
        itemsize={d: itemsize[d] for d in sorted(itemsize)},
        align_bytes=align_bytes,
        buckets={b.bucket_id: b for b in specs if b.unit_id is not None},
        unit_layout_numel={d: dict(sorted(v.items())) for d, v in sorted(layout.items())},
        num_groups=groups,
    )


def _mib(n: int) -> str:
    return f"{n} B = {n / 2**20:.2f} MiB"


def format_plan(plan: MaxPoolPlan, name: str = "maxpool") -> list[str]:
    """INFO log lines: pool total, then per dtype the arena and the unit that sets it."""
    specs = list(plan.buckets.values())
    lines = [f"[{name}] max-pool plan: {len(plan.unit_ids)} units, pool {_mib(plan.pool_bytes())} "
             f"({plan.num_groups} groups)"]
    for dtype in sorted(plan.arena_numel):
        unit = plan.setter[dtype]
        members = [b.bucket_id for b in specs if b.unit_id == unit and b.dtype == dtype]
        lines.append(
            f"[{name}] {dtype}: arena {plan.arena_numel[dtype]} elems "
            f"({_mib(plan.arena_bytes(dtype))}) per group, set by unit {unit} (buckets {members})"
        )
    return lines


# Lanes ([Note: double buffer], lanes and homes): a unit may live only in its allowed lanes, and
# a lane's arena per dtype is sized by the largest unit allowed in it. The shared assignment
# (every unit in every lane) is plan_max_pool byte for byte; round robin (unit i in lane i % N)
# is what N >= 3 lanes use at run time (runtime_lane_plan, LaneMaxPool).


@dataclass(frozen=True)
class LanePlan:
    """Arena plan of a pool whose units may live only in their allowed lanes."""

    lanes: int
    allowed: dict[int, tuple[int, ...]]  # unit -> lanes it may live in (ascending)
    arena_numel: dict[tuple[int, str], int]  # (lane, dtype) -> elements; absent = no arena
    setter: dict[tuple[int, str], int]  # (lane, dtype) -> unit whose layout set the size
    offsets: dict[int, tuple[str, int]]  # bucket -> (dtype, offset): same in every lane
    itemsize: dict[str, int]
    align_bytes: int
    unit_layout_numel: dict[str, dict[int, int]]
    buckets: dict[int, BucketSpec] = field(default_factory=dict)  # planned unit buckets

    @property
    def unit_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.allowed))

    def arena_bytes(self, lane: int, dtype: str) -> int:
        return self.arena_numel.get((lane, dtype), 0) * self.itemsize[dtype]

    def pool_bytes(self) -> int:
        """Bytes of every (lane, dtype) arena."""
        return sum(n * self.itemsize[d] for (_, d), n in self.arena_numel.items())


def shared_lanes(unit_ids: Iterable[int], lanes: int) -> dict[int, tuple[int, ...]]:
    """Every unit may use every lane ([Note: double buffer], lanes and homes)."""
    return {u: tuple(range(lanes)) for u in unit_ids}


def round_robin_lanes(unit_ids: Iterable[int], lanes: int) -> dict[int, tuple[int, ...]]:
    """The unit at position i (unit-id order) lives only in lane i % lanes."""
    return {u: (i % lanes,) for i, u in enumerate(sorted(unit_ids))}


def plan_lanes(
    buckets: Iterable[BucketSpec],
    *,
    lanes: int,
    assignment: str = "round_robin",
    align_bytes: int = DEFAULT_ALIGN_BYTES,
) -> LanePlan:
    """Lane plan: each (lane, dtype) arena holds the largest unit allowed in that lane.

    ``assignment`` is ``"round_robin"`` or ``"shared"`` (the comment above). A unit's
    buckets keep the max-pool plan's offsets, so a unit's layout is the same in every lane.
    """
    groups = buffer_groups(lanes)
    assign = {"round_robin": round_robin_lanes, "shared": shared_lanes}.get(assignment)
    if assign is None:
        raise ValueError(
            f"assignment must be 'round_robin' or 'shared', got {assignment!r}"
        )
    base = plan_max_pool(buckets, align_bytes=align_bytes, num_groups=groups)
    allowed = assign(base.unit_ids, groups)
    arena_numel: dict[tuple[int, str], int] = {}
    setter: dict[tuple[int, str], int] = {}
    for dtype, per_unit in base.unit_layout_numel.items():
        for unit_id, numel in sorted(per_unit.items()):
            for lane in allowed[unit_id]:
                # Largest layout wins; ties go to the smallest unit id (deterministic).
                if numel > arena_numel.get((lane, dtype), 0):
                    arena_numel[(lane, dtype)] = numel
                    setter[(lane, dtype)] = unit_id
    return LanePlan(
        lanes=groups,
        allowed=allowed,
        arena_numel=dict(sorted(arena_numel.items())),
        setter=dict(sorted(setter.items())),
        offsets=dict(base.offsets),
        itemsize=dict(base.itemsize),
        align_bytes=align_bytes,
        unit_layout_numel=base.unit_layout_numel,
        buckets=dict(base.buckets),
    )


def format_lane_plan(plan: LanePlan, name: str = "maxpool") -> list[str]:
    """One line for the pool, then one per (lane, dtype) arena with the unit that sized it."""
    lines = [f"[{name}] {plan.lanes}-lane plan: pool {_mib(plan.pool_bytes())}"]
    for (lane, dtype), numel in plan.arena_numel.items():
        units = [u for u, ls in plan.allowed.items() if lane in ls]
        lines.append(
            f"[{name}]   lane {lane} {dtype}: {numel} elems ({_mib(plan.arena_bytes(lane, dtype))}), "
            f"set by unit {plan.setter[(lane, dtype)]} of units {units}"
        )
    return lines


SHARED_LANES = 2  # the lane count of the shared pool ([Note: double buffer], lanes and homes)


def lane_assignment(lanes: int) -> str:
    """The assignment the runtime uses for ``lanes``: shared at 2, round robin from 3 on."""
    groups = buffer_groups(lanes)
    return "shared" if groups == SHARED_LANES else "round_robin"


def runtime_lane_plan(
    buckets: Iterable[BucketSpec], *, lanes: int, align_bytes: int = DEFAULT_ALIGN_BYTES
) -> LanePlan:
    """The lane plan the max-pool allocators hold for ``lanes`` (the planner prints this one)."""
    return plan_lanes(
        buckets, lanes=lanes, assignment=lane_assignment(lanes), align_bytes=align_bytes
    )


def lanes_units_problem(lanes: int, num_units: int, *, setting: str) -> str | None:
    """Why ``lanes`` round-robin lanes cannot serve ``num_units`` FSDP units, or None.

    A lane without a unit would hold nothing, so more lanes than units is a mistake rather
    than a deeper pool. The shared pool (2 lanes) is never refused. ``setting`` names
    where the count came from, for the message.
    """
    if lanes > SHARED_LANES and lanes > num_units:
        return (
            f"{setting} asks for {lanes} lanes, more than the {num_units} FSDP units of this "
            f"model chunk, so {lanes - num_units} lane(s) would hold no unit; use at most "
            f"{max(num_units, SHARED_LANES)} lanes."
        )
    return None
