"""What a finished ``pretrain`` run measured, as JSON: ``HFSDP_RUN_REPORT=<path>``.

Megatron's log has step times and losses; the numbers a benchmark or a test also needs are
not in it: the allocator's peaks over the training steps only (model construction excluded),
how many bytes the double-buffer pools hold, max-pool home misses, and whether a
full-iteration CUDA graph was captured. With the variable set, the first training forward
step resets the allocator's peak counters and remembers the model; after ``pretrain``
returns (its clean teardown has already ended the process group), every rank writes its own
JSON object: rank 0 to ``<path>``, rank r to ``<path>.rank<r>``; ``read`` merges them (peaks
are the maximum over ranks). Without the variable nothing here runs.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from hfsdp.atomic import loads_strict, write_json_atomic
from hfsdp.usererror import not_a_regular_file

ENV = "HFSDP_RUN_REPORT"
# Megatron-FSDP's named global buffers that belong to double-buffer pools.
POOL_PREFIXES = ("fsdp_params", "fsdp_fp8_transpose_params", "fsdp_grads", "hsdp_grad_comm")

_model_ref: Any = None  # weak reference to the first model chunk a forward step saw


def requested() -> bool:
    return bool(os.environ.get(ENV))


def note_forward_step(model: Any) -> None:
    """Called by our forward step; the first call starts the measured window."""
    global _model_ref
    if _model_ref is not None or not requested():
        return
    import torch

    _model_ref = weakref.ref(model)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def pool_bytes_held() -> int:
    """Bytes of Megatron-FSDP's named global buffers that belong to double-buffer pools."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import get_global_memory_buffer

    total = 0
    for (name, _dtype), t in get_global_memory_buffer().buffer.items():
        # Persistent fallbacks ("*_not_fit_in_fixed_pool_*", "*_not_in_max_pool_*") are not pool.
        if name.startswith(POOL_PREFIXES) and "_not_" not in name:
            total += t.numel() * t.element_size()
    return total


def maxpool_stats(model: Any) -> dict[str, int] | None:
    """Summed ``MaxPoolAllocator.stats()`` (home misses, pool bytes), None without max-pool."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.allocator import (
        model_max_pool_allocators,
    )

    allocators = model_max_pool_allocators(model) if model is not None else []
    if not allocators:
        return None
    total: dict[str, int] = {}
    for alloc in allocators:
        for key, value in alloc.stats().items():
            total[key] = total.get(key, 0) + int(value)
    return total


def collect() -> dict[str, Any]:
    """The report of this process. On a pristine upstream tree (hfsdp/training/upstream_base.py) the
    fork's allocators and teardown are absent: no max-pool figures, and the graph is read where
    upstream's pretrain leaves it."""
    import torch

    from hfsdp.training import requirements, upstream_base
    from megatron.core import __version__ as megatron_version
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    model = _model_ref() if _model_ref is not None else None
    fork = upstream_base.active() is None
    if fork:
        from megatron.training import teardown

        # pretrain()'s teardown destroys the graphs before this runs ([Note: graphs before
        # communicators] in megatron/training/teardown.py) and says which it destroyed.
        destroyed = "training" in teardown.destroyed_graph_stages
    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        "peaks_from": "first training forward step" if model is not None else "process start",
        "pool_bytes_measured": pool_bytes_held(),
        "maxpool_stats": maxpool_stats(model) if fork else None,
        "cuda_graph_captured": FullCudaGraphWrapper.cuda_graph.get("training") is not None or (fork and destroyed),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "megatron_core": megatron_version if fork else f"{megatron_version} (pristine, {upstream_base.active()})",
        # What the run imported: TE's and Apex's versions (Apex as one line), and on 0.18.2 which optimizer,
        # multi-tensor kernels and gradient-accumulation fusion Megatron took ([Note: NVIDIA Apex]).
        "optional_packages": requirements.installed_versions(),
        "megatron_paths": requirements.megatron_paths() if fork else None,
    }


def rank_path(path: str, rank: int) -> str:
    return path if rank == 0 else f"{path}.rank{rank}"


def write_if_requested() -> str | None:
    """After ``pretrain``: write this rank's report; returns the path written (or None)."""
    path = os.environ.get(ENV)
    if not path:
        return None
    out = rank_path(path, int(os.environ.get("RANK", "0")))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_json_atomic(out, collect())  # a reader never sees half a report
    return out


PEAK_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def report_problem(doc: object) -> str | None:
    """Why ``doc`` is not a run report :func:`collect` writes (None when it is one)."""
    if not isinstance(doc, dict):
        return f"holds a JSON {type(doc).__name__}, not an object"
    if missing := [k for k in PEAK_KEYS if k not in doc]:
        return f"lacks {', '.join(missing)}"
    for key in (*PEAK_KEYS, "pool_bytes_measured"):
        value = doc.get(key)
        if (value is not None or key in PEAK_KEYS) and not _count(value):
            return f"has {key} {value!r}, not a whole number of bytes"
    stats = doc.get("maxpool_stats")
    if stats is not None and not (isinstance(stats, dict) and all(_count(v) for v in stats.values())):
        return f"has maxpool_stats {stats!r}, not counts by name"
    return None


def read(path: str, world_size: int) -> dict[str, Any]:
    """Rank 0's report with peaks and home misses taken as the maximum over every rank's.

    A file that is not a report (not JSON, not an object, peaks that are not byte counts) raises
    ``ValueError`` naming it; one that cannot be opened, ``OSError``."""
    reports = []
    for rank in range(world_size):
        name = rank_path(path, rank)
        if os.path.lexists(name) and (why := not_a_regular_file(name)):  # a named pipe would block the read
            raise ValueError(f"{name} {why}")
        with open(name) as f:
            try:
                doc = loads_strict(f.read())
            except ValueError as exc:  # JSONDecodeError, bytes that are not text, NaN, a key twice
                raise ValueError(f"{name} is not JSON ({exc})") from None
        if (problem := report_problem(doc)) is not None:
            raise ValueError(f"{name} {problem}")
        reports.append(doc)
    merged = dict(reports[0])
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        merged[key] = max(r[key] for r in reports)
    stats = [r["maxpool_stats"] for r in reports if r.get("maxpool_stats")]
    if stats:
        merged["maxpool_stats"] = {k: max(s.get(k, 0) for s in stats) for k in stats[0]}
    return merged
