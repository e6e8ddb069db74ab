"""What one rank holds for the whole run, from a plan (no GPU work).

A rank holds its shard of the parameters, of the optimizer's main parameters, gradients and
moments, and the double-buffer pools (:class:`RankMemory`). Activations and temporary buffers come
on top and are not planned, so this is a lower bound: a plan it says cannot fit, cannot. The
several-ranks-per-GPU launch checks it against the GPUs it has (hfsdp/launch/fit.py); the planner
against the largest GPU memory known (:data:`LARGEST_GPU_BYTES`, [Note: cannot fit] in cli.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hfsdp.planner.pools import pool_allocated

GIB = 2**30
MIB = 2**20
# The largest memory of one GPU we know of: NVIDIA H200, 141 GiB. A plan above it fits no GPU.
LARGEST_GPU = "H200"
LARGEST_GPU_BYTES = 141 * GIB
_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "float8": 1}
_MOMENTS = {"adam": 2, "sgd": 1}  # fp32 states per main parameter


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds for the whole run, as planned."""

    weights: int
    main_params: int
    main_grads: int
    optimizer: int
    pools: int
    fp8_scales: int = 0  # TE's scales of FP8 parameters (and kept transposes), outside the FSDP buffers

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def describe(self, unit: int = GIB) -> str:
        """Total and parts in GiB, or MiB (``unit=MIB``)."""
        name = "GiB" if unit == GIB else "MiB"
        parts = ", ".join(f"{f.name.replace('_', ' ')} {getattr(self, f.name) / unit:.2f}" for f in fields(self)
                          if f.name != "fp8_scales" or self.fp8_scales)
        return f"{self.total / unit:.2f} {name} ({parts})"


def _itemsize(dtype: Any, fallback: int) -> int:
    """Bytes per element of a torch dtype or a Megatron dtype name; ``fallback`` for 'auto'/None."""
    if dtype is None or dtype == "auto":
        return fallback
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    return _ITEMSIZE.get(str(dtype).removeprefix("torch.").replace("float32", "fp32")
                         .replace("bfloat16", "bf16").replace("float16", "fp16"), fallback)


def grad_dtypes(args: Any, release: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """(main_grads_dtype, grad_comm_dtype) as the tree's Megatron-FSDP adapter derives them.

    ``release``: the tree's (major, minor), default the imported ``megatron.core``'s. 0.18's
    adapter turns ``grad_reduce_in_fp32`` (``--accumulate-allreduce-grads-in-fp32``, Megatron's
    default with ``--bf16``) into fp32 for both; from 0.19 the adapter passes
    ``--megatron-fsdp-main-grads-dtype`` and ``--megatron-fsdp-grad-comm-dtype`` through, whose
    ``auto`` (None) is the parameters' dtype, so a bf16 model has bf16 gradient buffers there.
    """
    import torch

    if release is None:
        from megatron.core import package_info

        release = (int(package_info.MAJOR), int(package_info.MINOR))
    if release < (0, 19) and args.accumulate_allreduce_grads_in_fp32:
        return torch.float32, torch.float32
    return args.megatron_fsdp_main_grads_dtype, args.megatron_fsdp_grad_comm_dtype


def planned_memory(args: Any, layout: Any, results: list[dict[str, Any]], lane_count: int | None) -> RankMemory:
    """One rank's memory for parsed ``args`` and their plan (``hfsdp.planner.cli.plan_from_args``).

    Pools: the ``lane_count``-lane plan (``--megatron-fsdp-max-pool-lanes`` 3 or more), else the
    max-pool plan (also what two live unsharded units take without double buffering); none at
    data-parallel size 1, where no pool is allocated.
    """
    strategy = layout.strategy
    shard_weights = strategy == "optim_grads_params"
    shard_grads = strategy in ("optim_grads", "optim_grads_params")
    main_grads_dtype = grad_dtypes(args)[0]
    memory = dict.fromkeys(("weights", "main_params", "main_grads", "optimizer"), 0)
    moments = _MOMENTS.get(str(args.optimizer), 2)
    for b in layout.buckets:
        shard = b.numel // b.dp_size if b.dp_size > 1 else b.numel
        param_size = _itemsize(b.dtype, 2)
        main_size = _itemsize(args.megatron_fsdp_main_params_dtype, param_size)
        memory["weights"] += (shard if shard_weights else b.numel) * param_size
        if not b.requires_grad:
            continue
        memory["main_params"] += shard * main_size
        memory["main_grads"] += (shard if shard_grads else b.numel) * _itemsize(main_grads_dtype, param_size)
        memory["optimizer"] += shard * 4 * moments
    pools = 0
    for result in results if pool_allocated(layout.dp_size) else ():  # [Note: no pool at DP=1] in pools.py
        plan = result["lanes"].get(lane_count) if lane_count else None
        pools += (plan or result["maxpool"]).pool_bytes()
    fp8_scales = layout.fp8.held_bytes() if layout.fp8 is not None else 0  # [Note: FP8 parameters in the plan]
    return RankMemory(pools=pools, fp8_scales=fp8_scales, **memory)


def reference_memory(trained: RankMemory) -> RankMemory:
    """What the frozen reference of ``examples/reference_kl/train.py`` holds on the rank: a copy of the
    trained model's weight shards (and FP8 scales), with no gradient, main weight or optimizer state
    (its parameters are frozen) and no pool (it runs without a double buffer)."""
    return RankMemory(weights=trained.weights, main_params=0, main_grads=0, optimizer=0, pools=0,
                      fp8_scales=trained.fp8_scales)


def two_models_lines(trained: RankMemory) -> list[str]:
    """The planner's report of both models of the reference example: each one's part and the sum."""
    ref = reference_memory(trained)
    unit = GIB if trained.total >= GIB else MIB
    total = RankMemory(*(getattr(trained, f.name) + getattr(ref, f.name) for f in fields(RankMemory)))
    return ["two models on each rank (examples/reference_kl/train.py), before activations:",
            f"  trained:   {trained.describe(unit)}",
            f"  reference: {ref.describe(unit)}",
            f"  sum:       {total.describe(unit)}", ""]
