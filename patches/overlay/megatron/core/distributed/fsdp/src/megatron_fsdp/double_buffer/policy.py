# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""DoubleBufferPolicy: how Megatron-FSDP double-buffers, built once per entry route.

A small frozen value, like FSDP2's ``MixedPrecisionPolicy``: each entry route builds it from the
user's settings (:func:`policy_from_args`, :func:`policy_from_config`, :func:`policy_from_keywords`),
checked by :func:`build_policy` alone, and hands it down. [Note: double buffer], policy, lists the
files the setting passes through on its way to the allocator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar

from .plan import SHARED_LANES, buffer_groups

UNIT_STRATEGY = "optim_grads_params"  # the only sharding strategy with FSDP units
SCOPE = re.compile(r"[A-Za-z0-9_]*")  # a pool scope: letters, digits and _ ("" is the process's default)
POOL_SCOPE = "megatron_fsdp_pool_scope"  # the DDP config attribute model_pools.with_pool_scope sets
T = TypeVar("T")


@dataclass(frozen=True)
class Names:  # how one route spells the settings, for messages
    max_pool: str
    lanes: str
    double_buffer: str
    persistent_fallback: str
    strategy: str


FLAGS = Names("--megatron-fsdp-max-pool-double-buffer", "--megatron-fsdp-max-pool-lanes",
              "--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail", "--data-parallel-sharding-strategy")
FIELDS = Names("megatron_fsdp_max_pool_double_buffer", "megatron_fsdp_max_pool_lanes",
               "fsdp_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail", "data_parallel_sharding_strategy")
KEYWORDS = Names("maxpool_double_buffer", "maxpool_lanes", "fsdp_double_buffer",
                 "fsdp_db_use_persist_buf_on_alloc_fail", "zero_dp_strategy")
LANES_EVERYWHERE = f"{FIELDS.lanes} ({FLAGS.lanes}, fully_shard: {KEYWORDS.lanes})"  # allocator messages


def double_buffering(double_buffer: bool, max_pool: bool, nccl_ub: bool) -> bool:
    """Whether FSDP double-buffers: asked for, or implied by the max-pool or NCCL user buffers
    (registered buffers must be persistent). The one place of these implications."""
    return bool(double_buffer or max_pool or nccl_ub)


@dataclass(frozen=True)
class DoubleBufferPolicy:
    """How Megatron-FSDP double-buffers ([Note: double buffer], policy); build with a route."""

    double_buffer: bool = False
    max_pool: bool = False  # MaxPool (or LaneMaxPool) instead of FixedPool
    lanes: int = SHARED_LANES  # > SHARED_LANES only with the max-pool: round-robin lanes
    persistent_fallback: bool = False  # buckets the pool does not hold get a persistent buffer
    nccl_ub: bool = False  # the pool is registered as NCCL user buffers
    symmetric_registration: bool = True  # symmetric (window) registration under nccl_ub
    manual_registration: bool = False  # registration deferred to manual_buffer_registration
    pool_scope: str = ""  # names this model's pools apart from another model's (model_pools.py)

    def __post_init__(self) -> None:
        if not isinstance(self.pool_scope, str) or not SCOPE.fullmatch(self.pool_scope):
            raise ValueError(f"pool_scope must be letters, digits and _ (or empty), got {self.pool_scope!r}: it "
                             "prefixes the names of the model's double-buffer arenas.")

    def scoped(self, name: str) -> str:  # an allocator's name within this model's scope
        return f"{self.pool_scope}.{name}" if self.pool_scope else name

    @property
    def round_robin(self) -> bool:  # three or more lanes: LaneMaxPool ([Note: double buffer], lanes and homes)
        return self.max_pool and self.lanes > SHARED_LANES

    @property
    def live_units(self) -> int:  # FSDP units that may hold pool memory at once ([Note: double buffer], live units)
        return self.lanes if self.round_robin else buffer_groups()

    @property
    def stage_symmetric(self) -> bool:  # max-pool arenas staged in the NCCL pool at init (symmetric.py)
        return self.nccl_ub and self.max_pool

    def pick(self, fixed: T, max_pool: T, lanes: T) -> T:  # among ParamAndGradBuffer's allocators
        if not self.double_buffer:
            raise ValueError(f"{self} has no double-buffer allocator to pick")
        return (lanes if self.round_robin else max_pool) if self.max_pool else fixed


def build_policy(n: Names, *, double_buffer: Any, max_pool: Any, lanes: Any, persistent_fallback: Any,
                 nccl_ub: Any, disable_symmetric: Any, manual_registration: Any, strategy: Any,
                 pool_scope: Any = "") -> DoubleBufferPolicy:
    """Check the settings (ValueError in ``n``'s spelling, with the offending value) and build."""
    if max_pool and strategy != UNIT_STRATEGY:
        raise ValueError(f"{n.max_pool} requires {n.strategy} {UNIT_STRATEGY} (the only strategy with FSDP "
                         f"units), got {strategy!r}.")
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < SHARED_LANES:
        raise ValueError(f"{n.lanes} must be an integer >= {SHARED_LANES}, got {lanes!r}: a double buffer needs "
                         f"a lane for the unit in use and one for the next; use {SHARED_LANES} (the default, the "
                         f"shared pool) or 3 or more with {n.max_pool}.")
    if lanes > SHARED_LANES and not max_pool:
        raise ValueError(f"{n.lanes} {lanes} needs {n.max_pool}: lanes are arenas of the max-pool double buffer; "
                         f"add {n.max_pool}, or leave {n.lanes} at {SHARED_LANES}.")
    on = double_buffering(double_buffer, max_pool, nccl_ub)
    if persistent_fallback and not on:
        raise ValueError(f"{n.persistent_fallback} requires {n.double_buffer} or {n.max_pool}.")
    return DoubleBufferPolicy(double_buffer=on, max_pool=bool(max_pool), lanes=lanes,
                              persistent_fallback=bool(persistent_fallback), nccl_ub=bool(nccl_ub),
                              symmetric_registration=not disable_symmetric,
                              manual_registration=bool(manual_registration), pool_scope=pool_scope)


def policy_from_config(config: Any) -> DoubleBufferPolicy:
    """The policy of a DDP config's fields (either config), in the fields' spelling."""
    return _from(config, FIELDS, nccl_ub=config.nccl_ub)


def _from(source: Any, n: Names, nccl_ub: Any) -> DoubleBufferPolicy:
    return build_policy(  # the config fields; Megatron's args have the same names
        n, double_buffer=source.fsdp_double_buffer, max_pool=source.megatron_fsdp_max_pool_double_buffer,
        lanes=source.megatron_fsdp_max_pool_lanes, persistent_fallback=source.fsdp_db_use_persist_buf_on_alloc_fail,
        nccl_ub=nccl_ub, disable_symmetric=source.disable_symmetric_registration,
        manual_registration=source.fsdp_manual_registration, strategy=source.data_parallel_sharding_strategy,
        pool_scope=getattr(source, POOL_SCOPE, ""))  # set on a config by model_pools.with_pool_scope


def policy_from_keywords(*, zero_dp_strategy: Any = "no_shard", fsdp_double_buffer: Any = False,
                         maxpool_double_buffer: Any = False, maxpool_lanes: Any = SHARED_LANES,
                         fsdp_db_use_persist_buf_on_alloc_fail: Any = False, nccl_ub: Any = False,
                         disable_symmetric_registration: Any = False) -> DoubleBufferPolicy:
    """``fully_shard_model``'s keywords, checked in their own names before it builds its config."""
    return build_policy(KEYWORDS, double_buffer=fsdp_double_buffer, max_pool=maxpool_double_buffer,
                        lanes=maxpool_lanes, persistent_fallback=fsdp_db_use_persist_buf_on_alloc_fail,
                        nccl_ub=nccl_ub, disable_symmetric=disable_symmetric_registration,
                        manual_registration=False, strategy=zero_dp_strategy)


def policy_from_args(args: Any) -> DoubleBufferPolicy:
    """Megatron's command line: its own rules (Megatron-FSDP, expert-parallel overlap), then the
    config's rules in the flags' spelling. NCCL user buffers count only with Megatron-FSDP."""
    fsdp, ep, max_pool = "--use-megatron-fsdp", "--overlap-moe-expert-parallel-comm", FLAGS.max_pool
    if args.nccl_ub and args.use_megatron_fsdp and args.overlap_moe_expert_parallel_comm:
        raise ValueError(f"--use-nccl-ub with {fsdp} needs FSDP double buffering, which {ep} forbids; drop one "
                         "of the two flags.")
    if args.megatron_fsdp_max_pool_double_buffer and args.overlap_moe_expert_parallel_comm:
        raise ValueError(f"{max_pool} is incompatible with {ep} (expert-parallel overlap forbids FSDP double "
                         "buffering).")
    if args.megatron_fsdp_max_pool_double_buffer and not args.use_megatron_fsdp:
        raise ValueError(f"{max_pool} requires {fsdp}.")
    return _from(args, FLAGS, nccl_ub=args.nccl_ub and args.use_megatron_fsdp)
