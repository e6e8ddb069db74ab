# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Megatron's command-line checks of the double-buffer flags (``validate_args`` calls these).

The rules are megatron_fsdp's (double_buffer_rules.py, [Note: one rule, every spelling]); this
module only names the settings as the command line spells them and adds the two rules that
involve flags the DDP configs do not have (Megatron-Core's expert-parallel overlap) or a
default the command line sets (NCCL user buffers imply double buffering). The flags
themselves are declared in arguments.py; their names here follow argparse's rule, dest with
'-' for '_'.
"""

from typing import Any

from megatron.core.distributed.fsdp.src.megatron_fsdp import double_buffer_rules as rules


def flag(dest: str) -> str:
    """The command-line spelling of argparse destination ``dest``."""
    return "--" + dest.replace("_", "-")


CLI_NAMES = rules.Names(
    max_pool=flag("megatron_fsdp_max_pool_double_buffer"),
    lanes=flag("megatron_fsdp_max_pool_lanes"),
    double_buffer=flag("fsdp_double_buffer"),
    persistent_fallback=flag("fsdp_db_use_persist_buf_on_alloc_fail"),
    sharding_strategy=flag("data_parallel_sharding_strategy"),
    megatron_fsdp=flag("use_megatron_fsdp"),
)
EP_OVERLAP = flag("overlap_moe_expert_parallel_comm")  # expert-parallel overlap forbids double buffers


def imply_double_buffer_for_nccl_ub(args: Any, warn: Any) -> None:
    """``--use-nccl-ub`` with Megatron-FSDP implies ``--fsdp-double-buffer``, as in Megatron-Core
    0.19: ParamAndGradBuffer turns double buffering on at runtime anyway (registered user
    buffers must be persistent); doing it here lets the checks and the FSDP wrapper see what
    will run. ``warn`` prints once (validate_args' warn_rank_0)."""
    if args.overlap_moe_expert_parallel_comm:
        raise ValueError(
            f"--use-nccl-ub with {CLI_NAMES.megatron_fsdp} needs FSDP double buffering, which "
            f"{EP_OVERLAP} forbids; drop one of the two flags."
        )
    if not args.fsdp_double_buffer:
        warn(f"--use-nccl-ub with {CLI_NAMES.megatron_fsdp} enables {CLI_NAMES.double_buffer}.")
    args.fsdp_double_buffer = True


def validate_double_buffer_args(args: Any) -> None:
    """Raise ValueError for the first double-buffer rule ``args`` break; apply what max-pool
    implies. Runs after the ``--use-nccl-ub`` implication."""
    max_pool = args.megatron_fsdp_max_pool_double_buffer
    if max_pool and args.overlap_moe_expert_parallel_comm:
        raise ValueError(
            f"{CLI_NAMES.max_pool} is incompatible with {EP_OVERLAP} (expert-parallel overlap "
            "forbids FSDP double buffering)."
        )
    for problem in (
        rules.max_pool_fsdp_problem(max_pool, args.use_megatron_fsdp, CLI_NAMES),
        rules.max_pool_strategy_problem(max_pool, args.data_parallel_sharding_strategy, CLI_NAMES),
        rules.lanes_problem(args.megatron_fsdp_max_pool_lanes, max_pool, CLI_NAMES),
        rules.persistent_fallback_problem(
            args.fsdp_db_use_persist_buf_on_alloc_fail, args.fsdp_double_buffer or args.nccl_ub or max_pool,
            CLI_NAMES,
        ),
    ):
        if problem is not None:
            raise ValueError(problem)
    args.fsdp_double_buffer = rules.implied_double_buffer(args.fsdp_double_buffer, max_pool)
