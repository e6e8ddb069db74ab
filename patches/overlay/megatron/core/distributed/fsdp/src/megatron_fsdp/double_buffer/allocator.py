# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""MaxPool: double buffering sized by the largest FSDP unit (arena layout).

Every FSDP unit is pooled (unlike FixedPoolAllocator, which pools only the most common
unit shape). Per dtype and buffer group there is one arena tensor, requested once at
its full planned size from the global memory buffer, so it never grows after first use
(safe for NCCL user-buffer registration and CUDA-graph capture). A live unit owns one
group; its buckets are views at fixed planned offsets. Each unit has a home group
(recorded at its first strict allocation) so addresses are stable across iterations.
Non-unit buckets are never pooled. The pure layout math lives in ``plan``; the invariants
this class keeps are [Note: double buffer], failure modes.

ParamAndGradBuffer's ``MaxPoolAllocator`` is this class with its own bucket types
(``bucket_type``, ``backup_type``): this module never imports param_and_grad_buffer, which
imports it and chooses between it and FixedPoolAllocator where it builds its allocators.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from ..utils import get_global_memory_buffer, log_single_rank
from .dtypes import dtype_from_name, planned_itemsize, planned_param_dtype
from .plan import (
    DEFAULT_ALIGN_BYTES,
    BucketSpec,
    LanePlan,
    MaxPoolPlan,
    buffer_groups,
    format_plan,
    plan_max_pool,
    planned_dtype_name,
)

logger = logging.getLogger(__name__)

# Debug aid: "1" fills a bucket's pool slot with NaN (0xFF for integer dtypes) each time the
# bucket takes it, so any read of pool memory that was not written in this life shows as NaN.
POISON_ENV = "HFSDP_MAXPOOL_POISON"

# Groups are Megatron-FSDP ParameterGroups (fsdp_unit_id, params, dtype and their DP buffers).
DtypeFn = Callable[[Any], Any]
NumelFn = Callable[[Any], int | None]


def _unpadded_numel(group: Any) -> int:
    return sum(p.numel() for p in group.params)


def _padded(buffer: Any) -> int | None:
    return None if buffer is None else buffer.bucket_index.size


# The DP buffer whose padded bucket size each of ParamAndGradBuffer's pools plans (by pool
# name); read lazily, as the DP buffers exist only by the first allocation. Grads are
# requested on the HFSDP helper buffer when there is one (p._gbuf).
PADDED_NUMEL: dict[str, NumelFn] = {
    "fsdp_params": lambda g: _padded(g.model_weight_buffer),
    "fsdp_fp8_transpose_params": lambda g: _padded(g.transpose_weight_buffer),
    "fsdp_grads": lambda g: _padded(g.hfsdp_helper_gbuf or g.main_grad_buffer),
    "hsdp_grad_comm": lambda g: _padded(g.hsdp_comm_gbuf),
}


class MaxPool:
    """Double-buffer allocator whose pool is ``size`` x the largest unit per dtype.

    Args:
        name: prefix of the global-memory-buffer keys.
        fsdp_param_groups: all parameter groups; index == bucket id.
        size: number of buffer groups = units that may be live at once; default
            plan.NUM_BUFFER_GROUPS ([Note: double buffer], live units).
        fallback_to_persistent_buffer: non-unit buckets get a persistent buffer
            instead of the StorageResize backup.
        dtype_fn: dtype this allocator is asked for per group (default: param dtype).
        numel_fn: padded numel requested per group, or None when this allocator never
            serves the group (default: ``PADDED_NUMEL[name]`` for ParamAndGradBuffer's
            pools, else the unpadded sum of param numels).
        fail_on_home_miss: raise instead of logging when a unit cannot get its home
            group (use after CUDA-graph capture / manual UB registration).
        align_bytes: alignment of every bucket offset inside an arena.

    Subclasses set ``bucket_type`` (what ``allocate`` returns: a holder of ``data``) and
    ``backup_type`` (the allocator of non-unit buckets, which keeps a bucket's storage
    across frees: [Note: double buffer], failure modes: dropped bucket).
    """

    bucket_type: Any = None
    backup_type: Any = None

    def __init__(
        self,
        name: str,
        fsdp_param_groups: list[Any],
        size: int | None = None,
        fallback_to_persistent_buffer: bool = False,
        dtype_fn: DtypeFn | None = None,
        numel_fn: NumelFn | None = None,
        fail_on_home_miss: bool = False,
        align_bytes: int = DEFAULT_ALIGN_BYTES,
    ):
        if self.bucket_type is None or self.backup_type is None:
            raise TypeError(
                f"{type(self).__name__} has no bucket types; use param_and_grad_buffer's "
                f"MaxPoolAllocator (bucket_type={self.bucket_type!r}, backup_type={self.backup_type!r})"
            )
        super().__init__()  # the bucket allocator base of the subclass, if any
        self.name = name
        self.fsdp_param_groups = fsdp_param_groups
        self.size = buffer_groups(size)
        self.fallback_to_persistent_buffer = fallback_to_persistent_buffer
        self.dtype_fn = dtype_fn if dtype_fn is not None else planned_param_dtype
        role = name.rpartition(".")[2]  # the pool's name without its model's scope (DoubleBufferPolicy.scoped)
        self.numel_fn = numel_fn if numel_fn is not None else PADDED_NUMEL.get(role, _unpadded_numel)
        self.fail_on_home_miss = fail_on_home_miss
        self.align_bytes = align_bytes
        unit_ids = {g.fsdp_unit_id for g in fsdp_param_groups if g.fsdp_unit_id is not None}
        if not unit_ids:
            raise ValueError(f"[{name}] found no FSDP units to use max-pool double buffering")
        # Every unit is pooled: feeds double_buf_units, so the live-unit gates count all.
        self.fsdp_double_buffer_units = sorted(unit_ids)
        self.backup_allocator = self.backup_type()
        self._plan: MaxPoolPlan | LanePlan | None = None  # LanePlan: the LaneMaxPool subclass
        self.released = False  # release(): the model's pools were freed
        self._planned = False
        self.group_owner: dict[int, int | None] = {g: None for g in range(self.size)}
        self.unit_group: dict[int, int] = {}  # live unit -> buffer group it owns
        self.unit_live: dict[int, set[int]] = {}  # live unit -> its allocated bucket ids
        self.home: dict[int, int] = {}  # unit -> home group (first strict allocation)
        self.using: dict[int, tuple[int, str]] = {}  # bucket -> (group, planned dtype)
        self.arenas: dict[tuple[int, str], torch.Tensor] = {}
        # (bucket, group, dtype, size) -> Bucket view. Arenas never move (size drift), so a view
        # made once stays valid; the main_grad getter asks once per parameter per micro-batch.
        self._views: dict[tuple[int, int, torch.dtype, int], Any] = {}
        self.home_misses = 0
        self.allocations = 0
        self._persistent_bytes = 0
        self.presized = False  # all arenas created at planned size up front (NCCL UB staging)
        self.poison = os.environ.get(POISON_ENV, "0") == "1"
        if self.poison:
            log_single_rank(
                logger,
                logging.WARNING,
                f"[{name}] {POISON_ENV}=1: pool slots are poisoned when a bucket takes them "
                "(debugging only; costs a fill per bucket life)",
            )

    # ----------------------------------------------------------------- planning
    def bucket_specs(self) -> list[BucketSpec]:
        """BucketSpecs of the groups this allocator serves (padded numel, planned dtype)."""
        specs = []
        for bucket_id, group in enumerate(self.fsdp_param_groups):
            numel = self.numel_fn(group)
            if numel is None:
                continue  # this allocator never serves the group (no such buffer)
            dtype = self.dtype_fn(group)
            specs.append(
                BucketSpec(
                    bucket_id=bucket_id,
                    unit_id=group.fsdp_unit_id,
                    dtype=planned_dtype_name(dtype),
                    numel=int(numel),
                    itemsize=planned_itemsize(dtype),
                    unpadded_numel=min(_unpadded_numel(group), int(numel)),
                )
            )
        return specs

    @property
    def plan(self) -> MaxPoolPlan | LanePlan | None:
        """The arena plan; built on first use (after the DP buffers know padded sizes).

        None when this allocator serves no unit bucket (e.g. the MXFP8 transpose pool of a
        model without FP8): then it never allocates pool memory.
        """
        if self.released:
            raise RuntimeError(f"[{self.name}] was released (model_pools.release_model_pools): its model's "
                               "pools are freed and it is not run again")
        if not self._planned:
            specs = self.bucket_specs()
            if any(s.unit_id is not None for s in specs):
                self._plan = self._make_plan(specs)
            self._planned = True
        return self._plan

    def _make_plan(self, specs: list[BucketSpec]) -> MaxPoolPlan | LanePlan:
        """Plan ``specs`` and log it (LaneMaxPool plans lanes instead)."""
        plan = plan_max_pool(specs, align_bytes=self.align_bytes, num_groups=self.size)
        for line in format_plan(plan, name=self.name):
            log_single_rank(logger, logging.INFO, line)
        return plan

    def release(self) -> None:
        """Forget the arenas and the plan (model_pools.release_model_pools drops the memory); a
        released allocator refuses every later request."""
        self.arenas.clear()
        self._plan, self.released = None, True

    def _single_plan(self) -> MaxPoolPlan:
        """The plan of this class (one arena size per dtype, shared by every group)."""
        plan = self.plan
        if not isinstance(plan, MaxPoolPlan):
            raise RuntimeError(f"[{self.name}] has no max-pool plan: {plan!r}")
        return plan

    def planned_arena_numel(self, group: int, dname: str) -> int:
        """Elements of the (group, dtype) arena: every group holds the largest unit."""
        return self._single_plan().arena_numel[dname]

    # --------------------------------------------------------------- allocation
    def allocate(
        self,
        bucket_id: int,
        size: int,
        dtype: torch.dtype,
        device: torch.device,
        mem_alloc_context: Callable | None = None,
        strict_assignments: bool = True,
    ) -> Any:
        """Return a view of the unit's arena, or a non-unit fallback buffer."""
        live = self.using.get(bucket_id)
        if live is not None:
            view = self._views.get((bucket_id, live[0], dtype, size))
            if view is not None:
                return view  # fast path: validated when the view was made
        unit_id = self.fsdp_param_groups[bucket_id].fsdp_unit_id
        if unit_id is None:
            return self._allocate_non_unit(bucket_id, size, dtype, device, mem_alloc_context)
        plan = self.plan
        if plan is None or bucket_id not in plan.offsets:
            raise RuntimeError(
                f"[{self.name}] bucket {bucket_id} (unit {unit_id}) was not planned: its group "
                "has no buffer served by this allocator (numel_fn returned None)"
            )
        dname = planned_dtype_name(dtype)
        planned_dtype, offset = plan.offsets[bucket_id]
        planned_numel = plan.buckets[bucket_id].numel
        if dname != planned_dtype or size > planned_numel:
            raise ValueError(
                f"[{self.name}] bucket {bucket_id} (unit {unit_id}) requested {size} x "
                f"{dname}, but the plan has {planned_numel} x {planned_dtype}; check dtype_fn / "
                "numel_fn (grad_comm_dtype changed after planning?)"
            )
        new_life = bucket_id not in self.using
        if new_life:
            group = self._acquire_group(unit_id, strict_assignments)
            self.using[bucket_id] = (group, dname)
            self.unit_live.setdefault(unit_id, set()).add(bucket_id)
            self.allocations += 1
        else:
            group, _ = self.using[bucket_id]
        arena = self._arena(group, dname, device, mem_alloc_context)
        if new_life and self.poison:
            # On the taker's stream, which is ordered after the slot's previous users.
            slot = arena[offset : offset + planned_numel]
            slot.fill_(float("nan") if slot.is_floating_point() else torch.iinfo(slot.dtype).max)
        view = self._views.get((bucket_id, group, dtype, size))
        if view is None:
            view = self.bucket_type(data=arena[offset : offset + size])
            self._views[(bucket_id, group, dtype, size)] = view
        return view

    def _idle_groups(self, unit_id: int) -> list[int]:
        """Groups no unit owns; none left is the too-many-live-units error."""
        idle = [g for g in range(self.size) if self.group_owner[g] is None]
        if not idle:
            raise RuntimeError(
                f"[{self.name}] no idle buffer group for unit {unit_id}: groups are owned by "
                f"{self.group_owner}, live buckets {self.unit_live}. More than {self.size} units "
                "requested at once (prefetch / missing live-unit limit?); "
                "see [Note: double buffer], failure modes: too many live units"
            )
        return idle

    def _acquire_group(self, unit_id: int, strict: bool) -> int:
        if unit_id in self.unit_group:
            return self.unit_group[unit_id]
        idle = self._idle_groups(unit_id)
        home = self.home.get(unit_id)
        if home is not None and home in idle:
            group = home
        else:
            group = idle[0]
            if strict and home is None:
                self.home[unit_id] = group
            elif strict and home is not None:
                self._home_miss(unit_id, home, group)
        self.group_owner[group] = unit_id
        self.unit_group[unit_id] = group
        return group

    def _home_miss(self, unit_id: int, home: int, group: int) -> None:
        self.home_misses += 1
        msg = (
            f"[{self.name}] home miss #{self.home_misses}: unit {unit_id} home group {home} is "
            f"owned by unit {self.group_owner[home]}; using group {group}. During CUDA-graph "
            "warmup/capture or after manual UB registration this means stale addresses."
        )
        if self.fail_on_home_miss:
            raise RuntimeError(msg)
        log_single_rank(logger, logging.INFO, msg)

    def arena_name(self, group: int, dname: str) -> str:
        """Global-memory-buffer key of the (group, dtype) arena."""
        return f"{self.name}_maxpool_g{group}_{dname.replace('torch.', '')}"

    def arena_order(self) -> list[tuple[int, str, int]]:
        """(group, planned dtype, numel) of every arena, in the order ``presize`` creates them.

        Deterministic (groups ascending, dtype names sorted): NCCL symmetric registration needs
        the same allocation sequence on every rank.
        """
        if self.plan is None:
            return []
        plan = self._single_plan()
        dtypes = sorted(plan.arena_numel)
        return [(g, d, plan.arena_numel[d]) for g in range(self.size) for d in dtypes]

    def presize(self, device: torch.device | None = None) -> list[tuple[int, str, int]]:
        """Create every (group, dtype) arena now, once, at its planned size.

        Call inside the NCCL mem-pool context (the caller owns it; no context is entered
        here) so the arenas land in the pool before registration and never grow after it
        ([Note: double buffer], failure modes: size drift). Refuses to grow an arena of the same
        name another model chunk created smaller, because that memory may already be
        registered or captured.
        Returns ``arena_order()``.
        """
        order = self.arena_order()
        gmb = get_global_memory_buffer()
        for group, dname, numel in order:
            existing = gmb.buffer.get((self.arena_name(group, dname), dtype_from_name(dname)))
            if existing is not None and (group, dname) not in self.arenas:
                if existing.numel() < numel:
                    raise RuntimeError(
                        f"[{self.name}] arena {self.arena_name(group, dname)} already exists with "
                        f"{existing.numel()} elems (another model chunk?), this plan needs {numel}: "
                        "growing it would leave registered/captured memory stale"
                    )
            self._arena(group, dname, device, None)
        self.presized = True
        return order

    def _arena(
        self,
        group: int,
        dname: str,
        device: torch.device | None,
        mem_alloc_context: Callable | None,
    ) -> torch.Tensor:
        key = (group, dname)
        planned = self.planned_arena_numel(group, dname)
        gbuf_name = self.arena_name(group, dname)
        torch_dtype = dtype_from_name(dname)
        if key not in self.arenas:
            if mem_alloc_context is not None and mem_alloc_context is not nullcontext:
                # Creating a buffer under a (de)registering NCCL context must be serialised.
                torch.cuda.synchronize()
            self.arenas[key] = get_global_memory_buffer().get_tensor(
                [planned], dtype=torch_dtype, name=gbuf_name, mem_alloc_context=mem_alloc_context
            )
        arena = self.arenas[key]
        current = get_global_memory_buffer().buffer.get((gbuf_name, torch_dtype))
        # [Note: double buffer], failure modes: size drift: requested once at full size, never regrown.
        if arena.numel() != planned or current is None or current.data_ptr() != arena.data_ptr():
            raise RuntimeError(
                f"[{self.name}] arena {gbuf_name} changed after first use: planned {planned} elems, "
                f"have {arena.numel()}, global buffer entry "
                f"{None if current is None else (current.numel(), current.data_ptr())} vs "
                f"{arena.data_ptr()}"
            )
        if device is not None and arena.device.type != torch.device(device).type:
            raise RuntimeError(f"[{self.name}] arena on {arena.device}, request for {device}")
        return arena

    def _allocate_non_unit(self, bucket_id, size, dtype, device, mem_alloc_context) -> Any:
        if not self.fallback_to_persistent_buffer:
            return self.backup_allocator.allocate(
                bucket_id=bucket_id, size=size, dtype=dtype, device=device
            )
        name = f"{self.name}_not_in_max_pool_{bucket_id}_{size}_{dtype}_{device}"
        gmb = get_global_memory_buffer()
        if (name, dtype) not in gmb.buffer:
            if mem_alloc_context is not None and mem_alloc_context is not nullcontext:
                torch.cuda.synchronize()
            self._persistent_bytes += size * planned_itemsize(dtype)
        return self.bucket_type(
            data=gmb.get_tensor([size], dtype=dtype, name=name, mem_alloc_context=mem_alloc_context)
        )

    def free(self, bucket_id: int):
        """Return a unit bucket to its group (released when the unit has none live)."""
        unit_id = self.fsdp_param_groups[bucket_id].fsdp_unit_id
        if unit_id is None:
            if not self.fallback_to_persistent_buffer:
                self.backup_allocator.free(bucket_id)
            return
        if bucket_id not in self.using:
            return
        group, _ = self.using.pop(bucket_id)
        live = self.unit_live[unit_id]
        live.discard(bucket_id)
        if not live:
            del self.unit_live[unit_id]
            del self.unit_group[unit_id]
            self.group_owner[group] = None

    # ------------------------------------------------------------------ reports
    def stats(self) -> dict[str, int]:
        """Counters for tests and logs (pool bytes exclude non-unit fallbacks)."""
        plan = self.plan
        return {
            "pool_bytes_planned": plan.pool_bytes() if plan is not None else 0,
            "pool_bytes_allocated": sum(t.numel() * t.element_size() for t in self.arenas.values()),
            "home_misses": self.home_misses,
            "allocations": self.allocations,
            "persistent_fallback_bytes": self._persistent_bytes,
        }


ALLOCATOR_ATTRS = ("weight_alloc", "transpose_weight_alloc", "main_grad_alloc", "hsdp_grad_comm_alloc")


def buffer_max_pool_allocators(buffer: Any) -> list[MaxPool]:
    """The max-pool allocators of one ParamAndGradBuffer, in a fixed (rank-independent) order."""
    found: list[MaxPool] = []
    for attr in ALLOCATOR_ATTRS:
        alloc = getattr(buffer, attr, None)  # hsdp_grad_comm_alloc exists with hybrid FSDP only
        if isinstance(alloc, MaxPool) and all(alloc is not a for a in found):
            found.append(alloc)
    return found


def model_buffers(model: Any) -> list[Any]:
    """The Megatron-FSDP buffers reachable from model chunk(s), each once.

    ``model`` is a module or a list of model chunks (as passed to forward_backward_func);
    any submodule with a ``param_and_grad_buffer`` (MegatronFSDP and its adapter) counts.
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    found: list[Any] = []
    for chunk in chunks:
        for mod in chunk.modules() if isinstance(chunk, torch.nn.Module) else [chunk]:
            buffer = getattr(mod, "param_and_grad_buffer", None)
            if buffer is not None and all(buffer is not b for b in found):
                found.append(buffer)
    return found


def model_max_pool_allocators(model: Any) -> list[MaxPool]:
    """The max-pool allocators of every Megatron-FSDP buffer of model chunk(s) (model_buffers)."""
    found: list[MaxPool] = []
    for buffer in model_buffers(model):
        for alloc in buffer_max_pool_allocators(buffer):
            if all(alloc is not a for a in found):
                found.append(alloc)
    return found


def set_fail_on_home_miss(model: Any) -> list[MaxPool]:
    """Make home misses fatal on every max-pool allocator of ``model``; returns them.

    Call once a CUDA graph holding pool addresses was captured: from then on a unit landing
    outside its home group would run the graph against a stale pointer.
    """
    allocators = model_max_pool_allocators(model)
    for alloc in allocators:
        alloc.fail_on_home_miss = True
    return allocators
