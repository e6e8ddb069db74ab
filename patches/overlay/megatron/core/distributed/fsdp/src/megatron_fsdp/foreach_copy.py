# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""Many tensor copies as few kernel launches: the main-to-model weight copies after each step.

``copy_main_weights_to_model_weights`` copies every non-FP8 parameter's main weight (fp32) into
its model weight (the compute dtype), one ``copy_`` and one kernel launch each: hundreds a step.
:func:`copy_all` does them with ``torch._foreach_copy_``, one multi-tensor launch per pair of
(destination dtype, source dtype, device). The values are those of ``copy_`` (the same cast,
round to nearest even); the bytes moved are the same, only the launches change.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """``dst.copy_(src)`` for every ``(dst, src)``, grouped into multi-tensor copies; returns the
    number of groups (launches, where ``torch._foreach_copy_`` has a fused kernel)."""
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
