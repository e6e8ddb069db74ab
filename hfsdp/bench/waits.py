"""What the host waited for: blocking CUDA calls of a torch.profiler trace vs the GPU work under them.

``idle.py`` explains GPU time with nothing running; this module explains host time stuck in a
blocking call (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and
``cudaMemcpyAsync`` to or from pageable memory, which is what ``.item()`` / ``.cpu()`` /
``.tolist()`` issue). For every such call longer than ``min_us`` it sums, over the call's span,
the device work running on each stream, by class: ``nccl:<Collective>`` (e.g. ``nccl:AllGather``)
or ``compute``/``copy``. A wait over an all-gather kernel is a wait on the other ranks reaching
the same collective. Each wait is also charged to the code that issued it: the innermost Python
frame (with ``with_stack``) or ``cpu_op`` around the call.

Standard library only; CLI: ``python -m hfsdp.bench.waits TRACE.json[.gz] [--steps N]``.
"""

from __future__ import annotations

import argparse
import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from hfsdp.bench.idle import HOST_CATEGORIES, flatten
from hfsdp.bench.kernels import is_nccl_kernel
from hfsdp.bench.timeline import DEVICE_CATEGORIES, SYNC_CALLS, load_events, span

BLOCKING_CALLS = SYNC_CALLS + ("cudaMemcpyAsync",)


def device_class(e: dict) -> str:
    """``nccl:AllGather`` for ``ncclDevKernel_AllGather_RING_LL`` etc.; else compute / copy."""
    name = e.get("name", "")
    if is_nccl_kernel(name):
        parts = name.split("_")
        return "nccl:" + (parts[1] if len(parts) > 1 else name)
    return "copy" if e.get("cat") in ("gpu_memcpy", "gpu_memset") else "compute"


@dataclass
class WaitReport:
    calls: int = 0
    wait_us: float = 0.0
    # (blocking call, device class, stream) -> device time under the waits, us
    under: dict[tuple[str, str, object], float] = field(default_factory=lambda: defaultdict(float))
    # (blocking call, issuing frame or cpu_op) -> wait time, us
    by_site: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))


def attribute(events: Sequence[dict], min_us: float = 500.0) -> WaitReport:
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
                     and float(e.get("dur", 0)) > 0), key=lambda e: float(e["ts"]))
    dev_starts = [float(e["ts"]) for e in device]
    longest = max((float(e["dur"]) for e in device), default=0.0)
    waits = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
             and e.get("name") in BLOCKING_CALLS and float(e.get("dur", 0)) > min_us]
    host_by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES:
            host_by_tid[e.get("tid")].append(e)
    flat: dict[object, tuple[list, list[float]]] = {}
    report = WaitReport()
    for w in waits:
        lo, hi = span(w)
        report.calls += 1
        report.wait_us += hi - lo
        # Device records that can overlap [lo, hi): start in [lo - longest, hi).
        j = bisect.bisect_left(dev_starts, lo - longest)
        while j < len(device) and dev_starts[j] < hi:
            d_lo, d_hi = span(device[j])
            overlap = min(hi, d_hi) - max(lo, d_lo)
            if overlap > 0:
                report.under[(w["name"], device_class(device[j]),
                              (device[j].get("args") or {}).get("stream", device[j].get("tid")))] += overlap
            j += 1
        tid = w.get("tid")
        if tid not in flat:
            segs = flatten(host_by_tid.get(tid, ()))
            flat[tid] = (segs, [s.start for s in segs])
        segs, starts = flat[tid]
        i = bisect.bisect_right(starts, lo) - 1
        seg = segs[i] if 0 <= i < len(segs) and segs[i].end > lo else None
        site = (seg.frame or seg.op or "(no enclosing event)") if seg else "(no enclosing event)"
        report.by_site[(w["name"], site)] += hi - lo
    return report


def format_report(report: WaitReport, steps: int | None = None, top: int = 12,
                  min_us: float = 500.0) -> str:
    div = 1000.0 * (steps or 1)
    unit = "ms/step" if steps else "ms"
    lines = [f"host blocked {report.wait_us / div:.2f} {unit} in {report.calls} blocking CUDA "
             f"calls longer than {min_us:.0f} us",
             f"device work running under those waits ({unit}; call, device class, stream):"]
    for (call, cls, stream), us in sorted(report.under.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / div:9.2f}  {call:22s} {cls:20s} stream {stream}")
    lines.append(f"wait time by issuing code ({unit}; innermost python frame, else cpu_op):")
    for (call, site), us in sorted(report.by_site.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / div:9.2f}  {call:22s} {site[:120]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=None, help="profiled steps (per-step numbers)")
    p.add_argument("--min-us", type=float, default=500.0, help="ignore shorter blocking calls")
    p.add_argument("--top", type=int, default=12)
    opts = p.parse_args(argv)
    report = attribute(load_events(opts.trace), opts.min_us)
    print(format_report(report, opts.steps, opts.top, opts.min_us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
