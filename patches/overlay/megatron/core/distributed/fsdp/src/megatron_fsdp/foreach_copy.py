# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Many tensor copies and adds as few kernel launches.

Two places write many small tensors one ``copy_`` or ``add_`` (one kernel launch) at a time:

* ``copy_main_weights_to_model_weights`` copies every non-FP8 parameter's main weight (fp32) into
  its model weight (the compute dtype) after each step: hundreds of copies;
* Megatron-FSDP's post-backward hook writes each autograd gradient (norms, biases, Mamba's
  small parameters, routers) into its one-rank main grad: a copy at the cycle's first write, an
  add after ([Note: one-rank gradient groups], 4 and 5, in single_rank_grads.py).

:func:`copy_all` and :func:`add_all` do them with ``torch._foreach_copy_`` / ``torch._foreach_add_``,
one multi-tensor launch per (destination dtype, source dtype, device). The values are those of
``copy_`` and ``add_`` (the same cast and rounding, element by element); the bytes moved are the
same, only the launches change. Diagnostic switches, for comparisons, restore one launch per pair:
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


def add_all(pairs: Pairs, environ: Mapping[str, str] = os.environ,
            switch: str = PER_PARAM_GRAD_WRITES_ENV) -> int:
    """``dst.add_(src)`` for every ``(dst, src)``, grouped as :func:`copy_all` groups copies."""
    return _apply("add_all", pairs, torch.Tensor.add_, torch._foreach_add_, environ.get(switch) == "1")
