"""Count NCCL kernels in a torch.profiler run: symmetric-memory (``ncclSymk*``) vs the rest.

Used by the benchmark worker (``--profile-dir``) and tests/gpu/nccl_lifecycle/symmetric_staging.py
to show whether the max-pool all-gathers / reduce-scatters ran NCCL's symmetric kernels.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def kernel_kind(name: str) -> str:
    """all_gather | reduce_scatter | other, from an NCCL kernel name."""
    low = name.lower()
    if "allgather" in low or "all_gather" in low:
        return "all_gather"
    if "reducescatter" in low or "reduce_scatter" in low:
        return "reduce_scatter"
    return "other"


def is_nccl_kernel(name: str) -> bool:
    """An NCCL device kernel's name. ``nccl:<op>`` is c10d's GPU-side annotation of the op, not
    a kernel; counting it would pair every kernel with a phantom one."""
    return name.lower().startswith("nccl") and not name.startswith("nccl:")


def count_nccl_kernels(events: Iterable[Any]) -> dict:
    """{symk|other_nccl: {all_gather, reduce_scatter, other}, kernel_names} over CUDA kernels.

    ``events`` is ``prof.events()`` (anything with ``.name`` and ``.device_type``).
    """
    counts: dict = {k: {"all_gather": 0, "reduce_scatter": 0, "other": 0}
                    for k in ("symk", "other_nccl")}
    names = set()
    for evt in events:
        if not str(getattr(evt, "device_type", "")).endswith("CUDA"):
            continue  # CPU-side op records share names with their kernels
        name = evt.name
        if not is_nccl_kernel(name):
            continue
        names.add(name[:80])
        bucket = "symk" if name.startswith("ncclSymk") else "other_nccl"
        counts[bucket][kernel_kind(name)] += 1
    counts["kernel_names"] = sorted(names)[:20]
    return counts
