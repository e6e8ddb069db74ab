"""Host time by function, configuration B minus configuration A, from two torch.profiler traces.

Every host event (Python frame with ``with_stack``, ``cpu_op``, CUDA runtime/driver call, user
annotation) is summed by name as *inclusive* time; a name already on the stack (recursion) is not
counted again. Addresses (``... at 0x7f..``) are stripped so the two traces' names match. With
``under``, only events below an ancestor whose name matches that regex count: "what inside
``_pre_forward_param_unshard`` got slower". Rows are sorted by B - A.

Standard library only; CLI:
``python -m hfsdp.trace.hostdiff A.json.gz B.json.gz [--steps N] [--under RE] [--match RE]``.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from hfsdp.trace.idle import HOST_CATEGORIES
from hfsdp.trace.timeline import read_trace, regex, span, well_formed_events
from hfsdp.usererror import positive, run_cli

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def normalize(name: str) -> str:
    return _ADDRESS.sub("", name)


# (inclusive us, calls) by normalized frame or op name.
Totals = tuple[defaultdict[str, float], Counter[str]]


def inclusive(events: Iterable[dict], under: str | None = None,
              all_threads: bool = False) -> Totals:
    """(inclusive us, calls) by normalized name, per the module docstring.

    Only threads that ran a ``cpu_op`` count unless ``all_threads``: idle background threads
    (compile workers, progress monitors) otherwise top the list with the trace length.
    """
    anc = re.compile(under) if under else None
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES:
            by_tid[e.get("tid")].append(e)
    total: defaultdict[str, float] = defaultdict(float)  # inclusive us
    calls: Counter[str] = Counter()
    for evs in by_tid.values():
        if not all_threads and not any(e.get("cat") == "cpu_op" for e in evs):
            continue
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        stack: list[tuple[float, str]] = []  # (end clipped to the parent's, normalized name)
        for e in evs:
            start, end = span(e)
            while stack and stack[-1][0] <= start:
                stack.pop()
            end = min(end, stack[-1][0]) if stack else end  # as idle.flatten clips
            name = normalize(e.get("name", ""))
            names = [n for _, n in stack]
            if anc is None or any(anc.search(n) for n in names):
                calls[name] += 1
                if name not in names:
                    total[name] += end - start
            stack.append((end, name))
    return total, calls


def diff_rows(a: Totals, b: Totals,
              match: str | None = None) -> list[tuple[str, float, float, int, int]]:
    """(name, A us, B us, A calls, B calls), largest B - A first."""
    pat = re.compile(match) if match else None
    names = [n for n in set(a[0]) | set(b[0]) if pat is None or pat.search(n)]
    names.sort(key=lambda n: (-(b[0][n] - a[0][n]), n))
    return [(n, a[0][n], b[0][n], a[1][n], b[1][n]) for n in names]


def format_rows(rows: Sequence[tuple[str, float, float, int, int]], steps: int | None = None,
                top: int = 30) -> str:
    div = 1000.0 * (steps or 1)
    unit = "ms/step" if steps else "ms"
    lines = [f"{'B-A':>9s} {'A':>9s} {'B':>9s} {'calls A':>8s} {'calls B':>8s}  inclusive host "
             f"time ({unit})"]
    for name, ta, tb, ca, cb in rows[:top]:
        lines.append(f"{(tb - ta) / div:9.2f} {ta / div:9.2f} {tb / div:9.2f} {ca:8d} {cb:8d}  "
                     f"{name[:120]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hostdiff", lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="baseline trace (e.g. no_db)")
    p.add_argument("b", help="compared trace (e.g. maxpool)")
    p.add_argument("--steps", type=positive(), default=None, help="profiled steps (per-step numbers)")
    p.add_argument("--under", type=regex, default=None, help="only events below an ancestor matching this regex")
    p.add_argument("--match", type=regex, default=None, help="only names matching this regex")
    p.add_argument("--all-threads", action="store_true",
                   help="also count threads that ran no cpu_op (background threads)")
    p.add_argument("--top", type=positive(), default=30)
    opts = p.parse_args(argv)
    with well_formed_events():
        a = inclusive(read_trace(opts.a), opts.under, opts.all_threads)
        b = inclusive(read_trace(opts.b), opts.under, opts.all_threads)
        print(format_rows(diff_rows(a, b, opts.match), opts.steps, opts.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
