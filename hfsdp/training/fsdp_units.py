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


# [Note: FSDP units from the flags]
# How many FSDP units each model chunk has follows from the flags, without building the model:
# with the fork's default unit classes every decoder layer is one unit (GPT layers are
# TransformerLayers or MoETransformerLayers; hybrid layers are those or MambaLayers, and MLPLayer
# is a TransformerLayer); with 0.18.2's list (``megatron-0.18.2``) the Mamba layers are not; with
# ``none``, or for a sharding strategy that has no units, there are none (and no double-buffer
# pools to check). A chunk is a pipeline stage, or a virtual stage of one: its layers are those
# Megatron builds there (``get_num_layers_to_build`` for GPT; the pattern's ``|`` segments, or an
# even or first/last split of a pattern without them, as ``select_pipeline_segment`` does). The
# rule cannot tell (and says None) for an explicit list of classes, a pipeline layout given with
# ``--pipeline-model-parallel-layout``, heterogeneous layers or a ``--spec`` of the user's; the chunk
# that holds multi-token-prediction layers is left out (they hold units of their own). The memory
# planner builds the model and counts the units it finds; tests hold the two to the same numbers.

MAMBA = "M"  # megatron.core.models.hybrid.hybrid_layer_allocation.Symbols.MAMBA


def _unit_layers(value: str | None, strategy: str) -> str | None:
    """Which decoder layers are units: ``"all"``, ``"non-mamba"``, ``"none"``, or None (unknown)."""
    spec = (value or "").strip()
    if strategy != "optim_grads_params":
        return "none" if spec in ("", PRESET_0182, "none") else None
    return {"": "all", PRESET_0182: "non-mamba", "none": "none"}.get(spec)


def _chunk_label(pp_rank: int, pp: int, vp_stage: int | None, vp: int | None) -> str:
    label = f"pipeline stage {pp_rank + 1} of {pp}" if pp > 1 else ""
    if vp:
        label += f", virtual stage {vp_stage + 1 if vp_stage is not None else 1} of {vp}"
    return label.removeprefix(", ")


def _hybrid_chunks(args: Any) -> dict[str, list[str]]:
    """Layer symbols of each chunk of a hybrid model (as select_pipeline_segment splits them)."""
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

    parsed = parse_hybrid_pattern(args.hybrid_layer_pattern)
    main = parsed.main_pattern or ""
    pp = args.pipeline_model_parallel_size
    segments = main.split(Symbols.PIPE)
    if len(segments) > 1:  # segment i: pipeline rank i % pp, virtual stage i // pp
        vp = len(segments) // pp if len(segments) > pp else None
        return {_chunk_label(i % pp, pp, i // pp if vp else None, vp): list(seg) for i, seg in enumerate(segments)}
    layers = list(main)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    counts = [len(layers) // pp] * pp
    if first is not None or last is not None:
        middle = pp - (first is not None) - (last is not None)
        rest = len(layers) - (first or 0) - (last or 0)
        counts = [rest // middle if middle else 0] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
    chunks: dict[str, list[str]] = {}
    offset = 0
    for rank, count in enumerate(counts):
        chunks[_chunk_label(rank, pp, None, None)] = layers[offset:offset + count]
        offset += count
    return chunks


def _gpt_chunks(args: Any) -> dict[str, int]:
    """Decoder layers of each chunk of a GPT model (Megatron's get_num_layers_to_build)."""
    import types

    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    config = types.SimpleNamespace(
        pipeline_model_parallel_layout=None, num_layers=args.num_layers,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
    )
    stages = range(vp) if vp is not None and pp > 1 else [None]
    return {_chunk_label(rank, pp, stage, vp if pp > 1 else None):
            get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank)
            for stage in stages for rank in range(pp)}


def units_per_chunk(args: Any, value: str | None) -> dict[str, int] | None:
    """FSDP units of each model chunk of validated ``args``, by chunk label ('' for a model of
    one chunk), with unit list ``value`` (as ``HFSDP_FSDP_UNIT_MODULES``); None when the flags
    do not tell ([Note: FSDP units from the flags])."""
    which = _unit_layers(value, args.data_parallel_sharding_strategy)
    if which is None or args.pipeline_model_parallel_layout is not None or args.heterogeneous_layers_config_path \
            or args.heterogeneous_layers_config_encoded_json or args.spec:
        return None
    if args.hybrid_layer_pattern:
        symbols = _hybrid_chunks(args)
        mtp = bool(args.mtp_num_layers) or "/" in args.hybrid_layer_pattern
        counts = {label: (0 if which == "none" else len(layers) if which == "all"
                          else sum(s != MAMBA for s in layers)) for label, layers in symbols.items()}
    else:
        mtp = bool(args.mtp_num_layers)
        counts = {label: 0 if which == "none" else n for label, n in _gpt_chunks(args).items()}
    if mtp:  # the last chunk also holds the multi-token-prediction layers, units of their own
        counts.pop(list(counts)[-1])
    return counts


def training_lanes(args: Any) -> int | None:
    """The lane count training's max-pool allocators hold for ``args``, when above the shared
    pool's (None: the shared pool, or no max-pool double buffer). The one reading of the lanes flag
    for the entry's check, the planner and the several-ranks-per-GPU memory check."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.maxpool_plan import SHARED_LANES

    lanes = args.megatron_fsdp_max_pool_lanes
    return lanes if args.megatron_fsdp_max_pool_double_buffer and lanes > SHARED_LANES else None


def lanes_problem(args: Any, value: str | None) -> str | None:
    """Why ``--megatron-fsdp-max-pool-lanes`` cannot serve a model chunk of ``args``, or None: the
    sentence the runtime gives when the buffer is built (maxpool_plan.lanes_units_problem), found
    from the flags, with the chunk named when the model has several."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.maxpool_plan import lanes_units_problem

    lanes = training_lanes(args)
    if lanes is None:
        return None
    if _unit_layers(value, args.data_parallel_sharding_strategy) == "none":
        return None  # no unit classes: no double-buffer pools are built
    counts = units_per_chunk(args, value)
    if not counts:
        return None
    label, fewest = min(counts.items(), key=lambda item: item[1])  # a chunk with 0 units is refused too
    problem = lanes_units_problem(lanes, fewest, setting="--megatron-fsdp-max-pool-lanes")
    return None if problem is None else (f"[{label}] {problem}" if label else problem)
