# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Torch dtypes of the double-buffer pools, from the rules ``plan`` states by name.

``ParamAndGradBuffer``, the max-pool allocators and the offline planner take every buffer
dtype from these functions, so that they cannot disagree. Groups are Megatron-FSDP
``ParameterGroup``s (only ``dtype`` and ``grad_dtype`` are read).
"""

from __future__ import annotations

from typing import Any

import torch

from . import plan


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (e.g. "torch.bfloat16"); plan.py speaks names."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def planned_itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype`` as planned ("float8" is planned as uint8)."""
    return dtype_from_name(plan.planned_dtype_name(dtype)).itemsize


def planned_param_dtype(group: Any) -> torch.dtype:
    """Dtype of the weight buffers of ``group`` ("float8" groups are stored as uint8)."""
    return dtype_from_name(plan.planned_dtype_name(group.dtype))


def resolve_grad_dtype(group: Any, main_grads_dtype: torch.dtype | None) -> torch.dtype:
    """Main-grad dtype: the policy's main_grads_dtype, else bf16 for FP8, else the param dtype."""
    return dtype_from_name(plan.grad_dtype_name(group.dtype, main_grads_dtype))


def grad_alloc_dtype(group: Any, grad_comm_dtype: torch.dtype | None) -> torch.dtype:
    """Dtype the grad allocators are asked for: grad_comm_dtype, else the main-grad dtype."""
    return dtype_from_name(plan.grad_alloc_dtype_name(group.grad_dtype, grad_comm_dtype))
