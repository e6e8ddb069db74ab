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


# [Note: kernel classes] What a step's device time is spent on, by kernel name: the order of the
# rules matters (an NCCL kernel is never a GEMM; Triton's own kernels start with "_" or "triton_").
KERNEL_CLASSES = (
    ("nccl", lambda n: is_nccl_kernel(n)),
    ("optimizer", lambda n: "multi_tensor_apply" in n),
    ("attention", lambda n: any(s in n for s in ("sdpa", "flash", "fmha", "fused_attn"))),
    ("gemm", lambda n: n.startswith(("nvjet", "sm90_xmma", "cutlass")) or "gemm" in n.lower()),
    ("conv1d", lambda n: "causal_conv1d" in n),
    ("triton", lambda n: n.startswith(("_", "triton_"))),
    ("torch elementwise", lambda n: "at::native" in n or "at_cuda_detail" in n),
    ("transformer engine", lambda n: "transformer_engine" in n),
)


def kernel_class(name: str) -> str:
    """The class of :data:`KERNEL_CLASSES` a kernel name falls in, or "other"."""
    return next((cls for cls, rule in KERNEL_CLASSES if rule(name)), "other")


def kernel_time(trace_events: Iterable[dict],
                steps: int | None = None) -> tuple[dict[str, float], list[tuple[str, float, float]]]:
    """Device time per kernel class and per kernel name over a Chrome trace's "kernel" events:
    ``({class: ms}, [(name, ms, launches), ...])``, largest first; ms and launches per step when
    ``steps`` is given. Summed over streams, so overlapping kernels both count."""
    div = 1000.0 * (steps or 1)
    per_class: dict[str, float] = {}
    per_name: dict[str, list[float]] = {}
    for e in trace_events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        name, us = str(e.get("name", "")), float(e.get("dur", 0))
        cls = kernel_class(name)
        per_class[cls] = per_class.get(cls, 0.0) + us / div
        entry = per_name.setdefault(name, [0.0, 0])
        entry[0] += us / div
        entry[1] += 1 / (steps or 1)
    classes = dict(sorted(per_class.items(), key=lambda kv: -kv[1]))
    names = sorted(((n, ms, c) for n, (ms, c) in per_name.items()), key=lambda t: -t[1])
    return classes, names
