"""Where the step time goes, from a torch.profiler Chrome trace: compute, exposed NCCL, idle, syncs.

The benchmark's profiling pass (``--profile-dir``) writes one trace per rank; this module reduces
it to a few numbers that decide between the explanations in docs/benchmark.md:

* ``gpu_idle_ms``: time in the kernel window with no kernel on any stream (host-bound gaps);
* ``exposed_nccl_ms``: NCCL kernel time not overlapped by any compute kernel (prefetch too shallow);
* ``host_sync_ms``: host time blocked in CUDA synchronize calls (a sync in a hot path);
* ``gpu_busy_ms``: the union of device intervals on all streams, the least a step can take.

Per profiled step when ``steps`` is given. Standard library only; CLI:
``python -m hfsdp.trace.timeline TRACE.json[.gz] [TRACE ...] [--steps N] [--step-ms MS]``: one
line per trace (one per rank); with several, rank 0's and the busiest rank's GPU-busy time, and
with ``--step-ms`` (the measured step) the step against the busiest rank's GPU-busy time.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence

from hfsdp.trace.kernels import is_nccl_kernel, kernel_time
from hfsdp.usererror import UserError, not_a_regular_file, positive, run_cli

# Host calls that block until the device catches up.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")

# Device activity; copies and memsets are not idle time.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

Interval = tuple[float, float]


def span(e: dict) -> Interval:
    """[start, end) of a Chrome-trace "X" event, in us."""
    start = float(e["ts"])
    return start, start + float(e.get("dur", 0))


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge overlapping [start, end) intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Sequence[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersection_length(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Total overlap of two merged interval lists (two-pointer sweep)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: Iterable[dict], steps: int | None = None) -> dict:
    """Reduce Chrome-trace events (``traceEvents``; times in us) to ms totals or per-step ms."""
    nccl: list[Interval] = []
    compute: list[Interval] = []
    syncs: dict[str, tuple[int, float]] = {}  # name -> (calls, us)
    for e in events:
        if e.get("ph") != "X":
            continue
        interval = span(e)
        if e.get("cat") in DEVICE_CATEGORIES:
            (nccl if is_nccl_kernel(e.get("name", "")) else compute).append(interval)
        elif e.get("cat") == "cuda_runtime" and e.get("name") in SYNC_CALLS:
            count, us = syncs.get(e["name"], (0, 0.0))
            syncs[e["name"]] = (count + 1, us + interval[1] - interval[0])
    nccl_u, compute_u = union(nccl), union(compute)
    everything = union(nccl_u + compute_u)
    window = (everything[-1][1] - everything[0][0]) if everything else 0.0
    div = 1000.0 * (steps or 1)  # us -> ms, per step
    return {
        "per_step": steps is not None,
        "kernel_window_ms": window / div,
        "compute_busy_ms": length(compute_u) / div,
        "nccl_busy_ms": length(nccl_u) / div,
        "exposed_nccl_ms": (length(nccl_u) - intersection_length(nccl_u, compute_u)) / div,
        "gpu_idle_ms": (window - length(everything)) / div,
        "gpu_busy_ms": length(everything) / div,
        "host_sync_ms": sum(us for _, us in syncs.values()) / div,
        "host_sync_calls": {name: count for name, (count, _) in sorted(syncs.items())},
    }


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def format_summary(s: dict) -> str:
    unit = "ms/step" if s["per_step"] else "ms"
    keys = ("kernel_window_ms", "gpu_busy_ms", "compute_busy_ms", "nccl_busy_ms", "exposed_nccl_ms",
            "gpu_idle_ms", "host_sync_ms")
    return "  ".join(f"{k[:-3]}={s[k]:.2f}" for k in keys) + f" ({unit}); syncs {s['host_sync_calls']}"


def busy_report(per_trace: dict[str, dict], step_ms: float | None = None) -> list[str]:
    """Rank 0's (the first trace's) and the busiest trace's GPU-busy time; with ``step_ms``, the
    measured step against the busiest one (a step longer than its GPU work waits on the host)."""
    first = next(iter(per_trace))
    busiest = max(per_trace, key=lambda name: per_trace[name]["gpu_busy_ms"])
    unit = "ms/step" if per_trace[first]["per_step"] else "ms"
    lines = [f"GPU busy: {first} {per_trace[first]['gpu_busy_ms']:.2f} {unit}; busiest {busiest} "
             f"{per_trace[busiest]['gpu_busy_ms']:.2f} {unit}"]
    if step_ms is not None and per_trace[busiest]["gpu_busy_ms"] > 0:
        ratio = step_ms / per_trace[busiest]["gpu_busy_ms"]
        lines.append(f"step {step_ms:.2f} ms = {ratio:.3f} x the busiest rank's GPU-busy time")
    return lines


def read_trace(path: str) -> list[dict]:
    """:func:`load_events` of a file a user named; what is not a Chrome trace is one sentence."""
    if why := not_a_regular_file(path):
        raise UserError(f"trace {path} {why}", "give the .json or .json.gz files a profiling run wrote")
    try:
        events = load_events(path)
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"trace {path} is not a readable Chrome trace ({type(exc).__name__}: {exc})",
                        "give the .json or .json.gz files a profiling run wrote") from None
    except (KeyError, TypeError):
        events = None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise UserError(f"trace {path} holds no list of trace events",
                        "give the .json or .json.gz files a profiling run wrote")
    for index, event in enumerate(events):
        if problem := _time_problem(event):
            raise UserError(f"trace {path}: event {index} ({str(event.get('name'))[:60]!r}) {problem}",
                            "give the .json or .json.gz files a profiling run wrote")
    return events


def _time_problem(event: dict) -> str | None:
    """What is wrong with an event's times, as the profiler writes them: ``ts`` and ``dur`` are
    finite numbers, ``dur`` not negative (a string, a bool, NaN or a negative span would be
    summed as if it were time)."""
    for key in ("ts", "dur"):
        if key not in event:
            continue
        value = event[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"has {key} {value!r}, not a finite number of microseconds"
        if key == "dur" and value < 0:
            return f"has a negative dur ({value})"
    return None


def regex(text: str) -> str:
    """argparse ``type=``: a regular expression that compiles (argparse then names the option)."""
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid regular expression ({exc})") from None
    return text


@contextlib.contextmanager
def well_formed_events() -> Iterator[None]:
    """Around the reduction of traces a user named: an event without a number where one belongs
    is one sentence."""
    try:
        yield
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"a trace event lacks a number where one belongs ({type(exc).__name__}: {exc})",
                        "give the .json or .json.gz files a profiling run wrote") from None


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("timeline", lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", metavar="trace", help="one trace per rank, rank 0 first")
    p.add_argument("--steps", type=positive(), default=None, help="profiled steps (per-step numbers)")
    p.add_argument("--step-ms", type=positive(float), default=None,
                   help="the measured step time, compared with the GPU-busy time (use with --steps)")
    p.add_argument("--top", type=int, default=0, metavar="N",
                   help="also print the first trace's device time by kernel class and its N longest kernels")
    opts = p.parse_args(argv)
    if opts.top < 0:
        p.error(f"--top {opts.top}: give how many kernels to list, 0 or more")
    with well_formed_events():
        events = {path: read_trace(path) for path in opts.traces}
        per_trace = {path: summarize(evs, opts.steps) for path, evs in events.items()}
        classes, names = kernel_time(next(iter(events.values())), opts.steps) if opts.top else ({}, [])
    for path, summary in per_trace.items():
        print(f"{path}: {format_summary(summary)}")
    print("\n".join(busy_report(per_trace, opts.step_ms)))
    if opts.top:
        unit = "ms/step" if opts.steps else "ms"
        print(f"{opts.traces[0]}: device time by kernel class, summed over streams ({unit}): "
              + ", ".join(f"{cls} {ms:.1f}" for cls, ms in classes.items()))
        for name, ms, launches in names[:opts.top]:
            print(f"  {ms:9.2f} {unit} {launches:7.1f} launches  {name[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
