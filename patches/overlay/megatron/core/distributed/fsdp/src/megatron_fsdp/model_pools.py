# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""One model's double-buffer pools: its own, and freed without touching another model's.

[Note: one model's pools] A process may hold two Megatron-FSDP models (a trained policy and a
frozen reference, a student and its teacher). What each owns:

* **NCCL pool.** Every ParamAndGradBuffer built with NCCL user buffers creates its own
  ``torch.cuda.MemPool`` (``buffer.nccl_mem_pool``) and allocates, registers and deregisters
  only that one. Nothing module-global names a pool, so a second buffer cannot redirect the
  first one's registration. Communicators are shared on purpose: both models use the process's
  data-parallel groups; ``parallel_state`` owns and destroys them, after every pool is
  deregistered (training/teardown.py).
* **Arenas.** Double-buffer arenas live in the global memory buffer under their allocator's
  name. ``DoubleBufferPolicy.pool_scope`` prefixes those names (``"ref.fsdp_params"``), so models
  with different scopes never share an arena. Chunks of one model share a scope, and so their
  arenas, as before. Two models in the default scope ``""`` would share arenas by name, and their
  units would overwrite each other's gathered weights: :func:`check_scopes` refuses that.
* **Freeing.** :func:`release_model_pools` deregisters the model's NCCL pool from each of its
  groups (collective: every rank frees the model at the same step), drops its arenas from the
  global memory buffer and empties its allocators. The other model's arenas, pool and
  registrations are untouched, so its addresses, and a graph captured over them, stay valid.
  The model's own weights, main weights and gradients go when the caller drops the model.

Invariants: a scope is owned by one model at a time; a released model is not run again (its
allocators hold nothing and refuse to allocate); a model whose forward is inside a captured
full-iteration graph is not released while that graph lives (the replay would read freed memory).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .double_buffer.allocator import ALLOCATOR_ATTRS, MaxPool, model_buffers
from .double_buffer.policy import POOL_SCOPE, DoubleBufferPolicy, policy_from_config
from .utils import get_global_memory_buffer

try:
    from megatron.core import nccl_allocator
except ImportError:  # no Megatron Core: no NCCL pools to deregister
    nccl_allocator = None

# Live buffers by scope, to refuse two models in one scope. Weak: a buffer that is gone owns nothing.
_owners: dict[str, weakref.WeakSet] = {}


@dataclass(frozen=True)
class Released:
    """What :func:`release_model_pools` freed."""

    scope: str
    arenas: tuple[str, ...]  # global-memory-buffer names dropped
    arena_bytes: int
    deregistered: int  # (pool, group) registrations undone


def with_pool_scope(ddp_config: Any, scope: str) -> Any:
    """``ddp_config`` with its models' pools in ``scope`` (letters, digits, _; checked before the
    config changes), its double-buffer policy rebuilt. Build the second model's config with it
    before wrapping that model; ParamAndGradBuffer reads the scope from the policy (both bases)."""
    policy = dataclasses.replace(policy_from_config(ddp_config), pool_scope=scope)
    setattr(ddp_config, POOL_SCOPE, scope)
    ddp_config.double_buffer_policy = policy
    return ddp_config


def _scope(buffer: Any) -> str:
    policy: DoubleBufferPolicy | None = getattr(buffer, "double_buffer_policy", None)
    return policy.pool_scope if policy is not None else ""


def check_scopes(model: Any) -> str:
    """Claim ``model``'s pool scope; refuse (ValueError) a scope another live model holds."""
    buffers = model_buffers(model)
    scopes = {_scope(b) for b in buffers}
    if len(scopes) > 1:
        raise ValueError(f"one model's chunks must share one pool scope, got {sorted(scopes)}")
    for scope in scopes:
        owners = _owners.setdefault(scope, weakref.WeakSet())
        others = [b for b in owners if all(b is not mine for mine in buffers)]
        if others:
            raise ValueError(
                f"pool scope {scope!r} already belongs to another Megatron-FSDP model: the two would share "
                "double-buffer arenas by name and overwrite each other's gathered weights. Give the second "
                "model its own scope (model_pools.with_pool_scope(ddp_config, 'ref')) before wrapping it."
            )
        owners.update(buffers)
    return scopes.pop() if scopes else ""


def _deregister(buffer: Any, done: set[tuple[int, int]]) -> int:
    pool = getattr(buffer, "nccl_mem_pool", None)
    manual = buffer.ddp_config.fsdp_manual_registration
    if pool is None or nccl_allocator is None or (manual and not buffer.already_registered):
        return 0
    undone = 0
    for group in buffer.ubr_groups or []:
        if (id(pool), id(group)) not in done:
            done.add((id(pool), id(group)))
            nccl_allocator.deregister_mem_pool(pool, group)
            undone += 1
    return undone


def deregister_pools(buffers: Iterable[Any]) -> int:
    """Deregister each buffer's own NCCL pool from each of its groups, once per (pool, group);
    returns how many registrations were undone. Teardown and :func:`release_model_pools` use it."""
    done: set[tuple[int, int]] = set()
    return sum(_deregister(b, done) for b in buffers)


def release_model_pools(model: Any, *, graph_live: bool = False) -> Released:
    """Free ``model``'s double-buffer pools (see the note); ``graph_live``: a full-iteration graph
    that may replay this model's forward still exists (refused)."""
    buffers = model_buffers(model)
    if not buffers:
        raise ValueError("the model has no Megatron-FSDP buffer: nothing to release")
    if graph_live:
        raise ValueError("a full-iteration CUDA graph still lives and may replay this model's forward into the "
                         "memory being freed: release the graph first (teardown.release_cuda_graphs) or free "
                         "the model before capture")
    scope = check_scopes(model)
    deregistered = deregister_pools(buffers)
    gmb = get_global_memory_buffer()
    dropped: list[str] = []
    nbytes = 0
    for buffer in buffers:
        for attr in ALLOCATOR_ATTRS:
            alloc = getattr(buffer, attr, None)
            prefix = getattr(alloc, "name", None)
            if not prefix:
                continue
            for key in [k for k in gmb.buffer if isinstance(k[0], str) and k[0].startswith(prefix + "_")]:
                tensor = gmb.buffer.pop(key)
                dropped.append(key[0])
                nbytes += tensor.numel() * tensor.element_size()
            if isinstance(alloc, MaxPool):
                alloc.release()  # nothing left to hand out: a released model is not run again
        buffer.nccl_mem_pool = None
    _owners.pop(scope, None)
    return Released(scope, tuple(sorted(set(dropped))), nbytes, deregistered)
