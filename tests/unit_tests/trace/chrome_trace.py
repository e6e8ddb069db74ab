"""Chrome-trace event builder shared by the trace-analysis tests (idle, waits, hostdiff)."""

from __future__ import annotations


def X(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None,
      stream: int | None = None) -> dict:
    """A complete ("X") event; ``corr`` / ``stream`` go into ``args`` as the profiler writes them."""
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    args = {k: v for k, v in (("correlation", corr), ("stream", stream)) if v is not None}
    if args:
        e["args"] = args
    return e
