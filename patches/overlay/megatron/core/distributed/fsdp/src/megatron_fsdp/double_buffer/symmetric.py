# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Symmetric-memory staging of the max-pool double buffer under ``nccl_ub``.

NCCL symmetric (window) registration is collective: every rank of a registration group
must register the same allocation sequence, and a symmetric collective may only run after
all peers registered. The max-pool arenas are otherwise created lazily (weights at init,
grads in the first backward), each creation re-registering the whole NCCL pool. Staging
makes this one deterministic step at ``ParamAndGradBuffer`` init:

1. hash the arena plans of all max-pool allocators and all-gather the hash on each UBR
   group; a mismatch raises naming both hashes (plans are deterministic, so a mismatch
   means the ranks built different models or buffers);
2. rendezvous: barrier on each UBR group, then on world;
3. create every (group, dtype) arena once at its planned size inside the buffer's NCCL
   mem-pool context, whose exit registers the pool (symmetrically unless
   ``disable_symmetric_registration``) on every UBR group. With
   ``fsdp_manual_registration`` the context only allocates; registration happens later in
   ``manual_buffer_registration``;
4. rendezvous again before anything can issue a collective on the registered pool (for
   manual registration, right after ``manual_buffer_registration``).

After staging no arena grows ([Note: double buffer], failure modes: unstable addresses,
size drift). Only allocators that will allocate are staged: hybrid FSDP's ``hsdp_grad_comm``
allocator serves only parameter groups whose gradients are cast to
``mp_policy.grad_comm_dtype`` for the DP-outer reduction, and without one it never
allocates (:func:`stages`). This module never touches ``NCCL_NVLS_ENABLE``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..utils import log_single_rank
from .allocator import MaxPool, buffer_max_pool_allocators
from .plan import LanePlan, MaxPoolPlan
from .policy import DoubleBufferPolicy

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class StagingRecord:
    """What staging did for one ParamAndGradBuffer (the buffer keeps it: tests, logs, and the
    rendezvous after manual registration)."""

    fingerprint: str
    arenas: tuple[tuple[str, int, str, int], ...]  # (allocator, group, dtype, numel), in order
    arena_bytes: int
    symmetric: bool
    manual_registration: bool
    group_descs: tuple[str, ...]


def _canonical_plan(plan: MaxPoolPlan | LanePlan | None) -> Any:
    if plan is None:
        return None
    return (
        sorted(plan.arena_numel.items()),
        sorted(plan.offsets.items()),
        sorted(plan.itemsize.items()),
        plan.align_bytes,
        tuple(plan.unit_ids),
    )


def plan_fingerprint(allocators: Sequence[MaxPool]) -> str:
    """16-hex-digit hash of every allocator's plan and arena creation order."""
    canonical = [(a.name, _canonical_plan(a.plan), a.arena_order()) for a in allocators]
    return hashlib.sha256(repr(canonical).encode()).hexdigest()[:16]


def _to_int64(fingerprint: str) -> int:
    value = int(fingerprint, 16)
    return value - (1 << 64) if value >= (1 << 63) else value


def _to_hex(value: int) -> str:
    return f"{value & ((1 << 64) - 1):016x}"


def _group_desc(group: Any) -> str:
    return getattr(group, "group_desc", None) or repr(group)


def _collective_device(group: Any) -> torch.device:
    # NCCL collectives need a CUDA tensor; gloo (CPU tests) needs a CPU one.
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_plans_agree(fingerprint: str, groups: Sequence[Any], context: str = "") -> None:
    """All-gather ``fingerprint`` on each group; raise RuntimeError naming both on mismatch."""
    for group in groups:
        mine = torch.tensor([_to_int64(fingerprint)], dtype=torch.int64)
        mine = mine.to(_collective_device(group))
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        values = [_to_hex(int(t.item())) for t in gathered]
        other = next((i for i, v in enumerate(values) if v != fingerprint), None)
        if other is None:
            continue
        ranks = dist.get_process_group_ranks(group)
        raise RuntimeError(
            f"max-pool plan mismatch on UBR group {_group_desc(group)} (global ranks {ranks}): "
            f"global rank {dist.get_rank()} has plan hash {fingerprint}, global rank "
            f"{ranks[other]} has {values[other]} (all: {values}). NCCL symmetric registration "
            "needs identical arena plans and allocation order on every rank of a group; "
            f"compare the '[fsdp_*] max-pool plan' log lines of both ranks. {context}".rstrip()
        )


def rendezvous(groups: Sequence[Any], where: str) -> None:
    """Barrier on each UBR group (in order), then synchronize the device.

    Only the UBR groups: they are the ranks that register and use the pool together. A world
    barrier here would hang when ranks stage different numbers of buffers (PP > 1, chunks
    without max-pool allocators).
    """
    for group in groups:
        dist.barrier(group=group)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    log_single_rank(logger, logging.INFO, f"[maxpool-symm] rendezvous {where}")


def stages(buffer: Any, alloc: MaxPool) -> bool:
    """Whether staging pre-sizes ``alloc``: every max-pool allocator of ``buffer`` but an
    ``hsdp_grad_comm`` one that no parameter group uses. A group uses it when its main grads'
    dtype differs from ``mp_policy.grad_comm_dtype`` (the gradient is then cast into that
    allocator's bucket before the DP-outer reduction; the same test the reduction makes)."""
    if alloc is not getattr(buffer, "hsdp_grad_comm_alloc", None):
        return True
    comm_dtype = getattr(getattr(buffer, "mp_policy", None), "grad_comm_dtype", None)
    if comm_dtype is None:
        return False
    return any(
        getattr(group, "hsdp_comm_gbuf", None) is not None
        and getattr(group, "main_grad_buffer", None) is not None
        and group.main_grad_buffer.dtype != comm_dtype
        for group in buffer.parameter_groups
    )


def stage_symmetric_max_pool(buffer: Any, policy: DoubleBufferPolicy) -> StagingRecord | None:
    """Thin-hook target: stage a ParamAndGradBuffer's max-pool arenas in the NCCL pool.

    No-op (returns None) unless the buffer's double-buffer ``policy`` stages the pool (NCCL user
    buffers with the max-pool, ``DoubleBufferPolicy.stage_symmetric``) and the buffer has
    max-pool allocators. Must run after the DP buffers exist (padded sizes) and before the
    first bucket fetch. The buffer keeps the returned record for :func:`after_manual_registration`.
    """
    if not policy.stage_symmetric:
        return None
    allocators = [a for a in buffer_max_pool_allocators(buffer) if stages(buffer, a)]
    if not allocators:
        return None
    groups = list(buffer.ubr_groups or [])
    symmetric = policy.symmetric_registration
    manual = policy.manual_registration

    fingerprint = plan_fingerprint(allocators)
    check_plans_agree(fingerprint, groups)
    rendezvous(groups, "before registering the max-pool arenas")
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # (de)registration under the context must not race kernels
    arenas: list[tuple[str, int, str, int]] = []
    # One context entry: the arenas are allocated in the NCCL pool and, on exit, the pool is
    # registered once on every UBR group (auto mode) instead of once per lazy arena creation.
    with buffer.mem_alloc_context():
        for alloc in allocators:
            arenas.extend((alloc.name, g, d, n) for g, d, n in alloc.presize(buffer.device))
    if not manual:
        rendezvous(groups, "after registration, before the first symmetric collective")

    arena_bytes = sum(
        t.numel() * t.element_size() for a in allocators for t in a.arenas.values()
    )
    record = StagingRecord(
        fingerprint=fingerprint,
        arenas=tuple(arenas),
        arena_bytes=arena_bytes,
        symmetric=symmetric,
        manual_registration=manual,
        group_descs=tuple(_group_desc(g) for g in groups),
    )
    log_single_rank(
        logger,
        logging.INFO,
        f"[maxpool-symm] staged {len(arenas)} max-pool arenas ({arena_bytes / 2**20:.2f} MiB, "
        f"plan hash {fingerprint}) in the NCCL pool; "
        f"{'symmetric' if symmetric else 'non-symmetric'} registration on "
        f"{list(record.group_descs)} "
        f"{'deferred to manual_buffer_registration' if manual else 'done'}",
    )
    return record


def after_manual_registration(buffer: Any, record: StagingRecord | None) -> None:
    """Thin-hook target: rendezvous after ``manual_buffer_registration`` of a buffer that
    staged its arenas (``record``: what :func:`stage_symmetric_max_pool` returned)."""
    if record is not None and record.manual_registration:
        rendezvous(list(buffer.ubr_groups or []), "after manual registration")
