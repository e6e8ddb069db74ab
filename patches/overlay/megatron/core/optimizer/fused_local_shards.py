# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Apex's fused optimizers on DTensor local shards.

[Note: Apex's fused optimizers and DTensors]
Megatron-FSDP hands the optimizer its main parameters, gradients and (through the first step)
state as DTensors. Transformer Engine's FusedAdam steps their local tensors. Apex's FusedAdam
and FusedSGD do not: they pass ``p.data`` and ``p.grad`` to their multi-tensor CUDA kernels,
which read each tensor's data pointer, and a DTensor is a wrapper without storage of its own.
With Apex importable and TE absent, Megatron takes Apex's classes, and the first optimizer step
of a Megatron-FSDP run dies in an illegal memory access.

:func:`on_local_shards` gives such a class a ``step`` that shows the parent every DTensor
parameter as its local shard, with its gradient and state as theirs, through
:func:`~megatron.core.optimizer.torch_adam_local_shards.local_shards` (the same swap the torch
fallback uses): the update lands in the shard's storage, and state the first step creates is
wrapped back into DTensors laid out as the parameter, so ``state_dict`` and checkpoints see what
TE's FusedAdam would give them. Plain parameters (Megatron's DDP) pass through unchanged. The
subclass is still an instance of Apex's class, so Megatron's ``isinstance`` checks hold. A list that cannot be
swapped (a gradient or state of another layout than its parameter's) is refused with a ``TypeError``: Apex's
kernels would read it as raw storage.
"""

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .torch_adam_local_shards import DTensor, local_shards


def on_local_shards(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """A subclass of ``cls`` whose ``step`` works on DTensor parameters' local shards."""

    class LocalShards(cls):  # type: ignore[valid-type, misc]
        def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            groups = self.param_groups
            saved = [group["params"] for group in groups]
            with contextlib.ExitStack() as swaps:
                try:
                    for group, params in zip(groups, saved, strict=True):
                        group["params"] = swaps.enter_context(local_shards(self, params))
                        if left := [p for p in group["params"] if DTensor is not None and isinstance(p, DTensor)]:
                            raise TypeError(
                                f"{cls.__name__} cannot step DTensor parameters whose gradient or state is laid "
                                f"out differently from the parameter ({len(left)}, the first of shape "
                                f"{tuple(left[0].shape)}): its kernels read raw storage. Use Transformer Engine's "
                                "optimizer, or uninstall Apex for torch's")
                    return super().step(closure, **kwargs)
                finally:  # before the swaps unwind: the groups hold the parameters again
                    for group, params in zip(groups, saved, strict=True):
                        group["params"] = params

    LocalShards.__name__ = LocalShards.__qualname__ = cls.__name__
    return LocalShards
