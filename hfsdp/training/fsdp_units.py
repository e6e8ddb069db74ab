"""Explicit Megatron-FSDP unit list, chosen by the environment (``HFSDP_FSDP_UNIT_MODULES``).

Why: the fork changes the default FSDP units for ``optim_grads_params`` from 0.18.2's
``[TransformerLayer]`` to ``[TransformerLayer, MoETransformerLayer, MambaLayer]`` ([Note: default
FSDP units] in ``megatron/core/distributed/fsdp/fsdp_units.py``, which holds the one list). To test
that a checkpoint written with the old layout loads into the new one, we need to *produce* the old
layout with the fork's code: :func:`install_unit_override` gives that module a rule for the
process, which the Megatron-FSDP adapter asks when its caller names no units (Megatron's training
loop never does).

Values of ``HFSDP_FSDP_UNIT_MODULES``:
  * unset or empty: no override (the tree's own default);
  * ``megatron-0.18.2``: 0.18.2's rule: ``[TransformerLayer]`` for ``optim_grads_params``,
    ``[]`` for every other sharding strategy;
  * ``none``: ``[]`` (no units);
  * a comma-separated list of dotted class paths, e.g.
    ``megatron.core.transformer.transformer_layer.TransformerLayer,megatron.core.ssm.mamba_layer.MambaLayer``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

ENV = "HFSDP_FSDP_UNIT_MODULES"
PRESET_0182 = "megatron-0.18.2"
_TRANSFORMER_LAYER = "megatron.core.transformer.transformer_layer.TransformerLayer"


def _tree_units() -> Any:
    """The built tree's unit module (megatron/core/distributed/fsdp/fsdp_units.py)."""
    return importlib.import_module("megatron.core.distributed.fsdp.fsdp_units")


def default_unit_paths() -> tuple[str, ...]:
    """The fork's default unit classes for optim_grads_params, as dotted paths (the tree's list)."""
    return tuple(_tree_units().DEFAULT_UNIT_MODULES)


def import_unit_class(path: str) -> type:
    """Import ``pkg.module.Class``; a bare name resolves against the default unit classes."""
    if "." not in path:
        matches = [p for p in default_unit_paths() if p.rsplit(".", 1)[1] == path]
        if not matches:
            raise ValueError(f"{ENV}: unknown unit class {path!r}; give a dotted class path")
        path = matches[0]
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{ENV}: {path!r} does not name a class")
    return cls


def unit_resolver(value: str | None) -> Callable[[str], list[type]] | None:
    """Turn a unit-list spec into ``sharding_strategy -> unit classes``; None means no override.

    Specs: ``megatron-0.18.2`` (0.18.2's rule), ``none``, or comma-separated class names.
    """
    if value is None or not value.strip():
        return None
    value = value.strip()
    if value == PRESET_0182:
        return lambda strategy: (
            [import_unit_class(_TRANSFORMER_LAYER)] if strategy == "optim_grads_params" else []
        )
    if value == "none":
        return lambda strategy: []
    classes = [import_unit_class(p.strip()) for p in value.split(",") if p.strip()]
    return lambda strategy: list(classes)


def install_unit_override(value: str | None = None) -> list[str] | None:
    """Install the override named by ``value`` (default: ``$HFSDP_FSDP_UNIT_MODULES``) as the
    tree's unit rule for this process (``set_unit_modules_override``).

    Returns a description of what was installed (for logging), or None when nothing was. A later
    call replaces the rule of an earlier one.
    """
    if value is None:
        value = os.environ.get(ENV)
    found = unit_resolver(value)
    if found is None or value is None:
        return None
    _tree_units().set_unit_modules_override(found)
    return [value]


def describe_units(value: str, strategy: str) -> list[str]:
    """Class names the override yields for ``strategy`` (for logs and tests)."""
    resolve = unit_resolver(value)
    return [] if resolve is None else [c.__name__ for c in resolve(strategy)]


def training_lanes(args: Any) -> int | None:
    """The lane count training's max-pool allocators hold for validated ``args``, when above the
    shared pool's (None: the shared pool, or no max-pool double buffer): read off the double-buffer
    policy of the flags ([Note: double buffer], policy), for the planner and the several-ranks-per-GPU
    memory check. Whether a model chunk has that many FSDP units is for the allocator that counts
    them (LaneMaxPool) to say."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import policy_from_args

    policy = policy_from_args(args)
    return policy.lanes if policy.round_robin else None
