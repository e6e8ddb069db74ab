# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""LaneMaxPool: the max-pool double buffer with 3 or more round-robin lanes.

A MaxPool whose buffer groups are lanes of their own size: the plan is
``plan.runtime_lane_plan`` (unit at position i lives in lane i % N, each (lane,
dtype) arena sized by the largest unit of that lane), and a unit's home is the plan's lane,
fixed before the first allocation ([Note: double buffer], lanes and homes). Everything else
(views at planned offsets, arenas created once and never grown, the live-unit limit N read by
ParamAndGradBuffer.live_unit_limit, poisoning, stats) is MaxPool's. ParamAndGradBuffer builds
this class only when the double-buffer policy says so (``DoubleBufferPolicy.pick``: max-pool
with 3 or more lanes, a range the policy's builder checked; 2 lanes is MaxPool), with ``size``
its ``live_units``. ParamAndGradBuffer's ``LaneMaxPoolAllocator`` is this class with its bucket
types (allocator.py says why).
"""

from __future__ import annotations

import logging

from ..utils import log_single_rank
from .allocator import MaxPool
from .plan import BucketSpec, LanePlan, format_lane_plan, lanes_units_problem, runtime_lane_plan
from .policy import LANES_EVERYWHERE

logger = logging.getLogger(__name__)


class MaxPoolLanesError(ValueError):
    """A lane count this model chunk cannot use; found while its buffer is built, so entry
    points that report flag errors as one sentence catch it by this type."""


class LaneMaxPool(MaxPool):
    """MaxPool with ``size`` >= 3 round-robin lanes and plan-fixed homes.

    Takes MaxPool's arguments; ``size`` is the lane count N (the policy's ``live_units``).
    The units are counted here, once, from the groups it serves: a chunk with fewer than N
    units is refused (``plan.lanes_units_problem``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        problem = lanes_units_problem(self.size, len(self.fsdp_double_buffer_units), setting=LANES_EVERYWHERE)
        if problem is not None:
            raise MaxPoolLanesError(f"[{self.name}] {problem}")

    # ----------------------------------------------------------------- planning
    def _make_plan(self, specs: list[BucketSpec]) -> LanePlan:
        plan = runtime_lane_plan(specs, lanes=self.size, align_bytes=self.align_bytes)
        for line in format_lane_plan(plan, name=self.name):
            log_single_rank(logger, logging.INFO, line)
        # Homes are the plan's lanes, fixed before the first allocation.
        self.home = {unit: allowed[0] for unit, allowed in plan.allowed.items()}
        return plan

    def _lane_plan(self) -> LanePlan:
        plan = self.plan
        if not isinstance(plan, LanePlan):
            raise RuntimeError(f"[{self.name}] has no lane plan: {plan!r}")
        return plan

    def planned_arena_numel(self, group: int, dname: str) -> int:
        arenas = self._lane_plan().arena_numel
        numel = arenas.get((group, dname))
        if numel is None:
            raise RuntimeError(
                f"[{self.name}] lane {group} has no {dname} arena (its units hold no {dname} "
                f"bucket); arenas: {arenas}"
            )
        return numel

    def arena_order(self) -> list[tuple[int, str, int]]:
        """(lane, planned dtype, numel) of every arena: lanes ascending, dtype names sorted."""
        if self.plan is None:
            return []
        return [(lane, d, n) for (lane, d), n in sorted(self._lane_plan().arena_numel.items())]

    # --------------------------------------------------------------- allocation
    def _fits(self, unit_id: int, lane: int) -> bool:
        """Whether every arena of ``lane`` holds ``unit_id``'s layout of that dtype."""
        plan = self._lane_plan()
        return all(
            per_unit[unit_id] <= plan.arena_numel.get((lane, dtype), 0)
            for dtype, per_unit in plan.unit_layout_numel.items()
            if unit_id in per_unit
        )

    def _acquire_group(self, unit_id: int, strict: bool) -> int:
        if unit_id in self.unit_group:
            return self.unit_group[unit_id]
        idle = self._idle_groups(unit_id)
        home = self.home[unit_id]
        if home in idle:
            group = home
        else:
            fitting = [g for g in idle if self._fits(unit_id, g)]
            if not fitting:
                raise RuntimeError(
                    f"[{self.name}] unit {unit_id}: home lane {home} is owned by unit "
                    f"{self.group_owner[home]} and no idle lane of {idle} is large enough "
                    f"(arenas {self._lane_plan().arena_numel}). Live units must be consecutive for "
                    "round-robin lanes; see [Note: double buffer], lanes and homes"
                )
            group = fitting[0]
            if strict:
                # Raises under fail_on_home_miss (after capture): [Note: double buffer], lanes and homes.
                self._home_miss(unit_id, home, group)
        self.group_owner[group] = unit_id
        self.unit_group[unit_id] = group
        return group
