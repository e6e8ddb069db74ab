"""Who kept the GPU waiting: attribute each GPU-idle gap of a torch.profiler trace to host code.

``timeline.py`` says how long the GPU sat idle; this module says why. For every gap between
device activity (kernels, copies, memsets on any stream) inside the kernel window it finds the
device event that ends the gap and, through its ``correlation`` id, the host call that launched
it. Then it classifies the gap:

* ``host_late``: the launch call started after the gap began, so the GPU had nothing queued.
  The time from the gap start to the launch is charged to what the launching thread was doing
  then: its innermost host event (``leaf``), the innermost ``cpu_op`` around it, and the
  innermost Python frame (``python_function`` events, present when the profile was taken with
  ``with_stack=True``; built-in functions are skipped, since "getattr" says nothing).
* ``queued``: the work was launched before the gap began. The GPU waited on something other than
  the host (a stream dependency, or launch latency).
* ``launch_latency``: within a host-late gap, the time from the launch call to the kernel start.
* ``unknown``: the ending event has no correlated launch in the trace.

Standard library only; CLI: ``python -m hfsdp.trace.idle TRACE.json[.gz] [--steps N] [--top K]``.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from hfsdp.trace.timeline import DEVICE_CATEGORIES, read_trace, span, union, well_formed_events
from hfsdp.usererror import positive, run_cli

HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class Segment:
    """A stretch of one host thread with a fixed innermost event (times in us)."""

    start: float
    end: float
    leaf: str
    op: str  # innermost cpu_op around the leaf ("" if none)
    frame: str  # innermost python_function around the leaf ("" if none)


@dataclass
class IdleReport:
    idle_us: float = 0.0
    gaps: int = 0
    by_kind: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_leaf: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_op: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_frame: dict[str, float] = field(default_factory=lambda: defaultdict(float))


Stack = list[tuple[float, str, str]]  # open host events, outermost first: (end, cat, name)


def nested(events: Iterable[dict]) -> Iterator[tuple[float, float, Stack]]:
    """One thread's nested host events as consecutive non-overlapping intervals ``[lo, hi)``, each
    with the events open over it. One sweep: the stack is one list, changed between yields, so a
    trace with a deep Python stack on every event costs no more than its events (read what you
    need from it before the next one). Times with nothing open are skipped.

    Events are assumed properly nested (the profiler's per-thread events are); a child that
    outlives its parent is clipped to the parent's end.
    """
    spans = sorted(((*span(e), str(e.get("cat", "")), str(e.get("name", ""))) for e in events),
                   key=lambda s: (s[0], -s[1]))
    stack: Stack = []
    cursor: float | None = None
    for start, end, cat, name in itertools.chain(spans, [(math.inf, math.inf, "", "")]):  # the last closes all
        while stack and stack[-1][0] <= start:  # close everything that ended before this one
            top = stack[-1][0]
            if cursor is not None and top > cursor:
                yield cursor, top, stack
            cursor = top if cursor is None else max(cursor, top)
            stack.pop()
        if start == math.inf:
            return
        if stack and cursor is not None and start > cursor:
            yield cursor, start, stack
        cursor = start
        stack.append((min(end, stack[-1][0]) if stack else end, cat, name))


def innermost(stack: Stack, cat: str, name: Callable[[str], bool] = lambda n: True) -> str | None:
    """The name of the innermost open event of category ``cat`` whose name passes ``name``."""
    return next((n for _, c, n in reversed(stack) if c == cat and name(n)), None)


def flatten(events: Iterable[dict]) -> list[Segment]:
    """Non-overlapping segments of one thread's nested host events (``nested``), innermost event named."""
    return [Segment(lo, hi, stack[-1][2], innermost(stack, "cpu_op") or "",
                    innermost(stack, "python_function", lambda n: not n.startswith("<built-in")) or "")
            for lo, hi, stack in nested(events)]


class ThreadSegments:
    """Host segments (``flatten``) per thread, built on first use of each thread."""

    def __init__(self, events: Iterable[dict]):
        self._events: dict[object, list[dict]] = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES:
                self._events[e.get("tid")].append(e)
        self._flat: dict[object, tuple[list[Segment], list[float]]] = {}

    def segments(self, tid: object) -> tuple[list[Segment], list[float]]:
        """(segments, their start times) of thread ``tid``, in time order."""
        if tid not in self._flat:
            segs = flatten(self._events.get(tid, ()))
            self._flat[tid] = (segs, [s.start for s in segs])
        return self._flat[tid]

    def at(self, tid: object, ts: float) -> Segment | None:
        """The segment of thread ``tid`` that covers time ``ts``, if any."""
        segs, starts = self.segments(tid)
        i = bisect.bisect_right(starts, ts) - 1
        return segs[i] if 0 <= i < len(segs) and segs[i].end > ts else None


def _charge(segments: list[Segment], starts: list[float], lo: float, hi: float,
            report: IdleReport) -> float:
    """Add the overlap of ``segments`` with [lo, hi) to the report; return the time covered."""
    covered = 0.0
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(segments) and segments[i].start < hi:
        s = segments[i]
        overlap = min(hi, s.end) - max(lo, s.start)
        if overlap > 0:
            covered += overlap
            report.by_leaf[s.leaf] += overlap
            report.by_op[s.op or "(no cpu_op)"] += overlap
            report.by_frame[s.frame or "(no python frame)"] += overlap
        i += 1
    return covered


def _ending_launch(by_start: list[dict], starts: list[float], gap_hi: float,
                   launches: dict[object, tuple[float, object]]) -> tuple[float, object] | None:
    """Launch (ts, tid) of the device work that ends a gap.

    Several records may start at ``gap_hi``; the latest-launched one with a known launch decides,
    so input order does not, and an uncorrelated memset beside a late kernel does not hide it.
    """
    found = None
    j = bisect.bisect_left(starts, gap_hi)
    while j < len(by_start) and starts[j] == gap_hi:
        launch = launches.get((by_start[j].get("args") or {}).get("correlation"))
        if launch is not None and (found is None or launch[0] > found[0]):
            found = launch
        j += 1
    return found


def attribute(events: Sequence[dict]) -> IdleReport:
    """Classify and attribute every GPU-idle gap in the trace (see module docstring)."""
    # Zero-length device records would split a gap in two without being device work.
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
              and float(e.get("dur", 0)) > 0]
    launches: dict[object, tuple[float, object]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = (float(e["ts"]), e.get("tid"))
    threads = ThreadSegments(events)
    report = IdleReport()
    if not device:
        return report
    busy = union(span(e) for e in device)
    # Device events sorted by start: the gap's ending event is the first starting at its end.
    by_start = sorted(device, key=lambda e: float(e["ts"]))
    starts = [float(e["ts"]) for e in by_start]
    for (_, gap_lo), (gap_hi, _) in itertools.pairwise(busy):
        width = gap_hi - gap_lo
        report.idle_us += width
        report.gaps += 1
        launch = _ending_launch(by_start, starts, gap_hi, launches)
        if launch is None:
            report.by_kind["unknown"] += width
            continue
        launch_ts, tid = launch
        if launch_ts <= gap_lo:
            report.by_kind["queued"] += width
            continue
        host_part = min(launch_ts, gap_hi) - gap_lo
        report.by_kind["host_late"] += host_part
        report.by_kind["launch_latency"] += width - host_part
        segs, seg_starts = threads.segments(tid)
        covered = _charge(segs, seg_starts, gap_lo, gap_lo + host_part, report)
        if host_part - covered > 0:
            report.by_leaf["(no host event)"] += host_part - covered
            report.by_op["(no host event)"] += host_part - covered
            report.by_frame["(no host event)"] += host_part - covered
    return report


def format_report(report: IdleReport, steps: int | None = None, top: int = 12) -> str:
    div = 1000.0 * (steps or 1)
    unit = "ms/step" if steps else "ms"
    lines = [f"GPU idle {report.idle_us / div:.2f} {unit} in {report.gaps} gaps; by kind: "
             + ", ".join(f"{k}={v / div:.2f}" for k, v in sorted(report.by_kind.items()))]
    for title, table in (("host leaf event", report.by_leaf), ("innermost cpu_op", report.by_op),
                         ("innermost python frame", report.by_frame)):
        lines.append(f"host_late time by {title} ({unit}):")
        for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {us / div:9.2f}  {name[:150]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("idle", lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=positive(), default=None, help="profiled steps (per-step numbers)")
    p.add_argument("--top", type=positive(), default=12)
    opts = p.parse_args(argv)
    with well_formed_events():
        print(format_report(attribute(read_trace(opts.trace)), opts.steps, opts.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
