"""How far one configuration's lm loss strays from another's, step by step, in a benchmark's JSON.

For changed numerics (FP8 against bf16) that cannot be bit-identical: the runs of a benchmark
invocation on an indexed dataset (``--data-path``, [Note: data for loss comparisons] in
hfsdp/bench/markov_data.py) carry every step's lm loss. Per step, the relative difference is
``(loss - baseline) / baseline``, against the baseline configuration's first repeat; the verdict
is the largest ``|difference|`` from ``--from-step`` on against ``--max-rel``. Exit status 0 when
it holds, 1 when not, 2 for bad input.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hfsdp.atomic import loads_strict
from hfsdp.bench.results import RunResult, run_from_dict
from hfsdp.usererror import UserError, not_a_regular_file, positive, run_cli


@dataclass(frozen=True)
class Comparison:
    config: str
    baseline: str
    from_step: int
    steps: int  # compared steps (from from_step to the shorter run's end)
    max_rel: float  # largest |relative difference| over them
    at_step: int  # where it is
    relative: tuple[float, ...]  # every step from 1, (loss - baseline) / baseline


def first_run(runs: Sequence[RunResult], config: str, source: str) -> RunResult:
    found = sorted((r for r in runs if r.config == config and r.lm_loss), key=lambda r: r.repeat)
    if not found:
        have = sorted({r.config for r in runs if r.lm_loss})
        raise UserError(f"{source} has no run of {config} with losses (it has {', '.join(have) or 'none'})",
                        "name a configuration the invocation ran")
    return found[0]


def compare(runs: Sequence[RunResult], config: str, baseline: str, from_step: int, source: str = "the JSON"
            ) -> Comparison:
    base, other = first_run(runs, baseline, source), first_run(runs, config, source)
    n = min(len(base.lm_loss), len(other.lm_loss))
    rel: list[float] = []
    for step, (b, o) in enumerate(zip(base.lm_loss[:n], other.lm_loss[:n], strict=True), start=1):
        if b is None or o is None:
            raise UserError(f"{source}: step {step} has no lm loss in {config if o is None else baseline}",
                            "compare runs that logged every step (--log-interval 1, the benchmark's default)")
        if b == 0:
            raise UserError(f"{source}: {baseline}'s lm loss is 0 at step {step}, so no relative difference exists",
                            "compare on data the model does not learn exactly (python -m hfsdp.bench.markov_data)")
        rel.append((o - b) / b)
    if from_step > n:
        raise UserError(f"--from-step {from_step} is past the runs' {n} steps", "give a smaller --from-step")
    tail = [abs(x) for x in rel[from_step - 1:]]
    worst = max(range(len(tail)), key=tail.__getitem__)
    return Comparison(config, baseline, from_step, len(tail), tail[worst], from_step + worst, tuple(rel))


def report(c: Comparison, max_rel: float, every: int) -> list[str]:
    lines = [f"lm loss of {c.config} against {c.baseline}: relative difference (loss - base) / base"]
    shown = sorted({*range(every, len(c.relative) + 1, every), 1, c.at_step, len(c.relative)})
    lines += [f"  step {s:>5}  {c.relative[s - 1]:+.4%}" for s in shown]
    verdict = "holds" if c.max_rel <= max_rel else "FAILS"
    lines.append(f"largest |difference| from step {c.from_step} on ({c.steps} steps): {c.max_rel:.4%} at step "
                 f"{c.at_step}; limit {max_rel:.4%}: {verdict}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfsdp.bench.loss_compare", description=__doc__.split("\n")[0])
    p.add_argument("results", help="A benchmark results JSON (--out-json).")
    p.add_argument("--config", required=True, help="The configuration held to the baseline.")
    p.add_argument("--baseline", required=True, help="The configuration it is held to.")
    p.add_argument("--from-step", type=positive(int), default=50, help="First step that counts (1-based).")
    p.add_argument("--max-rel", type=positive(float), default=0.01, help="Largest |relative difference| allowed.")
    p.add_argument("--every", type=positive(int), default=25, help="Print every N-th step.")
    opts = p.parse_args(argv)
    path = Path(opts.results)
    if os.path.exists(path) and (why := not_a_regular_file(path)):  # a named pipe would block the read
        raise UserError(f"{path} {why}", "give a benchmark results JSON")
    try:
        doc = loads_strict(path.read_bytes())
        runs = [run_from_dict(d) for d in doc["runs"]]
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror or exc}", "give a benchmark results JSON") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is not a benchmark results JSON ({exc})", "give the benchmark's --out-json") from exc
    c = compare(runs, opts.config, opts.baseline, opts.from_step, str(path))
    print("\n".join(report(c, opts.max_rel, opts.every)))
    return 0 if c.max_rel <= opts.max_rel and math.isfinite(c.max_rel) else 1


if __name__ == "__main__":
    raise SystemExit(run_cli("loss_compare", main))
