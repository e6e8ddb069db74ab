"""Explicit Megatron-FSDP unit list, chosen by the environment (``HFSDP_FSDP_UNIT_MODULES``).

Why: the fork changes the default FSDP units for ``optim_grads_params`` from 0.18.2's
``[TransformerLayer]`` to ``[TransformerLayer, MoETransformerLayer, MambaLayer]``. To test that
a checkpoint written with the old layout loads into the new one, we need to *produce* the old
layout with the fork's code. ``megatron.training`` builds the FSDP wrapper as
``megatron_FSDP(config=..., ddp_config=..., module=..., ...)`` and never passes
``fsdp_unit_modules``, and ``DistributedDataParallelConfig`` has no such field, so the override
swaps the module-global ``megatron.training.training.megatron_FSDP`` for a subclass that passes an
explicit list. ``isinstance`` checks against the adapter class keep working.

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
# The fork's default units for optim_grads_params (the mfsdp-default-hybrid-units patch).
DEFAULT_UNIT_CLASSES = (
    _TRANSFORMER_LAYER,
    "megatron.core.transformer.transformer_layer.MoETransformerLayer",
    "megatron.core.ssm.mamba_layer.MambaLayer",
)


def import_unit_class(path: str) -> type:
    """Import ``pkg.module.Class``; a bare name resolves against DEFAULT_UNIT_CLASSES."""
    if "." not in path:
        matches = [p for p in DEFAULT_UNIT_CLASSES if p.rsplit(".", 1)[1] == path]
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
    """Install the override named by ``value`` (default: ``$HFSDP_FSDP_UNIT_MODULES``).

    Returns a description of what was installed (for logging), or None when nothing was.
    Idempotent: re-installing wraps the original adapter class, never a previous override.
    """
    if value is None:
        value = os.environ.get(ENV)
    found = unit_resolver(value)
    if found is None or value is None:
        return None
    resolve = found  # narrowed for the class body below
    training = importlib.import_module("megatron.training.training")

    base = getattr(training.megatron_FSDP, "_hfsdp_base", training.megatron_FSDP)

    class FSDPWithExplicitUnits(base):  # type: ignore[misc, valid-type]
        """Megatron-FSDP adapter with the unit list from ``HFSDP_FSDP_UNIT_MODULES``."""

        _hfsdp_base = base

        def __init__(self, *args: Any, fsdp_unit_modules: Any = None, **kwargs: Any) -> None:
            ddp_config = kwargs.get("ddp_config", args[1] if len(args) > 1 else None)
            assert ddp_config is not None, "megatron_FSDP called without ddp_config"
            units = resolve(ddp_config.data_parallel_sharding_strategy)
            super().__init__(*args, fsdp_unit_modules=units, **kwargs)

    FSDPWithExplicitUnits.__qualname__ = base.__qualname__
    setattr(training, "megatron_FSDP", FSDPWithExplicitUnits)  # noqa: B010 (module attribute swap)
    return [value]


def describe_units(value: str, strategy: str) -> list[str]:
    """Class names the override yields for ``strategy`` (for logs and tests)."""
    resolve = unit_resolver(value)
    return [] if resolve is None else [c.__name__ for c in resolve(strategy)]
