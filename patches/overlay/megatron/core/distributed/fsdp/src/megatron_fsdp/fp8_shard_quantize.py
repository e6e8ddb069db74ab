# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Per-tensor FP8 parameters re-quantized from their main weights, row-wise only.

[Note: row-wise shard quantization] With ``--fp8-param-gather`` Megatron-FSDP keeps each FP8
parameter's bytes in its weight buffer and, after every optimizer step, re-quantizes the shard
this rank owns from its high-precision main weight (``fp8_quantize`` in mixed_precision.py,
through Transformer Engine's ``cast_master_weights_to_fp8``). The shard is a flat run of the
parameter's elements. For per-tensor recipes (delayed scaling and tensorwise current scaling) TE
quantizes it with a quantizer that asks for both usages, so besides the row-wise bytes it
computes the "transpose" of a one-row matrix with its general cast-transpose kernel. That
transpose is never read: the one the backward GEMMs use is made from the gathered weight after
each all-gather (``post_all_gather_processing``). docs/results.md has what it costs.

:func:`quantize_rowwise` does TE's per-tensor work with row-wise quantizers: the main weight cast
to the model's dtype first, the same amaxes, the same reduction of them over the data-parallel
group, the same scales and scale-inverses, and the same cast, so the FP8 bytes and
scale-inverses are TE's and losses bit-identical (the DP=2 FP8-parameter functional cases hold
their goldens, recorded with TE's path); only the unread transpose is left out. It takes the
per-tensor parameters whose shard is one plain tensor, and only where TE's post-all-gather
processing exists; everything else (blockwise, MXFP8, a separate transpose shard) is returned
for TE's function.

Invariants: the delayed and current groups each reduce their amaxes in one all-reduce, in that
order, as TE does; a parameter whose shard lives on another rank (main weight ``None``) still
takes part in the reduction, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.optimizers.multi_tensor_apply import multi_tensor_applier
    from transformer_engine.pytorch.tensor import utils as te_utils
    from transformer_engine.pytorch.tensor.float8_tensor import (
        Float8CurrentScalingQuantizer,
        Float8Quantizer,
        Float8Tensor,
    )
    from transformer_engine.pytorch.tensor.utils import post_all_gather_processing  # noqa: F401

    HAVE_ROWWISE_PATH = hasattr(tex, "multi_tensor_compute_scale_and_scale_inv")
except ImportError:  # TE absent or too old: TE's own function (or the fallback) does all of it
    HAVE_ROWWISE_PATH = False

# (FP8 model weight, main-weight shard or None, offset, shard storage): TE's types, hence Any.
Param = tuple[Any, torch.Tensor | None, int | None, Any]


def _kind(model_weight: Any, shard: object) -> str | None:
    """'delayed' or 'current' for a per-tensor FP8 parameter with a one-tensor shard, else None."""
    if not isinstance(model_weight, Float8Tensor) or isinstance(shard, (tuple, list)):
        return None
    quantizer = model_weight._get_quantizer()
    if type(quantizer) is Float8Quantizer:
        return "delayed"
    if type(quantizer) is Float8CurrentScalingQuantizer:
        return "current"
    return None


def _fragment(quantizer: Any, model_weight: Any, shard: Any) -> Any:
    if isinstance(shard, Float8Tensor):
        return shard
    return quantizer.create_tensor_from_data(shard.view(-1), model_weight.dtype)


def _delayed(params: list[Param], group) -> None:
    """TE's delayed-scaling path: cast with the current scale (recording amax), then reduce the
    amaxes and refresh every parameter's scale-inverse."""
    amaxes, scales, scale_invs = [], [], []
    for model_weight, main_weight, _, shard in params:
        quantizer = model_weight._get_quantizer()
        amaxes.append(quantizer.amax.view(1))
        scales.append(quantizer.scale.view(1))
        scale_invs.append(model_weight._scale_inv.view(1))
        if main_weight is None:
            continue
        rowwise = Float8Quantizer(quantizer.scale, quantizer.amax, model_weight._fp8_dtype,
                                  rowwise=True, columnwise=False)
        fragment = rowwise.create_tensor_from_data(shard.view(1, -1), model_weight.dtype)  # uint8, as TE's
        rowwise.update_quantized(main_weight.view(1, -1), fragment)
    overflow = torch.zeros(1, dtype=torch.int, device=amaxes[0].device)
    packed = torch.empty(len(amaxes), dtype=torch.float32, device=amaxes[0].device)
    views = [packed[i].view(1) for i in range(len(amaxes))]
    multi_tensor_applier(tex.multi_tensor_scale, overflow, [amaxes, views], 1.0)
    torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=group)
    multi_tensor_applier(tex.multi_tensor_scale, overflow, [views, amaxes], 1.0)
    packed_scales = torch.empty(len(scales), dtype=torch.float32, device=scales[0].device)
    scale_views = [packed_scales[i].view(1) for i in range(len(scales))]
    multi_tensor_applier(tex.multi_tensor_scale, overflow, [scales, scale_views], 1.0)
    torch.reciprocal(packed_scales, out=packed_scales)
    multi_tensor_applier(tex.multi_tensor_scale, overflow, [scale_views, scale_invs], 1.0)


def _current(params: list[Param], group) -> None:
    """TE's current-scaling path: amax of every main-weight shard, reduced over the group, then
    scale and scale-inverse per parameter, then the cast."""
    first = params[0][0]._get_quantizer()
    for model_weight, *_ in params:
        q = model_weight._get_quantizer()
        if (q.dtype, q.force_pow_2_scales, q.amax_epsilon) != (first.dtype, first.force_pow_2_scales,
                                                               first.amax_epsilon):
            raise ValueError(
                f"FP8 parameters of one group must share dtype, force_pow_2_scales and amax_epsilon: "
                f"{(q.dtype, q.force_pow_2_scales, q.amax_epsilon)} != "
                f"{(first.dtype, first.force_pow_2_scales, first.amax_epsilon)}"
            )
    device = params[0][0].device
    overflow = torch.zeros(1, dtype=torch.int, device=device)
    packed = torch.zeros(len(params), dtype=torch.float32, device=device)
    amaxes = [packed[i : i + 1] for i in range(len(params))]
    scales, scale_invs = [], []
    for (model_weight, main_weight, _, _), amax in zip(params, amaxes, strict=True):
        scales.append(torch.empty(1, dtype=torch.float32, device=device))
        scale_invs.append(model_weight._scale_inv.view(1))
        if main_weight is not None:
            tex.compute_amax(main_weight, amax)
    torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=group)
    max_fp8 = {tex.DType.kFloat8E4M3: 448.0, tex.DType.kFloat8E5M2: 57344.0}.get(first.dtype)
    if max_fp8 is None:
        raise ValueError(f"unsupported FP8 dtype for current scaling: {first.dtype}")
    multi_tensor_applier(tex.multi_tensor_compute_scale_and_scale_inv, overflow, [amaxes, scales, scale_invs],
                         max_fp8, first.force_pow_2_scales, first.amax_epsilon)
    for (model_weight, main_weight, _, shard), scale in zip(params, scales, strict=True):
        if main_weight is None:
            continue
        rowwise = Float8Quantizer(scale=scale, amax=torch.Tensor(), fp8_dtype=model_weight._fp8_dtype,
                                  rowwise=True, columnwise=False)
        rowwise.update_quantized(main_weight, _fragment(rowwise, model_weight, shard))


def quantize_rowwise(
    model_params: Sequence[Any],
    main_params: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int | None],
    data_parallel_group,
    fsdp_shard_model_params: Sequence[object],
) -> list[int]:
    """Quantize the per-tensor FP8 parameters among the inputs row-wise (see the note); returns the
    indices left for TE's ``cast_master_weights_to_fp8`` (all of them when TE lacks the pieces the
    row-wise path needs)."""
    everything = list(range(len(model_params)))
    if not HAVE_ROWWISE_PATH:
        return everything
    groups: dict = {"delayed": [], "current": []}
    rest = []
    validate = getattr(te_utils, "_validate_per_tensor_fp8_fsdp_hopper_policy", None)
    for i in everything:
        model_weight, main_weight, shard = model_params[i], main_params[i], fsdp_shard_model_params[i]
        kind = _kind(model_weight, shard)
        if kind is None:
            rest.append(i)
            continue
        # As TE's quantize_master_weights does before its per-recipe paths: refuse what it
        # refuses, drop the CPU copy of the initial weight, and cast the main weight to the
        # model's dtype first (the numerics of FP8 parameters equal those of bf16 ones).
        if validate is not None:
            validate(model_weight, shard)
        if hasattr(model_weight, "clear_high_precision_init_val"):
            model_weight.clear_high_precision_init_val()
        if main_weight is not None:
            main_weight = main_weight.to(model_weight.dtype)
        groups[kind].append((model_weight, main_weight, start_offsets[i], shard))
    if groups["delayed"]:
        _delayed(groups["delayed"], data_parallel_group)
    if groups["current"]:
        _current(groups["current"], data_parallel_group)
    return rest
