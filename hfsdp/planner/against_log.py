"""Pool = plan for a finished run: the planner's max-pool pool against the pool a pretrain log shows.

Usage: ``python -m hfsdp.planner.against_log RUN.log [RUN.log ...]`` (a functional case's
``run1.log``, a benchmark run's kept log). For each log it reads the command the run was launched
with (the ``$ ... pretrain_*.py FLAGS`` line the functional driver writes first), its data-parallel
size (Megatron's ``using world size: ..., data-parallel size: D`` line) and the pools its max-pool
allocators logged (``[fsdp_params] max-pool plan: U units, pool N B``), runs the planner on the
same flags at that size (:func:`hfsdp.planner.pools.planned_maxpool_bytes`, no GPU work) and
prints one line: ``= plan`` or ``!= plan`` with both figures. Exit 0 when every log matches, 1 when
one does not, 2 for a log it cannot read. The planner builds Transformer Engine layers only where
TE imports, and TE's layers need CUDA to be built (on the meta device all the same), so run it
where the run ran, with its GPUs visible.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hfsdp import te_determinism
from hfsdp.planner import pools
from hfsdp.training import entries
from hfsdp.usererror import UserError, not_a_regular_file, run_cli

DP_LINE = re.compile(r"using world size: \d+, data-parallel size: (\d+)")
POOL_LINE = re.compile(r"\[([\w.]+)\] max-pool plan: \d+ units, pool (\d+) B")  # scope.name for a scoped model


@dataclass(frozen=True)
class RunPools:
    """What a log says: the run's pretrain flags, its data-parallel size, and each max-pool
    allocator's pool in bytes (by allocator name, as logged)."""

    flags: tuple[str, ...]
    dp_size: int
    pools: dict[str, int]

    @property
    def pool_bytes(self) -> int:
        return sum(self.pools.values())


def read_log(text: str, source: str) -> RunPools:
    """The flags, data-parallel size and logged pools of one pretrain log (UserError naming what
    is missing)."""
    flags: tuple[str, ...] | None = None
    for line in text.splitlines():
        if not line.startswith("$ "):
            continue
        argv = shlex.split(line[2:])
        entry = next((i for i, tok in enumerate(argv) if entries.training_entry(tok)), None)
        if entry is not None:  # the reference example's own flags split off; its reference holds no pool
            flags = tuple(entries.megatron_flags(argv[entry], argv[entry + 1:]))
            break
    if flags is None:
        raise UserError(f"{source} has no '$ ... pretrain_gpt.py FLAGS' command line",
                        "give a log the functional driver wrote (run1.log of a case's output folder)")
    dp = DP_LINE.search(text)
    if dp is None:
        raise UserError(f"{source} has no 'data-parallel size' line: the run did not get as far as its arguments",
                        "give the log of a run that started training")
    logged: dict[str, int] = {}
    for name, size in POOL_LINE.findall(text):
        logged.setdefault(name, int(size))  # one line per allocator; a repeat (another rank) is the same plan
    if not logged:
        raise UserError(f"{source} logs no max-pool plan: the run had no max-pool allocator",
                        "give the log of a --megatron-fsdp-max-pool-double-buffer run at data-parallel size > 1")
    return RunPools(flags, int(dp.group(1)), logged)


def verdict(run: RunPools, planned: int | None) -> tuple[bool, str]:
    """(whether the run's pool equals the plan, the sentence that says so)."""
    held = f"{run.pool_bytes:,} B ({', '.join(f'{k} {v:,}' for k, v in sorted(run.pools.items()))})"
    if planned is None:
        return False, f"the planner failed; the run held {held}"
    if planned == run.pool_bytes:
        return True, f"= plan: {held} at data-parallel size {run.dp_size}"
    return False, f"!= plan: the run held {held}, the planner planned {planned:,} B at data-parallel size {run.dp_size}"


def planner_env(flags: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` plus, for a ``--deterministic-mode`` run, the variables its recipe set that
    Megatron's argument checks read (``NCCL_ALGO``), where ``environ`` lacks them: the run had them,
    and the plan's shapes do not depend on their values."""
    env = dict(environ)
    if "--deterministic-mode" in flags:
        for name, value in te_determinism.env().items():
            env.setdefault(name, value)
    return env


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfsdp.planner.against_log", description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+", help="Pretrain logs of max-pool runs (a functional case's run1.log).")
    opts = p.parse_args(argv)
    runs = []
    for name in opts.logs:  # every log is read before the first planner run: bad input costs nothing
        if why := not_a_regular_file(name):
            raise UserError(f"{name} {why}", "give the run1.log of a functional case's output folder")
        runs.append((name, read_log(Path(name).read_text(errors="replace"), name)))
    ok = True
    for name, run in runs:
        env = planner_env(run.flags, os.environ)
        # After the runs, the GPUs are free: Transformer Engine's layers need CUDA to be built.
        same, said = verdict(run, pools.planned_maxpool_bytes(list(run.flags), run.dp_size, env, see_gpus=True))
        ok &= same
        print(f"{name}: {said}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run_cli("against_log", main))
