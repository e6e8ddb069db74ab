"""FSDP unit table and bucket layout, computed by Megatron-FSDP's own functions.

``_get_parameter_groups`` (unit discovery, dtype/expert/unit grouping, bucket splitting, chunk
factors) and ``build_data_parallel_buffer_index`` (item placement and DP padding) are called
exactly as ``ParamAndGradBuffer`` calls them, with the DP size given on the command line instead
of read from a process group. Nothing here allocates tensor memory: shapes are enough.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence

import torch

from hfsdp.planner.fp8 import Fp8Layout, fp8_layout

MFSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp"
SHARED_LIVE_UNITS = 2  # double_buffer.plan.NUM_BUFFER_GROUPS: live units without round-robin lanes


@dataclasses.dataclass(frozen=True)
class BucketRow:
    """One parameter group (= bucket) as ParamAndGradBuffer sees it."""

    bucket_id: int
    unit_id: int | None
    dtype: str  # param group dtype: "torch.bfloat16", ..., or "float8"
    is_expert: bool
    requires_grad: bool
    num_params: int
    unpadded_numel: int  # sum of parameter numels (FixedPool's comparison size)
    numel: int  # padded bucket_index.size (the size every runtime allocation asks for)
    chunk_size_factor: int
    dp_size: int


@dataclasses.dataclass(frozen=True)
class UnitRow:
    """One FSDP unit: id (= discovery order), module path and class."""

    unit_id: int
    name: str
    cls: str
    num_params: int
    bucket_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    units: tuple[UnitRow, ...]
    buckets: tuple[BucketRow, ...]
    unit_classes: tuple[str, ...]
    strategy: str
    dp_size: int
    expert_dp_size: int
    total_params: int
    fp8: Fp8Layout | None = None  # FP8 parameters and their recipe ([Note: FP8 parameters in the plan])


def discover_units(module: torch.nn.Module, unit_classes: Sequence[type]) -> list[tuple[str, torch.nn.Module]]:
    """Units in ``_get_parameter_groups`` order: pre-order, nested units skipped."""
    found: list[tuple[str, torch.nn.Module]] = []
    if not unit_classes:
        return found
    for name, m in module.named_modules():
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue
        if any(isinstance(m, cls) for cls in unit_classes):
            found.append((name, m))
    return found


def compute_layout(
    module: torch.nn.Module,
    *,
    unit_classes: Sequence[type],
    strategy: str,
    dp_size: int,
    expert_dp_size: int | None = None,
    bucket_size: int | None = None,
    fp8_names: Mapping[str, tuple[bool, bool]] | None = None,
    fp8_recipe: str | None = None,
    keep_fp8_transpose: bool = False,
    live_units: int = 2,
) -> Layout:
    """Bucket layout of ``module`` for a DP group of ``dp_size`` ranks (expert: ``expert_dp_size``).

    ``fp8_names``: the parameters Megatron-FSDP keeps in FP8 (``fp8.meta_fp8_params``), grouped as
    ``"float8"`` as the runtime groups them; ``fp8_recipe`` sizes what TE keeps beside them.
    """
    import importlib

    pgb = importlib.import_module(f"{MFSDP}.param_and_grad_buffer")
    expert_dp_size = dp_size if expert_dp_size is None else expert_dp_size
    policy = pgb.BucketingPolicy(
        suggested_bucket_size=bucket_size,
        fsdp_unit_modules=list(unit_classes),
        data_parallel_sharding_strategy=strategy,
    )
    fp8_names = dict(fp8_names or {})
    if fp8_names and fp8_recipe is None:
        raise ValueError(f"{len(fp8_names)} FP8 parameters given without their recipe")
    groups, _, _ = pgb._get_parameter_groups(module, policy, fp8_names)
    # build_data_parallel_buffer_index only reads the sharding strategy from the DDP config.
    ddp_view = types.SimpleNamespace(data_parallel_sharding_strategy=strategy)
    weights_sharded = strategy == "optim_grads_params"
    buckets = []
    for bucket_id, group in enumerate(groups):
        size = expert_dp_size if group.is_expert_param else dp_size
        shapes = [pgb.to_local_if_dtensor(p).shape for p in group.params]
        _, bucket_index, _ = pgb.build_data_parallel_buffer_index(
            shapes, 0, size, weights_sharded and size > 1, ddp_view,
            bucket_id=bucket_id, chunk_size_factor=group.chunk_size_factor,
        )
        buckets.append(BucketRow(
            bucket_id=bucket_id,
            unit_id=group.fsdp_unit_id,
            dtype=str(group.dtype),
            is_expert=bool(group.is_expert_param),
            requires_grad=bool(group.requires_grad),
            num_params=len(group.params),
            unpadded_numel=sum(s.numel() for s in shapes),
            numel=int(bucket_index.size),
            chunk_size_factor=int(group.chunk_size_factor),
            dp_size=size,
        ))
    units = []
    for unit_id, (name, m) in enumerate(discover_units(module, unit_classes)):
        ids = tuple(b.bucket_id for b in buckets if b.unit_id == unit_id)
        units.append(UnitRow(unit_id, name, type(m).__name__,
                             sum(p.numel() for p in m.parameters()), ids))
    n_unit_ids = len({b.unit_id for b in buckets if b.unit_id is not None})
    assert n_unit_ids == len(units) and all(u.bucket_ids for u in units), (
        f"unit discovery disagrees with _get_parameter_groups: {len(units)} units found, "
        f"{n_unit_ids} unit ids in groups"
    )
    names = {id(p): n for n, p in module.named_parameters()}
    unit_of = {names[id(p)]: g.fsdp_unit_id for g in groups for p in g.params}
    fp8 = (fp8_layout(module, fp8_names, unit_of, fp8_recipe, keep_fp8_transpose, live_units)
           if fp8_recipe else None)
    return Layout(
        units=tuple(units),
        buckets=tuple(buckets),
        unit_classes=tuple(f"{c.__module__}.{c.__qualname__}" for c in unit_classes),
        strategy=strategy,
        dp_size=dp_size,
        expert_dp_size=expert_dp_size,
        total_params=sum(p.numel() for p in module.parameters()),
        fp8=fp8,
    )


def bucket_specs(layout: Layout, allocator: str, *, main_grads_dtype: torch.dtype | None = None,
                 grad_comm_dtype: torch.dtype | None = None) -> list:
    """BucketSpecs for the ``"weight"`` or ``"grad"`` allocator (all buckets, units and not).

    Dtypes follow the runtime's own rules (``double_buffer.plan.planned_dtype_name``,
    ``grad_dtype_name``, ``grad_alloc_dtype_name``), item sizes its ``planned_itemsize``.
    """
    import importlib

    plan_mod = importlib.import_module(f"{MFSDP}.double_buffer.plan")
    dtypes_mod = importlib.import_module(f"{MFSDP}.double_buffer.dtypes")
    if allocator not in ("weight", "grad"):
        raise ValueError(f"allocator must be 'weight' or 'grad', got {allocator!r}")
    specs = []
    for row in layout.buckets:
        if allocator == "weight":
            dtype = plan_mod.planned_dtype_name(row.dtype)
        else:
            dtype = plan_mod.grad_alloc_dtype_name(
                plan_mod.grad_dtype_name(row.dtype, main_grads_dtype), grad_comm_dtype)
        specs.append(plan_mod.BucketSpec(
            bucket_id=row.bucket_id, unit_id=row.unit_id, dtype=dtype, numel=row.numel,
            itemsize=dtypes_mod.planned_itemsize(dtype), unpadded_numel=row.unpadded_numel,
        ))
    return specs
