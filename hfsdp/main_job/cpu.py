"""The main job on a machine without CUDA GPUs (``scripts/run_main.sh`` calls :func:`cpu_main`):
the memory planner on the same model, the CUDA-graph capture check of the model the GPU run
would graph, and the CPU smoke, each summed up in a few lines on the console, their whole output
in one log file in a new job folder."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from hfsdp.atomic import write_json_atomic
from hfsdp.flagsets import MAXPOOL_FLAGS
from hfsdp.functional import logparse
from hfsdp.main_job.logs import REPO_ROOT, failed_lines, job_folder, shown
from hfsdp.main_job.runs import MIB, capture_problems
from hfsdp.planner.setup import DEFAULT_MODEL_FLAGS
from hfsdp.usererror import run_cli

PLAN_DP_SIZE = 2
SMOKE_CASE = REPO_ROOT / "tests" / "functional_tests" / "test_cases" / "smoke" / "cpu_gloo_smoke"
SMOKE_NPROC = 2
NO_GPU_TEXT = f"""\
Training with Megatron-FSDP needs NVIDIA GPUs (NCCL all-gather/reduce-scatter, CUDA kernels).
Running what needs no GPU instead:
  1. the memory planner on the same model at data-parallel size {PLAN_DP_SIZE} (FSDP units, double-buffer plan,
     what 0.18.2's FixedPool would do),
  2. the CUDA-graph capture check of the model the GPU run would graph,
  3. the CPU smoke: our entry and data path, and a {SMOKE_NPROC}-rank gloo training loop under torchrun.
On a GPU machine this same command trains the model; see README "Set-up: two commands"."""
ALLOCATOR_WORDS = {"weight": "weights", "grad": "grads"}  # the planner's allocators, in this order
Allocators = list[tuple[str, Mapping[str, Any]]]


def capture_verdict(problems: Sequence[str]) -> list[str]:
    """Whether the main job's model would train under a full-iteration CUDA graph, in words."""
    if problems:
        return ["the main job's model cannot be captured, so on a GPU it would train eagerly:",
                *(f"  - {p}" for p in problems)]
    return ["the main job's model passes the CUDA-graph capture checks: on a GPU it trains with the "
            "max-pool double buffer under a full-iteration CUDA graph."]


def write_capture_problems(path: str, extra: Sequence[str] = ()) -> int:
    """Why the main job's model (plus ``extra``) cannot be captured on one GPU, as JSON in ``path``
    (an empty list: it can); the CPU branch runs this in a process of its own (:func:`capture_step`).
    Flags Megatron refuses are one sentence and exit status 2."""

    def write() -> None:
        problems = capture_problems([*DEFAULT_MODEL_FLAGS, *MAXPOOL_FLAGS, *extra], 1)
        write_json_atomic(path, problems, indent=None, sort_keys=False)

    return run_cli("main_job", write)


def run_logged(title: str, cmd: Sequence[str], log: TextIO) -> tuple[int, list[str]]:
    """Run ``cmd`` from the checkout, all its output appended to ``log``; (exit status, its lines)."""
    from hfsdp.proc import run_group

    log.write(f"\n== {title} ==\n$ {shlex.join(cmd)}\n")
    log.flush()
    lines: list[str] = []

    def keep(line: str) -> None:
        log.write(line)
        lines.append(line.rstrip("\n"))

    ended = run_group(list(cmd), env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO_ROOT, on_line=keep)
    log.write(f"[exit status {ended.returncode}]\n")
    log.flush()
    return ended.returncode, lines


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f} MiB"


def _words(allocator: str) -> str:
    return ALLOCATOR_WORDS.get(allocator, allocator)


def units_line(plan: Mapping[str, Any]) -> str:
    """The model's parameters, its FSDP units by class, and what lies outside them."""
    units = plan["units"]
    classes = Counter(u["cls"] for u in units)
    outside = plan["total_params"] - sum(u["params"] for u in units)
    return (f"{plan['total_params']:,} parameters: {len(units)} FSDP units ("
            + ", ".join(f"{n} x {c}" for c, n in classes.items())
            + f") and {outside:,} outside them, which are never pooled.")


def pool_line(name: str, a: Mapping[str, Any]) -> str:
    """One allocator's max-pool double buffer against the analytic minimum, and its lane plans."""
    minimum, pool = a["analytic_minimum_bytes"], a["maxpool_pool_bytes"]
    dtypes = ", ".join(d.replace("torch.", "") for d in sorted(a["maxpool_arena_numel"]))
    lanes = "".join(f"; with --megatron-fsdp-max-pool-lanes {n}: {_mib(lp['pool_bytes'])}"
                    for n, lp in a["lane_plans"].items())
    return (f"{_words(name)} ({dtypes}): max-pool double buffer {_mib(pool)}, "
            f"{pool / minimum:.3f} x the analytic minimum of {_mib(minimum)}{lanes}.")


def fixed_pool_lines(allocators: Allocators, units: int) -> list[str]:
    """What 0.18.2's FixedPool would pool: one line, or one per allocator where they differ."""
    same = len({tuple(a["fixed_pool_pooled_units"]) for _, a in allocators}) == 1
    lines = []
    for group in [allocators] if same else [[one] for one in allocators]:
        kept = group[0][1]["fixed_pool_pooled_units"]
        whose = "" if same else f" for the {_words(group[0][0])}"
        spilled = ", ".join(f"{_mib(a['fixed_pool_outlier_bytes'])} of {_words(n)}" for n, a in group)
        rest = units - len(kept)
        others = "the other unit gets" if rest == 1 else f"the other {rest} get"
        lines.append(f"0.18.2's FixedPool would pool only {len(kept)} of the {units} units{whose} "
                     f"({', '.join(map(str, kept))}); {others} memory outside the pool: {spilled}.")
    return lines


def plan_summary(plan: Mapping[str, Any]) -> list[str]:
    """The planner's key lines from its JSON plan (hfsdp/planner/report.py ``report_dict``):
    the units, each allocator's pools against the analytic minimum, and 0.18.2's FixedPool."""
    order = {name: i for i, name in enumerate(ALLOCATOR_WORDS)}
    allocators = sorted(plan["allocators"].items(), key=lambda kv: order.get(kv[0], len(order)))
    return [units_line(plan), *(pool_line(n, a) for n, a in allocators),
            *fixed_pool_lines(allocators, len(plan["units"]))]


def plan_step(job: Path, log: TextIO, log_path: Path) -> bool:
    """The memory planner on the default model; prints its note and key lines."""
    plan_json = job / "plan.json"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "fsdp_memory_planner.py"),
           "--plan-dp-size", str(PLAN_DP_SIZE), "--plan-json", str(plan_json)]
    rc, lines = run_logged("memory planner", cmd, log)
    if rc != 0 or not plan_json.is_file():
        print("\n".join(failed_lines("the memory planner", rc, lines, log_path)))
        return False
    prefix = "fsdp_memory_planner: planning "
    notes = [line.removeprefix("fsdp_memory_planner: ") for line in lines if line.startswith(prefix)]
    print("\n".join([*notes[:1], *plan_summary(json.loads(plan_json.read_text())),
                     f"The planner's whole report (unit table, arenas, lanes) is in the log; "
                     f"{shown(plan_json)} holds the plan."]))
    return True


def capture_step(extra: Sequence[str], job: Path, log: TextIO, log_path: Path) -> bool:
    """The CUDA-graph capture check (Megatron's own argument checks, no GPU); prints the verdict."""
    found = job / "capture_problems.json"
    code = ("import sys; from hfsdp.main_job.cpu import write_capture_problems; "
            "sys.exit(write_capture_problems(sys.argv[1], sys.argv[2:]))")
    rc, lines = run_logged("CUDA-graph capture check", [sys.executable, "-c", code, str(found), *extra], log)
    if rc != 0 or not found.is_file():
        print("\n".join(failed_lines("the capture check", rc, lines, log_path)))
        return False
    verdict = capture_verdict(json.loads(found.read_text()))
    log.write("\n".join(verdict) + "\n")
    print("\n".join(verdict))
    return True


def smoke_summary(result: Mapping[str, Any], steps: int) -> list[str]:
    """The CPU smoke's verdict from the functional driver's ``result.json``: steps and loss."""
    runs = result.get("runs") or []
    loss = logparse.parse_file(runs[0]["log"]).get("lm loss", {}) if runs else {}
    trend = f", lm loss {loss[min(loss)]:.4f} -> {loss[max(loss)]:.4f}" if loss else ", no lm loss logged"
    return [f"{result['status']}: {len(loss)} of {steps} steps on {SMOKE_NPROC} ranks{trend}.",
            *(f"  - {why}" for why in result.get("reasons", []))]


def smoke_step(job: Path, log: TextIO, log_path: Path) -> bool:
    """The CPU smoke through the functional driver; prints pass/fail, steps and loss."""
    from hfsdp.functional.recipe import load_recipe
    from hfsdp.functional.run_case import output_dir_for

    recipe = load_recipe(SMOKE_CASE)
    out = job / "smoke"
    cmd = [sys.executable, "-m", "hfsdp.functional.run_case", str(SMOKE_CASE), "--nproc", str(SMOKE_NPROC),
           "--output-dir", str(out)]
    rc, lines = run_logged("CPU smoke", cmd, log)
    result_path = output_dir_for(recipe, out) / "result.json"
    if not result_path.is_file():
        print("\n".join(failed_lines("the CPU smoke", rc, lines, log_path)))
        return False
    print("\n".join(smoke_summary(json.loads(result_path.read_text()), recipe.train_iters)))
    return rc == 0


def cpu_main(extra: Sequence[str] = ()) -> int:
    """The main job on a machine without CUDA GPUs: the planner, the capture check and the CPU
    smoke, each summed up on the console, all their output in one log file in a new job folder.
    ``extra`` (the job's pretrain flags) reaches the capture check. 0 when every step passed."""
    return run_cli("main_job", lambda: _cpu_main(extra))


def _cpu_main(extra: Sequence[str]) -> int:
    job = job_folder("cpu")
    log_path = job / "main_job.log"
    print("== run_main: no CUDA GPU on this machine ==")
    print(NO_GPU_TEXT)
    print(f"The whole output (Megatron's logs, the planner's full report, warnings) goes to {shown(log_path)}.",
          flush=True)
    with open(log_path, "w") as log:
        print(f"== run_main: memory planner (data-parallel size {PLAN_DP_SIZE}) ==", flush=True)
        planned = plan_step(job, log, log_path)
        print("== run_main: CUDA-graph capture check (Megatron's arguments, no GPU) ==", flush=True)
        checked = capture_step(extra, job, log, log_path)
        print(f"== run_main: CPU smoke ({SMOKE_NPROC} ranks, gloo) ==", flush=True)
        smoked = smoke_step(job, log, log_path)
    ok = planned and checked and smoked
    print("== run_main: done " + ("(no training: this machine has no CUDA GPU) ==" if ok else "WITH FAILURES =="))
    print(f"Full output: {shown(log_path)}")
    return 0 if ok else 1
