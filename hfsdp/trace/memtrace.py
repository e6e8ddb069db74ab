"""Where the peak-allocated bytes go: replay the CUDA caching allocator's trace to the peak.

The benchmark compares ``torch.cuda.max_memory_allocated()`` across configurations; this module
says *what was live* at that peak, grouped by who allocated it. The worker records the allocator's
history (``--memory-trace-dir``) from the first training step to the end, then
:func:`peak_live_set` replays the trace: ``alloc`` adds a block, ``free_requested`` removes it
(the allocator's statistics drop at the request). Trace sizes are requested bytes, so the
baseline is taken in requested bytes too; ``max_memory_allocated`` counts rounded blocks and reads
a little higher. If the trace outgrew ``max_entries`` its oldest entries are gone and the result
is marked ``truncated``.
Pure Python over plain dicts, so it is tested on CPU with synthetic traces.

The snapshot itself is also written as the pickle ``torch.cuda.memory._dump_snapshot`` writes, so
PyTorch's own viewer (https://pytorch.org/memory_viz, or ``python -m torch.cuda._memory_viz
trace_plot FILE``) opens it: timelines and stacks of every block. That viewer draws the trace;
it does not name what was live at the peak, which is this module's job.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

# Rules in priority order (the first whose file appears anywhere in the stack wins), so a pooled
# bucket reads "max-pool" even though param_and_grad_buffer.py called the allocator.
CATEGORY_RULES: Sequence[tuple[str, str]] = (
    ("double_buffer/allocator.py", "max-pool arena"),
    ("param_and_grad_buffer.py", "FSDP bucket (non-pooled)"),
    ("/optimizer/", "optimizer"),
    ("nccl", "NCCL"),
)
MIB = 1024 * 1024


def categorize(frames: Sequence[dict]) -> str:
    """Category of an allocation from its Python frames (innermost first, as torch records them)."""
    for needle, label in CATEGORY_RULES:
        if any(needle in f.get("filename", "") for f in frames):
            return label
    for f in frames:  # innermost frame inside our code or Megatron
        name = f.get("filename", "")
        if "/megatron/" in name or "/hfsdp/" in name:
            return f"{os.path.basename(name)}:{f.get('name', '?')}"
    return "other (no Megatron frame)"


def peak_live_set(trace: Iterable[dict], baseline_bytes: int = 0,
                  max_entries: int | None = None) -> dict:
    """Replay ``trace`` (one device's TraceEntry dicts); the live bytes per category at the peak.

    ``baseline_bytes`` is what was allocated before recording began (model, optimizer state);
    it is reported as its own line. Returns ``{"peak_bytes", "peak_index", "categories":
    [(category, bytes), ...] largest first, "entries"}``.
    """
    live: dict[int, tuple[int, str]] = {}
    base = baseline_bytes  # shrinks when a block allocated before recording is freed
    total = best = base
    best_index = -1
    best_live: dict[int, tuple[int, str]] = {}
    best_base = base
    entries = 0
    for i, e in enumerate(trace):
        entries += 1
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], categorize(e.get("frames") or []))
            total += e["size"]
            if total > best:
                best, best_index, best_live, best_base = total, i, dict(live), base
        elif action == "free_requested":
            if e["addr"] in live:
                total -= live.pop(e["addr"])[0]
            else:  # allocated before recording: its size comes with the free
                base -= e.get("size", 0)
                total -= e.get("size", 0)
    by_cat: dict[str, int] = {}
    for size, cat in best_live.values():
        by_cat[cat] = by_cat.get(cat, 0) + size
    if best_base:
        by_cat["allocated before recording (params, optimizer, ...)"] = best_base
    return {
        "peak_bytes": best,
        "peak_index": best_index,
        "entries": entries,
        "truncated": max_entries is not None and entries >= max_entries,
        "categories": sorted(by_cat.items(), key=lambda kv: -kv[1]),
    }


def format_summary(summary: dict, top: int = 15) -> str:
    lines = [f"peak allocated {summary['peak_bytes'] / MIB:,.1f} MiB (requested bytes) at trace "
             f"entry {summary['peak_index']} of {summary['entries']}; live then, by allocator:"]
    if summary.get("truncated"):
        lines.insert(0, "WARNING: trace truncated at max_entries; the oldest allocations are missing")
    for cat, size in summary["categories"][:top]:
        lines.append(f"  {size / MIB:12,.1f} MiB  {cat}")
    return "\n".join(lines)


MAX_ENTRIES = 2_000_000


def start_recording(max_entries: int = MAX_ENTRIES) -> int:
    """Begin recording (Python stacks); returns the requested bytes already allocated."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries)
    stats = torch.cuda.memory_stats()
    return int(stats.get("requested_bytes.all.current", torch.cuda.memory_allocated()))


def write_snapshot(snapshot: dict[str, Any], path: str) -> None:
    """``snapshot`` as the pickle ``torch.cuda.memory._dump_snapshot`` writes (memory_viz input)."""
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


def stop_and_summarize(baseline_bytes: int, max_entries: int = MAX_ENTRIES,
                       snapshot_path: str | None = None) -> dict[str, Any]:
    """Stop recording and summarize this device's trace; also pickle it to ``snapshot_path``."""
    import torch

    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if snapshot_path is not None:
        write_snapshot(snap, snapshot_path)
    traces = snap.get("device_traces") or [[]]
    trace = traces[torch.cuda.current_device()] if len(traces) > 1 else traces[0]
    return peak_live_set(trace, baseline_bytes, max_entries)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hfsdp.trace.memtrace``: there is nothing to run here, which is said, not passed over."""
    from hfsdp.usererror import UserError, run_cli

    def refuse() -> int:
        raise UserError("hfsdp.trace.memtrace has no command line: the benchmark's workers call it",
                        "give scripts/benchmark_double_buffer.py --memory-trace-dir DIR; each rank's peak live set "
                        "is then in DIR/*.memtrace.txt")

    return run_cli("memtrace", refuse)


if __name__ == "__main__":
    raise SystemExit(main())
