# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Torch Adam/AdamW (the fallback without Transformer Engine or Apex) on DTensor local shards.

[Note: the fallback Adam step on local shards]
Megatron-FSDP hands the optimizer its main parameters as DTensors, with DTensor gradients.
torch's foreach Adam then runs every ``_foreach_*`` call through DTensor's dispatcher: sharding
propagation and pytree flattening in Python, per call and per tensor list: host work that
Transformer Engine's FusedAdam, which works on the local tensors, does not have.

Every operation of the Adam step is elementwise, so stepping each parameter's local shard with
the local shards of its gradient and state gives the same bits, with none of that dispatch.
:func:`local_shards` does it around one parent ``step``:

- a DTensor parameter is replaced, for that step only, by a detached alias of its local tensor
  (same storage, so the update lands in the parameter);
- its gradient and existing state are shown as their local tensors (aliases too);
- state the step creates (the first step's ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) is
  wrapped back into DTensors with the parameter's mesh, placements, shape and stride, as torch
  would have made them; ``step`` is kept as is. ``state_dict`` is therefore the same as without
  this module.

Only when every DTensor of the list has a gradient (and state) that is a DTensor of the same
mesh, placements, shape and stride is the list swapped; otherwise it is stepped as it is, all
through DTensor dispatch: foreach kernels cannot mix DTensors and plain tensors, and a gradient
of another layout needs the redistribution only DTensor dispatch does. Megatron-FSDP gives
gradients and state their parameter's layout, so its lists are always swapped.
"""

import contextlib
from collections.abc import Iterator

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch builds without distributed
    DTensor = None  # type: ignore[assignment, misc]


def _same_layout(value: torch.Tensor, param: "DTensor") -> bool:
    """Whether ``value`` is a DTensor laid out as ``param`` (so their local shards line up)."""
    if not isinstance(value, DTensor):
        return False
    # The specs' fields, not the public properties: a third of the cost, and this runs for every
    # gradient and state tensor of every step.
    a, b = getattr(value, "_spec", None), getattr(param, "_spec", None)
    if a is not None and a is b:
        return True
    if a is None or b is None or a.tensor_meta is None or b.tensor_meta is None:
        return (
            value.device_mesh == param.device_mesh
            and value.placements == param.placements
            and value.shape == param.shape
            and value.stride() == param.stride()
        )
    return (
        (a.mesh is b.mesh or a.mesh == b.mesh)
        and a.placements == b.placements
        and a.tensor_meta.shape == b.tensor_meta.shape
        and a.tensor_meta.stride == b.tensor_meta.stride
    )


def _swappable(optimizer: torch.optim.Optimizer, param: "DTensor") -> bool:
    if param.grad is not None and not _same_layout(param.grad, param):
        return False
    state = optimizer.state.get(param, {})
    return all(
        _same_layout(v, param) for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)
    )


def _as_dtensor_like(value: torch.Tensor, param: "DTensor") -> "DTensor":
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )


def _wrap_new_state(new_state: dict, param: "DTensor", local: torch.Tensor) -> dict:
    """State the first step made for ``local``, as torch makes it for ``param``."""
    return {
        k: (
            _as_dtensor_like(v, param)
            if k != "step" and isinstance(v, torch.Tensor) and v.shape == local.shape
            else v
        )
        for k, v in new_state.items()
    }


@contextlib.contextmanager
def local_shards(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
) -> Iterator[list[torch.Tensor]]:
    """``params`` with DTensors swapped for their local shards while the caller steps them."""
    dtensors = [p for p in params if DTensor is not None and isinstance(p, DTensor)]
    if not dtensors or not all(_swappable(optimizer, p) for p in dtensors):
        yield params
        return
    stepped: list[torch.Tensor] = []
    # (DTensor param, its local alias, whether it had state before this step)
    swapped: list[tuple[DTensor, torch.Tensor, bool]] = []
    try:
        with torch.no_grad():
            for param in params:
                if not isinstance(param, DTensor):
                    stepped.append(param)
                    continue
                local = param.to_local().detach()  # a plain leaf alias of the shard's storage
                state: dict = optimizer.state.get(param, {})
                swapped.append((param, local, bool(state)))  # first, so `finally` undoes all below
                if state:
                    optimizer.state[local] = {
                        k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()
                    }
                grad = param.grad
                if grad is not None and not isinstance(grad, DTensor):
                    raise TypeError(f"a DTensor parameter {tuple(param.shape)} has a {type(grad).__name__} grad")
                local.grad = None if grad is None else grad.to_local()
                stepped.append(local)
        yield stepped
    finally:
        # Take every alias out of the optimizer before wrapping anything, so that no failure
        # below leaves an entry keyed by an alias (its state would be lost at the next step).
        results: list[tuple[DTensor, torch.Tensor, bool, dict | None]] = []
        for param, local, had_state in swapped:
            results.append((param, local, had_state, optimizer.state.pop(local, None)))
            local.grad = None
        for param, local, had_state, new_state in results:
            if new_state is None:
                continue
            if had_state:
                # Tensor state is updated in place through the aliases; carry over anything rebound.
                kept = optimizer.state[param]
                for k, v in new_state.items():
                    if not isinstance(kept.get(k), DTensor):
                        kept[k] = v
            else:
                optimizer.state[param] = _wrap_new_state(new_state, param, local)
