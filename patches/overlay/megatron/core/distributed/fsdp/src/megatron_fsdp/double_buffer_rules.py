# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""The rules of the double-buffer settings: one function each, for every way to give them.

[Note: one rule, every spelling]
The max-pool double buffer, its lanes and the persistent fallback can be asked for on
Megatron's command line, in either ``DistributedDataParallelConfig`` (Megatron-Core's and
Megatron-FSDP's) and through ``fully_shard``. Each rule is one function below that says why
a combination cannot work (None when it can). The command line's checks
(megatron/training/double_buffer_args.py) and both configs' ``__post_init__``
(:func:`check_config`) call the same functions, each passing the :class:`Names` its user
wrote, so that a message names the setting as the user spelled it. With Megatron-Core
importable, ``fully_shard`` builds Megatron-Core's config, so both configs share one
:data:`CONFIG_NAMES` that gives the field and the ``fully_shard`` keyword. What the settings imply
(:func:`implied_double_buffer`) is one function too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .maxpool_plan import SHARED_LANES

UNIT_STRATEGY = "optim_grads_params"  # the only sharding strategy with FSDP units


@dataclass(frozen=True)
class Names:
    """How one kind of user spells each setting, for messages."""

    max_pool: str
    lanes: str
    double_buffer: str
    persistent_fallback: str
    sharding_strategy: str
    megatron_fsdp: str


CONFIG_NAMES = Names(  # both DistributedDataParallelConfigs; fully_shard builds one of them
    max_pool="megatron_fsdp_max_pool_double_buffer (fully_shard: maxpool_double_buffer)",
    lanes="megatron_fsdp_max_pool_lanes (fully_shard: maxpool_lanes)",
    double_buffer="fsdp_double_buffer (fully_shard: fsdp_double_buffer)",
    persistent_fallback="fsdp_db_use_persist_buf_on_alloc_fail (fully_shard: fsdp_db_use_persist_buf_on_alloc_fail)",
    sharding_strategy="data_parallel_sharding_strategy (fully_shard: zero_dp_strategy)",
    megatron_fsdp="use_megatron_fsdp",
)


def implied_double_buffer(double_buffer: bool, max_pool: bool) -> bool:
    """Max-pool is a double-buffer allocator: asking for it turns double buffering on."""
    return double_buffer or max_pool


def max_pool_fsdp_problem(max_pool: bool, use_megatron_fsdp: bool, names: Names) -> str | None:
    """Max-pool is a Megatron-FSDP allocator: without Megatron-FSDP nothing would read it."""
    if max_pool and not use_megatron_fsdp:
        return f"{names.max_pool} requires {names.megatron_fsdp}."
    return None


def max_pool_strategy_problem(max_pool: bool, strategy: str, names: Names) -> str | None:
    """Max-pool needs FSDP units, which only ``optim_grads_params`` has (else a silent no-op)."""
    if max_pool and strategy != UNIT_STRATEGY:
        return (
            f"{names.max_pool} requires {names.sharding_strategy} {UNIT_STRATEGY} (the only "
            f"strategy with FSDP units), got {strategy!r}."
        )
    return None


def lanes_problem(lanes: object, max_pool: bool, names: Names) -> str | None:
    """Why ``lanes`` cannot work (a sentence naming the fix), or None when it can."""
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < SHARED_LANES:
        return (
            f"{names.lanes} must be an integer >= {SHARED_LANES}, got {lanes!r}: a double buffer "
            f"needs a lane for the unit in use and one for the next; use {SHARED_LANES} (the "
            f"default, the shared pool) or 3 or more with {names.max_pool}."
        )
    if lanes > SHARED_LANES and not max_pool:
        return (
            f"{names.lanes} {lanes} needs {names.max_pool}: lanes are arenas of the max-pool "
            f"double buffer; add {names.max_pool}, or leave {names.lanes} at {SHARED_LANES}."
        )
    return None


def persistent_fallback_problem(persistent: bool, double_buffer: bool, names: Names) -> str | None:
    """The persistent fallback is for buckets a double buffer does not pool: it needs one."""
    if persistent and not double_buffer:
        return f"{names.persistent_fallback} requires {names.double_buffer} or {names.max_pool}."
    return None


def check_config(config: Any, names: Names = CONFIG_NAMES) -> None:
    """Both configs' ``__post_init__``: apply the implication, then raise ValueError for the
    first rule the config breaks, spelled with ``names``. Whether Megatron-FSDP is used is not
    the config's to say (``fully_shard`` builds Megatron-Core's config without
    ``use_megatron_fsdp``): the command line checks that rule."""
    config.fsdp_double_buffer = implied_double_buffer(
        config.fsdp_double_buffer, config.megatron_fsdp_max_pool_double_buffer
    )
    for problem in (
        max_pool_strategy_problem(
            config.megatron_fsdp_max_pool_double_buffer,
            config.data_parallel_sharding_strategy,
            names,
        ),
        lanes_problem(
            config.megatron_fsdp_max_pool_lanes,
            config.megatron_fsdp_max_pool_double_buffer,
            names,
        ),
        persistent_fallback_problem(
            config.fsdp_db_use_persist_buf_on_alloc_fail,
            config.fsdp_double_buffer or config.nccl_ub,
            names,
        ),
    ):
        if problem is not None:
            raise ValueError(problem)
