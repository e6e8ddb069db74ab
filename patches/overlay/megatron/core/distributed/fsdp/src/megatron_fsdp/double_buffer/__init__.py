# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Megatron-FSDP's double buffer: the policy, the pool plan, the allocators and their staging.

[Note: double buffer]
Double buffering keeps the all-gathered weights and the unreduced grads of a bounded number of
FSDP units in a pool whose addresses never change, so NCCL user-buffer registration and CUDA
graphs can hold them. Code, patches and errors point at a section of this note by name, e.g.
"[Note: double buffer], failure modes: size drift".

Layers. Each module imports only the ones listed above it; Megatron-FSDP's modules import this
package, never the other way round (but for ``megatron_fsdp.utils``), and this ``__init__``
imports only policy and plan, so the DDP configs can import the policy without torch-side code.
- policy.py: ``DoubleBufferPolicy``, the settings checked and frozen; stdlib only.
- plan.py: the buffer dtype rules, the arena layout and the lane plans; stdlib only, shared with
  the offline planner. dtypes.py: its dtype names as torch dtypes.
- allocator.py (MaxPool, 2 shared groups) and lanes.py (LaneMaxPool, N >= 3 round-robin lanes):
  arenas at planned sizes, bucket views at planned offsets, homes.
- symmetric.py: under ``nccl_ub``, every arena created at init inside the NCCL pool.

Policy. Each entry route (flags, either DDP config, ``fully_shard``'s keywords) builds one frozen
``DoubleBufferPolicy``, once, and hands it down; nothing downstream reads the settings again, so
a config field changed after the policy was built is not seen. The rules run only in
``policy.build_policy`` and name the offending value in the route's spelling; "the max-pool or
NCCL user buffers imply double buffering" is one function, ``double_buffering``. The max-pool
setting reaches the allocator through these files, which read the raw setting or its policy:
- training/fork_args.py declares the flags (on 0.19.2 only the lanes flag: 0.19.2's
  arguments.py declares the max-pool flag and sets ``fsdp_double_buffer`` from it itself);
- training/double_buffer_args.py (0.18.2: validate_args calls it) builds the command line's
  policy and sets ``args.fsdp_double_buffer`` from it; training/te_arg_checks.py (both bases)
  and hfsdp/training/fsdp_units.py (``training_lanes``, for the planner) read that policy too;
- both distributed_data_parallel_config.py declare the fields; on 0.18.2 ``__post_init__``
  builds the config's policy and keeps it as ``double_buffer_policy`` (on 0.19.2 upstream's
  ``__post_init__`` only sets ``fsdp_double_buffer``);
- fully_shard.py passes its keywords to its config (on 0.18.2 after checking them, in their
  own names, with ``policy_from_keywords``);
- param_and_grad_buffer.py: ParamAndGradBuffer keeps the policy once as ``double_buffer_policy``
  (the config's on 0.18.2, built from the config on 0.19.2): ``pick`` chooses the allocator,
  ``live_units`` its group count, ``persistent_fallback`` its fallback; symmetric.py stages the
  pool when ``stage_symmetric``; the grad claim (and on 0.18.2 the prefetch gate) reads
  ``double_buffer``.

Plan. Per dtype there is one arena per buffer group. A live unit owns one group; its buckets of
that dtype sit contiguously in the group's arena at fixed aligned offsets, in bucket-id order,
and an arena holds the largest unit layout that may live in it. Plans are pure functions of the
padded bucket sizes and dtypes, deterministic and independent of insertion order, so every rank
plans (and registers) the same pool. Non-unit buckets are never pooled.

Live units. At most ``live_units`` units hold pool memory at once: ``plan.NUM_BUFFER_GROUPS``
(2) groups, or N lanes. ParamAndGradBuffer.live_unit_limit holds that number, and every
live-unit check reads it: the all-gather request check, the prefetch loop and the grad
double-buffer drain. Gathers of non-unit modules do not prefetch.

Lanes and homes. A lane is one buffer group. With 2 lanes (the default) every unit may use every
lane, each sized by the largest unit, and a unit's home is the group of its first strict
allocation (scratch fetches, at init and for re-quantization, pass
``strict_assignments=False``). With N >= 3 lanes the unit at position i (unit-id order) lives in
lane i % N, its home fixed by the plan before the first allocation, and each lane is sized by
its own largest unit. Units run in order (forward 0..n-1, backward n-1..0) and at most N are
live, so the live units are consecutive and each finds its home idle. ``plan_lanes`` with every
unit allowed in every lane is ``plan_max_pool`` byte for byte, and the offline planner prints
``runtime_lane_plan``, the plan the allocators hold. A home miss (the home busy) is counted
(``stats()["home_misses"]``) and logged, and the unit takes the first idle group (with lanes:
the first idle lane large enough, else RuntimeError naming the owners); with
``fail_on_home_miss``, set after CUDA-graph capture or manual UB registration, a miss raises,
since a replayed graph would use another unit's addresses.

Failure modes. Each invariant is named after the failure it rules out:
- silent fallback: every unit's buckets come from the pool, never from dynamic or persistent
  memory (FixedPool pools only the most common unit shape; the planner lists what it leaves
  out).
- dropped bucket: non-unit buckets use the StorageResize backup, which keeps a Bucket across
  free and re-grows the same storage, so a view autograd saved never points at dropped storage.
- persistent blow-up: units never get persistent buffers; non-unit buckets do only with
  ``fsdp_db_use_persist_buf_on_alloc_fail``.
- unstable addresses: each arena is created once, at its planned size, under the buffer's
  ``mem_alloc_context``; under ``nccl_ub`` all of them at init, after a plan-hash check and a
  rendezvous of the ranks (symmetric.py).
- too many live units: a unit beyond the live-unit limit raises in ``_acquire_group``, naming
  the owners. Blockwise-FP8 re-quantization after the optimizer step fetches one unit's
  weight bucket at a time (``copy_main_weights_to_model_weights``).
- wgrad race: the main_grad getter, which TE's fused wgrad accumulation calls directly, claims
  the grad bucket under the limit, and the compute stream waits on every drained reduce-scatter,
  so a wgrad never overwrites a pending reduce-scatter input.
- home drift: a unit keeps its home (per bucket in FixedPool) through forward, backward and
  recompute; a miss is handled as under lanes and homes.
- size drift: plans use the padded size (``bucket_index.size``); a request of another dtype or
  larger than planned raises, ``_arena`` raises if an arena ever changes, and ``presize`` refuses
  to grow an arena of the same name that another model chunk created smaller.
- grad dtype: grad pools are planned in the dtype grads are requested in (``grad_comm_dtype``,
  else the main-grad dtype, ``ParameterGroup.grad_dtype``), by plan.py's rules.
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
