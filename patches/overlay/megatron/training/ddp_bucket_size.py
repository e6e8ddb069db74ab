# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""The bucket size ``get_model`` gives the DDP / Megatron-FSDP wrapper of the first model chunk.

One function, called by ``get_model`` and by the offline memory planner, so that a plan made
without a GPU buckets the non-unit parameters exactly as training does.
"""



def default_bucket_size(
    *,
    bucket_size: int | None,
    num_buckets: int | None,
    num_parameters: int,
    dp_size: int,
    overlap_grad_reduce: bool,
) -> int | None:
    """``num_buckets`` splits ``num_parameters`` evenly; an unset size is max(40M, 1M x DP)
    elements, so that ring collectives at large DP stay bandwidth-bound; without
    ``overlap_grad_reduce`` nothing is bucketed (None). Megatron-FSDP splits only non-unit
    parameter groups by it."""
    if num_buckets is not None:
        bucket_size = num_parameters // num_buckets
    if bucket_size is None:
        bucket_size = max(40_000_000, 1_000_000 * dp_size)
    return bucket_size if overlap_grad_reduce else None
