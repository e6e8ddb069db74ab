# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Megatron's command line and the double-buffer policy (``validate_args`` calls these).

The rules and their messages are megatron_fsdp's ([Note: double-buffer policy] in
double_buffer/policy.py): the command line is one route into the one builder, which names the
settings as flags. What stays here is what the command line does with the policy: the
implications 0.18.2 code reads off ``args`` (``fsdp_double_buffer``). The flags themselves are
declared in fork_args.py (the fork's argument group).
"""

from typing import Any

from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import (
    SPELLINGS,
    DoubleBufferPolicy,
    Route,
    build_double_buffer_policy,
)


def imply_double_buffer_for_nccl_ub(args: Any, warn: Any) -> None:
    """``--use-nccl-ub`` with Megatron-FSDP implies ``--fsdp-double-buffer``, as in Megatron-Core
    0.19: ParamAndGradBuffer turns double buffering on at runtime anyway (registered user
    buffers must be persistent); doing it here lets the checks and the FSDP wrapper see what
    will run. ``warn`` prints once (validate_args' warn_rank_0). Whether expert-parallel overlap
    allows it is the policy's rule (checked by :func:`validate_double_buffer_args`)."""
    if not args.fsdp_double_buffer and not args.overlap_moe_expert_parallel_comm:
        warn(f"--use-nccl-ub with {SPELLINGS['megatron_fsdp'].flag} enables {SPELLINGS['double_buffer'].flag}.")
    args.fsdp_double_buffer = True


def cli_policy(args: Any) -> DoubleBufferPolicy:
    """The double-buffer policy of validated ``args`` (cached: the rules ran in validate_args)."""
    return build_double_buffer_policy(Route.CLI, args)


def validate_double_buffer_args(args: Any) -> None:
    """Build the policy of ``args`` (ValueError, in the flags' names, for the first rule they
    break) and apply what max-pool implies. Runs after the ``--use-nccl-ub`` implication."""
    policy = cli_policy(args)
    args.fsdp_double_buffer = bool(args.fsdp_double_buffer or policy.max_pool)
