"""The README's main job on a GPU machine: ``python -m hfsdp.main_job [pretrain flags ...]``.

Trains the reference hybrid model (hfsdp/planner/setup.py ``DEFAULT_MODEL_FLAGS``) on every
local GPU with Megatron-FSDP, the max-pool double buffer and, when the model can be captured,
full-iteration CUDA graphs: the fastest configuration the fork offers. Then a short eager run
of the same model shows what the graph buys. When the configuration cannot be captured (the
CUDA-graph argument checks name why), it trains eagerly and says so. Each run is Megatron's
own ``pretrain`` under torchrun; the caller's environment is passed through, with at most two
defaults added where the caller set nothing (:func:`run_env`).

At data-parallel size 1 (one GPU) Megatron-FSDP never all-gathers a unit, so nothing passes
through the double buffer: the output says so, and a short rehearsal at data-parallel size 2
follows on the same GPU (two ranks share it, [Note: several ranks on one GPU] in
hfsdp/launch/torchrun.py): the max-pool run, graphed where it can be, against its twin without
double buffering, both deterministic. It prints the pool against the plan, the home misses and
whether the losses are bit-identical; it says nothing about speed.

Each run's whole output (Megatron's arguments, warnings, every log line) goes to a log file in a
new folder under ``out/main_job/`` (:func:`job_folder`), and what Megatron prints while the job
itself checks arguments and plans memory goes to ``main_job.log`` there (:func:`stderr_into`); the
console shows the steps, the results and, for a run that fails, the end of its output. On a machine without CUDA GPUs
``scripts/run_main.sh`` calls :func:`cpu_main` instead: the memory planner, the CUDA-graph capture
check and the CPU smoke, each summed up in a few lines, their whole output in one log file.

Environment: ``TRAIN_ITERS`` (graphed run, default 30), ``EAGER_ITERS`` (comparison, default
10, 0 skips it), ``REHEARSAL_ITERS`` (DP=2 rehearsal, default 8, 0 skips it), ``NPROC``
(default: all GPUs). The runs get the caller's environment, plus
``TRITON_CACHE_AUTOTUNING=1`` when it is unset (``hfsdp.launch.env.shared_autotune``) and, on one GPU,
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when neither it nor ``PYTORCH_ALLOC_CONF``
is set (see ``ALLOC_CONF_ENV``). ``HFSDP_MAIN_JOB_OUT`` puts the job's folder elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from hfsdp import te_determinism
from hfsdp.atomic import write_json_atomic
from hfsdp.bench import pretrain_launch
from hfsdp.bench.configs import GRAPH_FLAGS, GRAPH_WARMUP_STEPS, MAXPOOL_FLAG
from hfsdp.functional import logparse
from hfsdp.launch import fit, torchrun
from hfsdp.launch.env import shared_autotune
from hfsdp.planner.setup import DEFAULT_MODEL_FLAGS
from hfsdp.usererror import UserError, env_number, run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]

MAXPOOL_FLAGS = ("--fsdp-double-buffer", MAXPOOL_FLAG)
MIB = 2**20
# Steps before the timed window: the eager warm-up steps, the capture step and one replay.
SETTLE_STEPS = GRAPH_WARMUP_STEPS + 2
TRAIN_FLAGS = ("--megatron-fsdp-main-params-dtype", "fp32", "--megatron-fsdp-main-grads-dtype",
               "fp32", "--lr-warmup-iters", "3", "--weight-decay", "0.1", "--clip-grad", "1.0")


# Megatron turns on one_logger (an NVIDIA-internal metrics package) unless told otherwise, and
# without the package every run prints a warning whose link only NVIDIA staff can open. The runs
# pass --no-one-logger unless the package is installed or the caller chose.
NO_ONE_LOGGER = "--no-one-logger"


def one_logger_flags(flags: Sequence[str]) -> list[str]:
    """``--no-one-logger`` when one_logger is not installed and ``flags`` do not have it yet."""
    import importlib.util

    if NO_ONE_LOGGER in flags or importlib.util.find_spec("one_logger") is not None:
        return []
    return [NO_ONE_LOGGER]


@contextlib.contextmanager
def stderr_into(path: str | os.PathLike[str]) -> Iterator[None]:
    """Inside the block, this process's stderr goes to the end of ``path``.

    What the job does in its own process (Megatron's argument checks, the planner's model build)
    makes Megatron print import warnings and log lines that say nothing to a user; they belong in
    the job's log. The redirect is of file descriptor 2, not of ``sys.stderr``, so a logging
    handler made inside the block keeps writing to the console after it."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "a") as log:
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def capture_problems(flags: Sequence[str], nproc: int) -> list[str]:
    """Why ``flags`` + full-iteration graphs cannot be captured (Megatron's own parse, CPU)."""
    from unittest import mock

    from hfsdp.training.entry import megatron_parser
    from megatron.training.cuda_graph_checks import cuda_graph_arg_problems

    # Megatron's parser reads the launcher's WORLD_SIZE and RANK for some defaults; give them
    # for this parse only, where the caller has not, so the job's own environment stays as it was.
    launch = {k: v for k, v in (("WORLD_SIZE", str(nproc)), ("RANK", "0")) if k not in os.environ}
    try:
        with mock.patch.dict(os.environ, launch):
            args = megatron_parser().parse_args([*flags, *GRAPH_FLAGS])  # a bad flag: one sentence
    except UserError as exc:
        raise UserError(f"Megatron's parser refuses the job's flags: {exc.cause}", exc.fix) from exc
    args.world_size = nproc  # Megatron's parse_args sets it from WORLD_SIZE; the bare parser does not
    return cuda_graph_arg_problems(args, run_env(os.environ, nproc, flags))


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


def median_step_ms(log_path: str, first_step: int) -> float | None:
    times = logparse.parse_file(log_path).get("iteration-time", {})
    window = [t for step, t in times.items() if step >= first_step]
    return statistics.median(window) * 1e3 if window else None


# Under a full-iteration graph, cache the eager warm-up left in segments that a live block pins
# stays reserved beside the graph's pool; expandable segments hand it back page by page
# (docs/cuda-graphs.md, "Memory"; measured in docs/results.md). Only on one GPU: with several ranks a
# graph holds NCCL collectives, which need NCCL_GRAPH_REGISTER=0 beside expandable segments
# (megatron/training/cuda_graph_checks.py), and Megatron-FSDP refuses it with --use-nccl-ub on
# torch < 2.11. An allocator setting the caller made (either variable) is kept whole.
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_DEFAULT = "expandable_segments:True"


def run_env(environ: Mapping[str, str] | None = None, nproc: int = 1,
            flags: Sequence[str] = ()) -> dict[str, str]:
    """The environment of the main job's runs: the caller's, passed through unchanged, plus
    Triton's shared autotune cache and, on one GPU without NCCL user buffers, expandable
    allocator segments, each only where the caller has not chosen."""
    env = dict(os.environ if environ is None else environ)
    env.update(shared_autotune(env))
    # torch reads PYTORCH_ALLOC_CONF before PYTORCH_CUDA_ALLOC_CONF: either is the caller's choice.
    chosen = any(name in env for name in ("PYTORCH_ALLOC_CONF", ALLOC_CONF_ENV))
    if nproc == 1 and "--use-nccl-ub" not in flags and not chosen:
        env[ALLOC_CONF_ENV] = ALLOC_CONF_DEFAULT
    return env


def train(flags: Sequence[str], nproc: int, steps: int, log_path: str, ranks_per_gpu: int = 1,
          extra_env: Mapping[str, str] | None = None) -> int:
    """One ``pretrain`` run: its whole output goes to ``log_path``, its step lines to the terminal
    too, and when it fails the last lines of its output.

    Started as a process group (:func:`hfsdp.proc.run_group`), so no worker outlives the run.
    ``extra_env`` is added where the caller's environment leaves a variable unset.
    """
    from collections import deque

    from hfsdp.proc import run_group

    cmd = pretrain_launch.command(flags, nproc, steps, ranks_per_gpu)
    env = run_env(os.environ, nproc, flags)
    for key, value in (extra_env or {}).items():
        env.setdefault(key, value)
    print(f"  log: {shown(Path(log_path))} (the run's whole output, its command first)", flush=True)
    tail: deque[str] = deque(maxlen=FAILED_TAIL_LINES)
    with open(log_path, "w", buffering=1) as log:
        log.write(f"$ {shlex.join(cmd)}\n")

        def keep(line: str) -> None:
            log.write(line)
            tail.append(line.rstrip("\n"))
            if logparse.is_step_line(line):
                sys.stdout.write(line)
                sys.stdout.flush()

        ended = run_group(cmd, on_line=keep, env=env)
    if ended.returncode != 0:
        print("\n".join(failed_lines("the run", ended.returncode, list(tail), Path(log_path))), flush=True)
    if ended.stragglers:
        print(f"main_job: ended {len(ended.stragglers)} worker(s) left behind by the run",
              file=sys.stderr)
    return ended.returncode


REHEARSAL_NPROC = 2
# Megatron's warnings and log lines from this process's own work (argument checks, planning).
IN_PROCESS_LOG = "main_job.log"
# Both rehearsal runs: deterministic kernels and reductions (hfsdp/te_determinism.py; Triton's
# choice pinned), so the max-pool run must reproduce its twin bit for bit.
REHEARSAL_FLAGS = ("--deterministic-mode",)


@dataclass
class Rehearsal:
    """What the DP=2 rehearsal measured (None where a run gave nothing)."""

    steps: int
    identical_steps: int | None = None
    pool_bytes: int | None = None
    planned_pool_bytes: int | None = None
    home_misses: int | None = None
    peak_allocated: tuple[int, int] | None = None  # (no double buffer, max-pool), per rank
    failed: str | None = None

    def lines(self) -> list[str]:
        if self.failed:
            return [f"DP=2 rehearsal: {self.failed}"]
        loss = ("bit-identical at every step" if self.identical_steps == self.steps
                else f"DIFFERS: identical at {self.identical_steps} of {self.steps} steps")
        pool = ("pool not measured" if self.pool_bytes is None else
                f"pool {self.pool_bytes / MIB:.2f} MiB "
                + ("= plan" if self.pool_bytes == self.planned_pool_bytes
                   else f"!= plan {(self.planned_pool_bytes or 0) / MIB:.2f} MiB"))
        out = [f"DP=2 rehearsal (2 ranks on one GPU, {self.steps} steps): max-pool vs no double buffer: "
               f"lm loss {loss}; {pool}; home misses {self.home_misses}"]
        if self.peak_allocated:
            base, pooled = self.peak_allocated
            out.append(f"  peak allocated per rank: {pooled / MIB:,.0f} MiB with max-pool, {base / MIB:,.0f} MiB "
                       f"without ({pooled / base:.3f}x); step times of this mode are not speed")
        return out


def rehearse(base: Sequence[str], steps: int, graphed: bool, workdir: str) -> Rehearsal:
    """Data-parallel size 2 on this GPU: the max-pool run (graphed when ``graphed``) and its twin
    without double buffering, with run reports (pool, home misses, peaks) and the planned pool."""
    from hfsdp.bench.run import planned_pools
    from hfsdp.training import run_report

    twin = [f for f in base if f not in MAXPOOL_FLAGS]
    runs = {"twin": [*twin, *REHEARSAL_FLAGS],
            "maxpool": [*base, *REHEARSAL_FLAGS, *(GRAPH_FLAGS if graphed else ())]}
    out = Rehearsal(steps=steps)
    placement = torchrun.Placement(nproc=REHEARSAL_NPROC, ranks_per_gpu=REHEARSAL_NPROC)
    # Pinned Triton choices: the DP=1 runs cached timed choices for some kernels only, and two
    # ranks timing one kernel at once may choose differently; pinned, both runs take the same.
    deterministic = te_determinism.env("pin")
    in_process = os.path.join(workdir, IN_PROCESS_LOG)
    with stderr_into(in_process):
        fits = fit.preflight(placement, pretrain_launch.training_flags(runs["maxpool"], REHEARSAL_NPROC, steps),
                             environ={**deterministic, **os.environ})
    print(fits)
    reports: dict[str, dict] = {}
    losses: dict[str, dict[int, float]] = {}
    for name, flags in runs.items():
        log, report = os.path.join(workdir, f"dp2-{name}.log"), os.path.join(workdir, f"dp2-{name}.json")
        env = {**deterministic, run_report.ENV: report}
        if train(flags, REHEARSAL_NPROC, steps, log, REHEARSAL_NPROC, env) != 0:
            out.failed = f"the {name} run failed; the end of its output is above, {shown(Path(log))} holds all of it"
            return out
        try:
            reports[name] = run_report.read(report, REHEARSAL_NPROC)
        except (OSError, ValueError) as exc:  # read() names a file that is not a report
            out.failed = f"the {name} run left no complete run report ({exc})"
            return out
        losses[name] = logparse.parse_file(log).get("lm loss", {})
    same = [s for s in range(1, steps + 1) if s in losses["twin"] and losses["twin"][s] == losses["maxpool"].get(s)]
    out.identical_steps = len(same)
    pooled = reports["maxpool"]
    out.pool_bytes = pooled.get("pool_bytes_measured")
    out.home_misses = (pooled.get("maxpool_stats") or {}).get("home_misses")
    out.peak_allocated = (reports["twin"]["peak_allocated_bytes"], pooled["peak_allocated_bytes"])
    with stderr_into(in_process):
        planned = planned_pools(base, REHEARSAL_NPROC, names=["maxpool"])
    out.planned_pool_bytes = planned.get("maxpool", {}).get("pool_bytes")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The main job on this machine's GPUs (see the module docstring); its exit status."""
    return run_cli("main_job", lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    import torch

    extra = list(sys.argv[1:] if argv is None else argv)
    nproc = env_number("NPROC", torch.cuda.device_count())  # unset: every GPU (none: the sentence below)
    # Every knob is read before anything runs: a bad one must not cost a training run.
    steps = env_number("TRAIN_ITERS", 30)
    eager_iters = env_number("EAGER_ITERS", 10, zero=True)
    rehearsal_iters = env_number("REHEARSAL_ITERS", 8, zero=True)
    if nproc < 1:
        print("main_job: no CUDA GPU here; training needs one (scripts/run_main.sh runs the "
              "CPU part instead).", file=sys.stderr)
        return 2
    base = [*DEFAULT_MODEL_FLAGS, *MAXPOOL_FLAGS, *TRAIN_FLAGS, *one_logger_flags(extra), *extra]
    with tempfile.TemporaryDirectory() as scratch:  # a refused flag leaves no job folder behind
        early = Path(scratch) / IN_PROCESS_LOG
        with stderr_into(early):
            problems = capture_problems(base, nproc)
        job = job_folder("gpu")
        in_process = job / IN_PROCESS_LOG
        shutil.move(early, in_process)  # /tmp may be another file system
    graphed = not problems and steps > SETTLE_STEPS
    if problems:
        print("main_job: this configuration cannot run under a full-iteration CUDA graph, so it "
              "trains eagerly:\n  - " + "\n  - ".join(problems))
    elif not graphed:
        print(f"main_job: TRAIN_ITERS={steps} leaves no step after the CUDA-graph capture "
              f"(it needs more than {SETTLE_STEPS}); training eagerly.")
    print(f"main_job: each run's whole output goes to a log file in {shown(job)}; here, its steps.", flush=True)
    label = "max-pool + full-iteration CUDA graph" if graphed else "max-pool, eager"
    print(f"== main_job: training on {nproc} GPU(s): {label} ==", flush=True)
    main_log = os.path.join(job, "main.log")
    rc = train([*base, *(GRAPH_FLAGS if graphed else ())], nproc, steps, main_log)
    if rc != 0:
        print(f"main_job: training failed (exit status {rc}); {shown(Path(main_log))} holds its whole output.",
              file=sys.stderr)
        return rc
    first = SETTLE_STEPS + 1 if graphed else 3
    ms = median_step_ms(main_log, first)
    eager_ms = None
    if graphed and eager_iters > 3:
        print(f"== main_job: the same model eager, {eager_iters} steps, for comparison ==",
              flush=True)
        eager_log = os.path.join(job, "eager.log")
        if train(base, nproc, eager_iters, eager_log) == 0:
            eager_ms = median_step_ms(eager_log, 3)
    idle = fit.data_parallel_size(base, nproc) == 1
    rehearsal = None
    if idle and rehearsal_iters > 0:
        with stderr_into(in_process):
            rehearsal_graphed = not capture_problems(base, REHEARSAL_NPROC) and rehearsal_iters > SETTLE_STEPS
        print(f"== main_job: data-parallel size 2 on this GPU (2 ranks share it), {rehearsal_iters} steps: "
              "max-pool " + ("graphed" if rehearsal_graphed else "eager")
              + " vs no double buffer, deterministic ==", flush=True)
        rehearsal = rehearse(base, rehearsal_iters, rehearsal_graphed, str(job))
    print("== main_job: result ==")
    if ms is not None:
        print(f"{label}: median step {ms:.1f} ms (steps {first}-{steps}, {nproc} GPU(s))")
    if eager_ms is not None and ms:
        print(f"max-pool, eager: median step {eager_ms:.1f} ms (steps 3-{eager_iters}); "
              f"the graph runs {eager_ms / ms:.2f}x faster")
    if idle:
        print("at data-parallel size 1 Megatron-FSDP never all-gathers a unit, so nothing passed through "
              "the double buffer in the runs above" + ("; the DP=2 rehearsal exercised it" if rehearsal else ""))
    if rehearsal is not None:
        print("\n".join(rehearsal.lines()))
    print(f"The runs' whole output: {shown(job)}")
    if rehearsal is not None and (rehearsal.failed or rehearsal.identical_steps != rehearsal.steps
                                  or rehearsal.home_misses):
        return 1
    return 0


# -- The job's log folder and the fork -----------------------------------------------------------

OUT_ENV = "HFSDP_MAIN_JOB_OUT"
OUT_FIX = f"set {OUT_ENV} to a folder you can write (the job makes a new folder inside it)"


def job_folder(kind: str, environ: Mapping[str, str] | None = None) -> Path:
    """A new folder for this job's logs under ``$HFSDP_MAIN_JOB_OUT`` (default ``out/main_job``).

    Its name is new (``<kind>-<date>-<time>-<random>``), so nothing that exists is overwritten,
    and nothing deletes it: the logs stay for the user to read.
    """
    root = Path((os.environ if environ is None else environ).get(OUT_ENV) or REPO_ROOT / "out" / "main_job")
    try:
        root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-", dir=root))
    except OSError as exc:
        raise UserError(f"cannot make the job's log folder in {root} ({exc.strerror or exc})", OUT_FIX) from exc


def shown(path: Path) -> str:
    """``path`` as the user should read it: relative to the working folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def fork_report(root: Path = REPO_ROOT) -> tuple[int, list[str]]:
    """(exit status of ``scripts/patchset status``, what to print): two lines when the fork is
    materialized, stamped and unedited, else the tool's own full report with its advice."""
    import contextlib
    import io

    from hfsdp.patchset import cli as patchset_cli
    from hfsdp.patchset.materialize import tree_status
    from hfsdp.patchset.project import Project

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        rc = patchset_cli.main(["--root", str(root), "status"])
    if rc != 0:
        return rc, text.getvalue().splitlines()
    project = Project(root)
    pin, st = project.pin(), tree_status(project)
    state = "up to date" if st.up_to_date else "STALE (`scripts/patchset materialize` rebuilds it)"
    edits = f"{len(st.edits)} local edit(s)" if st.edits else "no local edits"
    return 0, [f"fork {pin.fork_version}: {pin.distribution} {pin.version} + {st.overlay_files} files of "
               f"our own (patches/overlay/) + {len(st.applied)} patches (patches/series).",
               f"Its stamp is {state} and megatron/ has {edits}; `scripts/patchset status` lists "
               "each patch."]


def print_fork(root: Path = REPO_ROOT) -> int:
    """Print :func:`fork_report`; returns its exit status."""
    rc, lines = fork_report(root)
    print("\n".join(lines), flush=True)
    return rc


# -- The main job on a machine without CUDA GPUs -------------------------------------------------

PLAN_DP_SIZE = 2
SMOKE_CASE = REPO_ROOT / "tests" / "functional_tests" / "test_cases" / "smoke" / "cpu_gloo_smoke"
SMOKE_NPROC = 2
FAILED_TAIL_LINES = 15  # of a failed step's output, shown on the console
NO_GPU_TEXT = f"""\
Training with Megatron-FSDP needs NVIDIA GPUs (NCCL all-gather/reduce-scatter, CUDA kernels).
Running what needs no GPU instead:
  1. the memory planner on the same model at data-parallel size {PLAN_DP_SIZE} (FSDP units, double-buffer plan,
     what 0.18.2's FixedPool would do),
  2. the CUDA-graph capture check of the model the GPU run would graph,
  3. the CPU smoke: our entry and data path, and a {SMOKE_NPROC}-rank gloo training loop under torchrun.
On a GPU machine this same command trains the model; see README "Set-up: two commands"."""


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


USER_ERROR = re.compile(r"^\S+: error: ")  # hfsdp/usererror.py: "<prog>: error: <cause>", then "  -> <fix>"


def failed_lines(what: str, rc: int, lines: Sequence[str], log_path: Path) -> list[str]:
    """A failed step on the console: its exit status, then the sentence a tool of ours gave for
    refused input (:mod:`hfsdp.usererror`), else the end of its output; where the rest is."""
    said = next((i for i, line in enumerate(lines) if USER_ERROR.match(line)), None)
    shown_lines = lines[said:said + 2] if said is not None else lines[-FAILED_TAIL_LINES:]
    which = "its error" if said is not None else "the last lines of its output"
    return [f"{what} failed (exit status {rc}); {which} ({shown(log_path)} has all):",
            *(f"  | {line}" for line in shown_lines)]


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f} MiB"


ALLOCATOR_WORDS = {"weight": "weights", "grad": "grads"}  # the planner's allocators, in this order
Allocators = list[tuple[str, Mapping[str, Any]]]


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
    code = ("import sys; from hfsdp.main_job import write_capture_problems; "
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


if __name__ == "__main__":
    sys.exit(main())
