# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Many tensor copies and adds as few kernel launches.

Two places write many small tensors one ``copy_`` or ``add_`` (one kernel launch) at a time:

* ``copy_main_weights_to_model_weights`` copies each non-FP8 parameter's main weight (fp32) into
  its model weight (the compute dtype) after each step, those the step did not write itself
  ([Note: Adam writes the model weights] in adam_model_writes.py): hundreds of copies;
* Megatron-FSDP's post-backward hook writes each autograd gradient (norms, biases, Mamba's
  small parameters, routers) into its one-rank main grad: a copy at the cycle's first write, an
  add after ([Note: one-rank gradient groups], 4 and 5, in single_rank_grads.py).

:func:`copy_all` and :func:`add_all` do them with ``torch._foreach_copy_`` / ``torch._foreach_add_``,
per (destination dtype, source dtype, device) group. ``_foreach_copy_`` casts inside its
multi-tensor kernel; ``_foreach_add_`` has one only for a single dtype (CUDA falls back to one
``add_`` a tensor otherwise), so a group whose sources are narrower (an fp32 main grad plus a
bf16 gradient) is first copied into one scratch buffer of the destination dtype: two launches,
and the scratch's bytes moved twice. The values are those of ``copy_`` and ``add_``: ``add_``
computes in the wider dtype, and widening a float is exact. Narrower destinations keep one
``add_`` a pair (narrowing the sources first would round twice).
Diagnostic switches, for comparisons, restore one launch per pair:
``HFSDP_PER_PARAM_COPIES=1`` for the main-to-model copies, ``HFSDP_PER_PARAM_GRAD_WRITES=1`` for the
gradient writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

import torch

PER_PARAM_ENV = "HFSDP_PER_PARAM_COPIES"
PER_PARAM_GRAD_WRITES_ENV = "HFSDP_PER_PARAM_GRAD_WRITES"

Pairs = Iterable[tuple[torch.Tensor, torch.Tensor]]
_GroupKey = tuple[torch.dtype, torch.dtype, torch.device]


def _grouped(what: str, pairs: Pairs) -> dict[_GroupKey, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    groups: dict[_GroupKey, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in pairs:
        if dst.shape != src.shape:
            raise ValueError(f"{what}: destination shape {tuple(dst.shape)} != source shape {tuple(src.shape)}")
        dsts, srcs = groups.setdefault((dst.dtype, src.dtype, dst.device), ([], []))
        dsts.append(dst)
        srcs.append(src)
    return groups


def _apply(what: str, pairs: Pairs, one: Callable[[torch.Tensor, torch.Tensor], object],
           many: Callable[[list[torch.Tensor], list[torch.Tensor]], object], per_param: bool) -> int:
    if per_param:
        count = 0
        for dst, src in pairs:
            one(dst, src)
            count += 1
        return count
    groups = _grouped(what, pairs)
    for dsts, srcs in groups.values():
        many(dsts, srcs)
    return len(groups)


def copy_all(pairs: Pairs, environ: Mapping[str, str] = os.environ, switch: str = PER_PARAM_ENV) -> int:
    """``dst.copy_(src)`` for every ``(dst, src)``, grouped into multi-tensor copies; returns the
    number of groups (launches, where ``torch._foreach_copy_`` has a fused kernel), or of pairs
    when ``switch`` is "1" in ``environ``."""
    return _apply("copy_all", pairs, torch.Tensor.copy_, torch._foreach_copy_, environ.get(switch) == "1")


def _add_widened(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``torch._foreach_add_(dsts, srcs)``, through a scratch of the destinations' dtype when the
    sources' is narrower (the multi-tensor add needs one dtype); one ``add_`` a pair when it is
    not: narrowing first would round twice where ``add_`` rounds once."""
    dst_dtype, src_dtype = dsts[0].dtype, srcs[0].dtype
    if dst_dtype != src_dtype and torch.promote_types(dst_dtype, src_dtype) != dst_dtype:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.add_(src)
        return
    if dst_dtype != src_dtype:
        scratch = torch.empty(sum(s.numel() for s in srcs), dtype=dst_dtype, device=dsts[0].device)
        widened = [v.view(s.shape) for v, s in zip(scratch.split([s.numel() for s in srcs]), srcs, strict=True)]
        torch._foreach_copy_(widened, srcs)
        srcs = widened
    torch._foreach_add_(dsts, srcs)


def add_all(pairs: Pairs, environ: Mapping[str, str] = os.environ,
            switch: str = PER_PARAM_GRAD_WRITES_ENV) -> int:
    """``dst.add_(src)`` for every ``(dst, src)``, grouped as :func:`copy_all` groups copies;
    returns the number of groups (narrower sources take two launches, a narrower destination one
    a pair), or of pairs when ``switch`` is "1" in ``environ``."""
    return _apply("add_all", pairs, torch.Tensor.add_, _add_widened, environ.get(switch) == "1")
