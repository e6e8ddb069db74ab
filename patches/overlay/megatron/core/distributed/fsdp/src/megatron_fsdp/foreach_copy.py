# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Many tensor copies as few kernel launches: the main-to-model weight copies after each step.

``copy_main_weights_to_model_weights`` copies every non-FP8 parameter's main weight (fp32) into
its model weight (the compute dtype), one ``copy_`` and one kernel launch each: hundreds a step.
:func:`copy_all` does them with ``torch._foreach_copy_``, one multi-tensor launch per pair of
(destination dtype, source dtype, device). The values are those of ``copy_`` (the same cast,
round to nearest even); the bytes moved are the same, only the launches change.
``HFSDP_PER_PARAM_COPIES=1`` (a diagnostic switch, for comparisons) copies one pair at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch

PER_PARAM_ENV = "HFSDP_PER_PARAM_COPIES"


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], environ: Mapping[str, str] = os.environ) -> int:
    """``dst.copy_(src)`` for every ``(dst, src)``, grouped into multi-tensor copies; returns the
    number of groups (launches, where ``torch._foreach_copy_`` has a fused kernel), or of pairs
    under ``HFSDP_PER_PARAM_COPIES=1``."""
    if environ.get(PER_PARAM_ENV) == "1":
        count = 0
        for dst, src in pairs:
            dst.copy_(src)
            count += 1
        return count
    groups: dict[tuple[torch.dtype, torch.dtype, torch.device], tuple[list, list]] = {}
    for dst, src in pairs:
        if dst.shape != src.shape:
            raise ValueError(f"copy_all: destination shape {tuple(dst.shape)} != source shape {tuple(src.shape)}")
        dsts, srcs = groups.setdefault((dst.dtype, src.dtype, dst.device), ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)
    return len(groups)
