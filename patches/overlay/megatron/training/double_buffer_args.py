# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Megatron's command line and the double-buffer policy (``validate_args`` calls this).

The command line is one route into the policy ([Note: double buffer] in double_buffer/__init__.py,
policy): the rules and their messages in the flags' spelling are the policy's.
What stays here is what validate_args does with it: upstream code reads ``args.fsdp_double_buffer``,
so it gets the policy's answer. The flags are declared in fork_args.py (the fork's group).
On 0.19.2 nothing calls this: that release declares the max-pool flag and its validate_args sets
``args.fsdp_double_buffer`` from it; the 0.19.2 variant of mfsdp-max-pool-lanes-flags builds the
command line's policy at the same place in validate_args.
"""

from typing import Any

from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import (
    FLAGS,
    DoubleBufferPolicy,
    policy_from_args,
)


def validate_double_buffer_args(args: Any, warn: Any) -> DoubleBufferPolicy:
    """Build the policy of ``args`` (ValueError, in the flags' names, for the first rule they
    break) and set ``args.fsdp_double_buffer`` to its answer; ``warn`` (validate_args'
    warn_rank_0) says when ``--use-nccl-ub`` turned double buffering on."""
    policy = policy_from_args(args)
    if policy.nccl_ub and not args.fsdp_double_buffer:
        warn(f"--use-nccl-ub with --use-megatron-fsdp enables {FLAGS.double_buffer}.")
    args.fsdp_double_buffer = policy.double_buffer
    return policy
