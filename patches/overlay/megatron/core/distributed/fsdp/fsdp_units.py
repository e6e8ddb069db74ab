# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Which module classes are Megatron-FSDP units when the caller names none.

[Note: default FSDP units]
For ``optim_grads_params`` every decoder layer of a hybrid stack is a unit: TransformerLayer,
MoETransformerLayer and MambaLayer (MambaLayer is no TransformerLayer: a list without it leaves
every Mamba layer gathered and never resharded). The other sharding strategies have no units.
:data:`DEFAULT_UNIT_MODULES` holds the classes as dotted paths: the one list the adapter
(``mcore_fsdp_adapter.FullyShardedDataParallel``) and any tool that predicts units read.

Invariants:
- the adapter asks :func:`unit_modules` only when its caller passed no ``fsdp_unit_modules``;
- :func:`set_unit_modules_override` replaces the rule for the whole process (an entry point may,
  e.g. to write a checkpoint with TransformerLayer as the only unit), and ``None`` restores the
  default;
- importing this module imports nothing: the classes are imported when first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

UNIT_STRATEGY = "optim_grads_params"  # the only sharding strategy with FSDP units by default
DEFAULT_UNIT_MODULES = (
    "megatron.core.transformer.transformer_layer.TransformerLayer",
    "megatron.core.transformer.transformer_layer.MoETransformerLayer",
    "megatron.core.ssm.mamba_layer.MambaLayer",
)

UnitRule = Callable[[str], list]  # sharding strategy -> unit module classes
_override: UnitRule | None = None


def default_unit_classes() -> tuple[type, ...]:
    """The classes of :data:`DEFAULT_UNIT_MODULES`, imported."""
    out = []
    for path in DEFAULT_UNIT_MODULES:
        module, _, name = path.rpartition(".")
        out.append(getattr(importlib.import_module(module), name))
    return tuple(out)


def unit_modules(strategy: str) -> list:
    """The unit classes for sharding strategy ``strategy``: the override's, else the default."""
    if _override is not None:
        return list(_override(strategy))
    return list(default_unit_classes()) if strategy == UNIT_STRATEGY else []


def set_unit_modules_override(rule: UnitRule | None) -> UnitRule | None:
    """Make ``rule`` decide the units of every adapter built afterwards (``None``: the default);
    returns the rule it replaced."""
    global _override
    previous, _override = _override, rule
    return previous
