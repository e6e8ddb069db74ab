# Copyright (c) 2026, hfsdp authors. Added by patches/optimizer-fsdp-dtensor-empty-shard-state.patch.
"""Complete the Megatron-FSDP optimizer state for parameters whose local shard is empty.

ZeRO-3 shards each bucket's flat buffer evenly, so a small parameter (a norm weight, Mamba's
``D`` or ``dt_bias``) can lie wholly on one rank; elsewhere its local shard has 0 elements, it
never gets a gradient, and Adam never creates its state. The fsdp_dtensor checkpoint then holds
``exp_avg`` / ``exp_avg_sq`` keys on some ranks only, and
``preprocess_state_dict_for_uneven_dtensor`` walks the sorted DTensor keys with one collective
per key: ranks pair different collectives and the save (or load) hangs. Filling those entries
with empty tensors of the right DTensor layout makes every rank walk the same keys.
"""

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _local_numel(param: torch.Tensor) -> int:
    local = getattr(param, "_local_tensor", None)  # DTensor without importing it
    return (local if local is not None else param).numel()


def empty_shard_states(
    optimizer_state: dict[Any, dict[str, Any]], params: Iterable[torch.Tensor]
) -> dict[torch.Tensor, dict[str, Any]]:
    """Optimizer state for each empty-shard param that lacks one, shaped after a param that has one.

    DTensor state (``exp_avg``, ``exp_avg_sq``) becomes ``zeros_like(param)``: an empty local
    shard with this param's global shape and placement. 0-d tensors (``step``) and plain values
    are copied from the reference. Anything else (a plain tensor shaped like the reference's
    local shard) has no meaning for another param and is refused. Returns only the new entries;
    the live optimizer state is not modified. Empty when no param on this rank has state yet.

    The decision is local to the rank: it assumes the rank that owns a param's elements has its
    state (true once that param has taken an optimizer step).
    """
    params = list(params)
    reference_param = next((p for p in params if optimizer_state.get(p)), None)
    if reference_param is None:
        return {}
    reference = optimizer_state[reference_param]
    extra = {}
    for param in params:
        if optimizer_state.get(param) or _local_numel(param) != 0:
            continue  # has state, or will get it at its first step
        state = {}
        for key, value in reference.items():
            if isinstance(value, DTensor):
                state[key] = torch.zeros_like(param, dtype=value.dtype)
            elif torch.is_tensor(value) and value.dim() == 0:
                state[key] = value.detach().clone()
            elif torch.is_tensor(value):
                raise TypeError(
                    f"optimizer state {key!r} is a plain {tuple(value.shape)} tensor; cannot "
                    f"build an empty-shard entry for a {tuple(param.shape)} param from it"
                )
            else:
                state[key] = value
        extra[param] = state
    return extra
