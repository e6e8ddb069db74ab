# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Megatron-FSDP's double buffer: the policy, the pool plan, the allocators and their staging.

[Note: double buffer]
Double buffering keeps the all-gathered weights and the unreduced grads of a bounded number of
FSDP units in a pool whose addresses never change, so NCCL user-buffer registration and CUDA
graphs can hold them. The package is layered; each layer imports only the ones above it:
- policy.py: each entry route (flags, either DDP config, ``fully_shard``'s keywords) builds one
  frozen ``DoubleBufferPolicy`` and hands it down ([Note: double-buffer policy]).
- plan.py: stdlib only, shared with the offline planner. The buffer dtype rules, the arena layout
  (per dtype one arena per buffer group, a unit's buckets contiguous at fixed aligned offsets) and
  the lane plans ([Note: live units], [Note: max-pool lanes]).
- dtypes.py: plan.py's dtype names as torch dtypes, for ParamAndGradBuffer, the allocators and the
  planner alike.
- allocator.py (MaxPool, 2 shared groups) and lanes.py (LaneMaxPool, N >= 3 round-robin lanes):
  arenas created once at their planned size, bucket views at planned offsets, stable homes
  ([Note: max-pool failure modes], [Note: max-pool lane homes]).
- symmetric.py: with ``nccl_ub``, every arena is created at init inside the NCCL pool after a
  plan-hash check and a rendezvous.
Invariants:
- at most ``live_units`` units hold pool memory at once (2 groups, or N lanes); every live-unit
  check reads that one number, ParamAndGradBuffer.live_unit_limit;
- plans are pure functions of the padded bucket sizes and dtypes, deterministic and independent
  of insertion order, so every rank plans (and registers) the same pool;
- an arena never grows or moves after creation; a request the plan did not foresee raises;
- non-unit buckets are never pooled.
Megatron-FSDP's modules import this package, never the other way round (but for
``megatron_fsdp.utils``); this ``__init__`` imports only the stdlib-only policy and plan, so the
DDP configs can import the policy without loading torch-side code.
"""

from .plan import NUM_BUFFER_GROUPS, SHARED_LANES, buffer_groups
from .policy import DoubleBufferPolicy, double_buffering, policy_from_args, policy_from_config, policy_from_keywords

__all__ = [
    "NUM_BUFFER_GROUPS",
    "SHARED_LANES",
    "DoubleBufferPolicy",
    "buffer_groups",
    "double_buffering",
    "policy_from_args",
    "policy_from_config",
    "policy_from_keywords",
]
