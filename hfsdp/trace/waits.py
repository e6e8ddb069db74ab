"""What the host waited for: blocking CUDA calls of a torch.profiler trace vs the GPU work under them.

``idle.py`` explains GPU time with nothing running; this module explains host time stuck in a
blocking call: runtime or driver synchronizes, and ``cudaMemcpyAsync``, which blocks for
``.item()`` / ``.cpu()`` / ``.tolist()`` (copies to pageable memory). For every such call longer
than ``min_us`` it measures, over the call's span, the wall-clock time during which each class of
device work was running on any stream: ``nccl:<Collective>`` (e.g. ``nccl:AllGather``),
``compute`` or ``copy``. Classes can overlap each other, so their times need not add up to the
wait. Time over an all-gather kernel includes the transfer and any wait for other ranks to reach
the same collective. Each wait is also charged to the code that issued it: the innermost Python
frame (with ``with_stack``), else the innermost ``cpu_op``.

Standard library only; CLI: ``python -m hfsdp.trace.waits TRACE.json[.gz] [--steps N]``.
"""

from __future__ import annotations

import argparse
import bisect
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hfsdp.trace.idle import ThreadSegments
from hfsdp.trace.kernels import is_nccl_kernel
from hfsdp.trace.timeline import (
    DEVICE_CATEGORIES,
    SYNC_CALLS,
    intersection_length,
    read_trace,
    span,
    union,
    well_formed_events,
)
from hfsdp.usererror import positive, run_cli

BLOCKING_CALLS = SYNC_CALLS + ("cudaMemcpyAsync", "cuStreamSynchronize", "cuCtxSynchronize",
                               "cuEventSynchronize")
_COLLECTIVE = re.compile(r"ReduceScatter|AllReduce|AllGather|AllToAll|Broadcast|SendRecv|Reduce|Send|Recv")


def device_class(e: dict) -> str:
    """``nccl:AllGather`` for ``ncclDevKernel_AllGather_RING_LL`` etc.; else compute / copy."""
    name = e.get("name", "")
    if is_nccl_kernel(name):
        m = _COLLECTIVE.search(name)
        return "nccl:" + (m.group(0) if m else "other")
    return "copy" if e.get("cat") in ("gpu_memcpy", "gpu_memset") else "compute"


@dataclass
class WaitReport:
    calls: int = 0
    wait_us: float = 0.0
    # (blocking call, device class) -> wall time with that class running under the waits, us
    under: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    streams: dict[str, set] = field(default_factory=lambda: defaultdict(set))  # class -> streams
    # (blocking call, issuing frame or cpu_op) -> wait time, us
    by_site: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    # (issuing frame or cpu_op, device class) -> wall time with that class running, us
    site_under: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))


def attribute(events: Sequence[dict], min_us: float = 500.0) -> WaitReport:
    report = WaitReport()
    intervals: dict[str, list] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES and float(e.get("dur", 0)) > 0:
            cls = device_class(e)
            intervals[cls].append(span(e))
            report.streams[cls].add((e.get("args") or {}).get("stream", e.get("tid")))
    busy = {cls: union(v) for cls, v in intervals.items()}
    starts = {cls: [a for a, _ in merged] for cls, merged in busy.items()}
    threads = ThreadSegments(events)
    for w in events:
        if not (w.get("ph") == "X" and w.get("cat") in ("cuda_runtime", "cuda_driver")
                and w.get("name") in BLOCKING_CALLS and float(w.get("dur", 0)) > min_us):
            continue
        lo, hi = span(w)
        report.calls += 1
        report.wait_us += hi - lo
        seg = threads.at(w.get("tid"), lo)
        site = (seg.frame or seg.op or "(no enclosing event)") if seg else "(no enclosing event)"
        report.by_site[(w["name"], site)] += hi - lo
        for cls, merged in busy.items():
            # Merged intervals are disjoint and sorted: only those from the one covering lo on.
            i = max(0, bisect.bisect_right(starts[cls], lo) - 1)
            j = bisect.bisect_left(starts[cls], hi)
            overlap = intersection_length(merged[i:j], [(lo, hi)])
            if overlap > 0:
                report.under[(w["name"], cls)] += overlap
                report.site_under[(site, cls)] += overlap
    return report


def format_report(report: WaitReport, steps: int | None = None, top: int = 12,
                  min_us: float = 500.0) -> str:
    div = 1000.0 * (steps or 1)
    unit = "ms/step" if steps else "ms"
    lines = [f"host blocked {report.wait_us / div:.2f} {unit} in {report.calls} blocking CUDA "
             f"calls longer than {min_us:.0f} us",
             f"wall time with each device class running under those waits ({unit}; classes "
             "overlap):"]
    for (call, cls), us in sorted(report.under.items(), key=lambda kv: -kv[1])[:top]:
        streams = ",".join(str(x) for x in sorted(report.streams[cls], key=str))
        lines.append(f"  {us / div:9.2f}  {call:22s} {cls:20s} streams {streams}")
    lines.append(f"wait time by issuing code ({unit}; innermost python frame, else cpu_op):")
    for (call, site), us in sorted(report.by_site.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / div:9.2f}  {call:22s} {site[:120]}")
    lines.append(f"device class under the waits by issuing code ({unit}):")
    for (site, cls), us in sorted(report.site_under.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / div:9.2f}  {cls:20s} {site[:120]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("waits", lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=positive(), default=None, help="profiled steps (per-step numbers)")
    p.add_argument("--min-us", type=positive(float, zero=True), default=500.0, help="ignore shorter blocking calls")
    p.add_argument("--top", type=positive(), default=12)
    opts = p.parse_args(argv)
    with well_formed_events():
        report = attribute(read_trace(opts.trace), opts.min_us)
        print(format_report(report, opts.steps, opts.top, opts.min_us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
