"""Which code launched a step's device time: every kernel charged to its host call site.

``timeline --top`` names the kernels a step spends its time in; a name like
``direct_copy_kernel_cuda`` does not say whose copy it is. This module follows each kernel's
``correlation`` id to the host call that launched it and charges the kernel's device time to
what the launching thread was inside then: the innermost ``cpu_op`` (``aten::copy_``) and the
innermost Python frame that matches ``--frames`` (present when the profile was taken with
``with_stack=True``: the bench worker's ``--profile-stack``). Kernels replayed from a CUDA graph
have no launch of their own, so profile the eager twin of a graphed configuration.

[Note: launch attribution]
A kernel is charged once, in full, to one (class, cpu_op, frame) row, so the rows of a class
add up to that class's time in ``timeline --top`` (kernels without a correlated launch form the
row ``(no launch)``). Time is summed over streams, as ``timeline --top`` sums it. The frame is
the innermost one matching the pattern, not merely the innermost: the innermost frame of an
``aten::copy_`` is usually ``torch/nn/modules/module.py``, which says nothing.

Standard library only; CLI: ``python -m hfsdp.trace.launchers TRACE.json[.gz] [--steps N]
[--classes C,...] [--frames RE] [--top K]``.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence

from hfsdp.trace.idle import HOST_CATEGORIES, LAUNCH_CATEGORIES, innermost, nested
from hfsdp.trace.kernels import KERNEL_CLASSES, kernel_class
from hfsdp.trace.timeline import read_trace, regex, well_formed_events
from hfsdp.usererror import UserError, positive, run_cli

# Our code and the libraries whose calls a user can change or report: the default --frames.
DEFAULT_FRAMES = r"megatron/|hfsdp/|transformer_engine/|mamba_ssm/|causal_conv1d/|apex/"
NO_LAUNCH = "(no launch)"
NO_CPU_OP = "(no cpu_op)"


def sites(events: Iterable[dict], at: Sequence[float], frames: re.Pattern[str]) -> dict[float, tuple[str, str]]:
    """For each time in ``at``: (innermost cpu_op, innermost Python frame matching ``frames``) of
    one thread's host events open then (``idle.nested``: one sweep)."""
    times = sorted(set(at))
    out: dict[float, tuple[str, str]] = {}
    j = 0
    for lo, hi, stack in nested(events):
        while j < len(times) and times[j] < lo:
            out[times[j]] = (NO_CPU_OP, "")
            j += 1
        if j < len(times) and times[j] < hi:
            where = (innermost(stack, "cpu_op") or NO_CPU_OP,
                     innermost(stack, "python_function", lambda n: bool(frames.search(n))) or "")
            while j < len(times) and times[j] < hi:
                out[times[j]] = where
                j += 1
    out.update((t, (NO_CPU_OP, "")) for t in times[j:])
    return out


def attribute(events: Sequence[dict], frames: str = DEFAULT_FRAMES) -> dict[tuple[str, str, str], list[float]]:
    """{(kernel class, cpu_op, frame): [device us, kernels]} over the trace's kernels ([Note:
    launch attribution])."""
    launches: dict[object, tuple[float, object]] = {}
    host: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in LAUNCH_CATEGORIES and (corr := (e.get("args") or {}).get("correlation")) is not None:
            launches[corr] = (float(e["ts"]), e.get("tid"))
        if e.get("cat") in HOST_CATEGORIES:
            host[e.get("tid")].append(e)
    kernels = [(e, launches.get((e.get("args") or {}).get("correlation")))
               for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    wanted: dict[object, list[float]] = defaultdict(list)
    for _, launch in kernels:
        if launch is not None:
            wanted[launch[1]].append(launch[0])
    pattern = re.compile(frames)
    found = {tid: sites(host.get(tid, ()), at, pattern) for tid, at in wanted.items()}
    rows: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e, launch in kernels:
        where = (NO_LAUNCH, "") if launch is None else found[launch[1]][launch[0]]
        row = rows[(kernel_class(str(e.get("name", ""))), *where)]
        row[0] += float(e.get("dur", 0))
        row[1] += 1
    return dict(rows)


def format_rows(rows: dict[tuple[str, str, str], list[float]], steps: int | None = None,
                classes: Sequence[str] = (), top: int = 20) -> list[str]:
    """The ``top`` rows of each class (all classes when none are named), largest first."""
    div, unit = 1000.0 * (steps or 1), ("ms/step" if steps else "ms")
    totals: dict[str, float] = defaultdict(float)
    for (cls, _, _), (us, _) in rows.items():
        totals[cls] += us
    lines = []
    for cls in sorted(totals, key=lambda c: -totals[c]):
        if classes and cls not in classes:
            continue
        lines.append(f"{cls}: {totals[cls] / div:.2f} {unit}")
        mine = sorted(((k, v) for k, v in rows.items() if k[0] == cls), key=lambda kv: -kv[1][0])
        for (_, op, frame), (us, n) in mine[:top]:
            lines.append(f"  {us / div:9.2f} {unit} {n / (steps or 1):8.1f} kernels  {op[:40]:40s}  {frame[:110]}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("launchers", lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a torch.profiler Chrome trace (.json or .json.gz) of eager steps")
    p.add_argument("--steps", type=positive(), default=None, help="profiled steps (per-step numbers)")
    p.add_argument("--classes", default="", metavar="C,...",
                   help=f"only these kernel classes ({', '.join(c for c, _ in KERNEL_CLASSES)}, other)")
    p.add_argument("--frames", type=regex, default=DEFAULT_FRAMES, metavar="RE",
                   help=f"a Python frame counts when its name matches RE (default {DEFAULT_FRAMES!r})")
    p.add_argument("--top", type=positive(), default=20, help="rows per class (default 20)")
    opts = p.parse_args(argv)
    known = {c for c, _ in KERNEL_CLASSES} | {"other"}
    classes = [c.strip() for c in opts.classes.split(",") if c.strip()]
    if unknown := [c for c in classes if c not in known]:
        raise UserError(f"--classes names {', '.join(map(repr, unknown))}, not a kernel class",
                        f"use some of: {', '.join(sorted(known))}")
    with well_formed_events():
        rows = attribute(read_trace(opts.trace), opts.frames)
    if not rows:
        raise UserError(f"{opts.trace} holds no kernel events",
                        "give a trace taken with CUDA activity (the bench worker's --profile-dir)")
    print("\n".join(format_rows(rows, opts.steps, classes, opts.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
