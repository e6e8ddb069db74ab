"""``scripts/benchmark_double_buffer.py``: time one model under each double-buffer configuration.

Every (repeat, configuration) pair is a fresh ``torchrun`` of :mod:`hfsdp.bench.worker`, launched
in an interleaved, rotated order; the planner runs (CPU-only subprocess) once per set of plan flags
for the planned pool sizes. Results: a table on stdout, JSON and a PNG chart (see docs/benchmark.md).

Each run is a process group with a timeout (:func:`hfsdp.proc.run_group`) that gets the caller's
environment unchanged plus ``--env KEY=VALUE`` ([Note: launch environment] in hfsdp/launch/env.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hfsdp import extras, te_determinism
from hfsdp.atomic import NonFiniteJSON, loads_strict
from hfsdp.bench import bases, flops, pretrain_launch, run_logs
from hfsdp.bench import configs as cfgs
from hfsdp.bench import results as res
from hfsdp.environment import REPO_ROOT
from hfsdp.flagsets import GRAPH_WARMUP_STEPS
from hfsdp.functional.outdir import refuse_foreign
from hfsdp.launch import fit, pretrain, torchrun
from hfsdp.launch.env import add_env_option, job_env, parse_assignments, shared_autotune
from hfsdp.planner import pools
from hfsdp.proc import run_group
from hfsdp.training import requirements
from hfsdp.usererror import UserError, comma_choices, not_a_regular_file, output_file, output_folder, positive, run_cli


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
                                epilog="Megatron flags after `--` override the preset's model flags.")
    p.add_argument("--nproc", type=positive(int), default=2,
                   help="Ranks (= data-parallel size); GPUs used = ranks / --ranks-per-gpu.")
    torchrun.add_ranks_per_gpu_option(p)
    p.add_argument("--repeats", type=positive(int), default=3)
    p.add_argument("--warmup-steps", type=positive(int, zero=True), default=6,
                   help="Untimed steps per run (graphed configurations: Megatron's eager "
                        "warm-up steps, the capture step and at least one replay).")
    p.add_argument("--timed-steps", type=positive(int), default=20, help="Timed steps per run.")
    p.add_argument("--configs", default=",".join(cfgs.DEFAULT_CONFIGS),
                   help="Comma-separated subset of " + ", ".join(cfgs.CONFIGS))
    p.add_argument("--baseline", default=res.BASELINE, metavar="CONFIG",
                   help="The configuration the 'x base' ratios divide by (default no_db), e.g. "
                        "maxpool_graph to read maxpool_ub_graph's gain from user buffers; one of --configs.")
    p.add_argument("--preset", default="default", choices=sorted(cfgs.PRESETS))
    p.add_argument("--out-json", default="out/benchmark-results.json",
                   help="Results JSON (default under out/ of the current folder; folders are made).")
    p.add_argument("--out-png", default="out/benchmark-results.png", help="Chart (folders are made).")
    p.add_argument("--peak-tflops", type=positive(float), default=None,
                   help="One GPU's dense bf16 peak for MFU (default: 989 for H100 and H200, else no MFU).")
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--no-plan", action="store_true", help="Skip the planner subprocess.")
    p.add_argument("--profile-dir", default=None,
                   help="Chrome traces of the timed steps (profiling distorts step times).")
    p.add_argument("--profile-stack", action="store_true",
                   help="With --profile-dir: record Python frames, so <stem>.idle.txt names the "
                        "Python code behind each GPU-idle gap (more host overhead).")
    p.add_argument("--pyprofile-dir", default=None,
                   help="cProfile tables of the timed steps (host Python time; distorts timings).")
    p.add_argument("--memory-trace-dir", default=None,
                   help="Record the CUDA allocator's history and write what was live at the "
                        "peak, by allocator (hfsdp/trace/memtrace.py; distorts timings).")
    p.add_argument("--run-timeout", type=positive(int), default=300, help="Seconds per torchrun.")
    p.add_argument("--time-budget", type=positive(int), default=None, metavar="S",
                   help="Launch no run that would end more than S seconds after the runs began, the "
                        "longest run so far being the estimate (the first run only until another has "
                        "ended: it alone pays for cold compile caches); for a job with a time limit. The "
                        "rest are listed as not launched, and --resume with --keep-logs runs them.")
    p.add_argument("--keep-logs", default=None,
                   help="Copy every timing run's Megatron log and run report into this folder.")
    p.add_argument("--from-logs", default=None, metavar="DIR",
                   help="Launch nothing: summarize the runs a --keep-logs folder holds (an "
                        "invocation that stopped early). Give the same preset, configurations, "
                        "repeats, steps and flags as the invocation that wrote it.")
    p.add_argument("--resume", action="store_true",
                   help="With --keep-logs DIR: take every run DIR already holds that counts (read as --from-logs "
                        "reads it) and launch only the others, on the machine that ran those ([Note: resumed "
                        "invocations] in hfsdp/bench/run_logs.py). Give the same arguments as before.")
    p.add_argument("--data-path", default=None, metavar="PREFIX",
                   help="Train on this indexed dataset (PREFIX.bin/.idx, e.g. from python -m "
                        "hfsdp.bench.markov_data) instead of --mock-data: losses compared over many steps "
                        "(hfsdp.bench.loss_compare) need text a model does not learn within a few steps.")
    p.add_argument("--no-prime", action="store_true",
                   help="Skip the discarded priming run (it fills the Triton compile/autotune "
                        "caches so the first timed run is not slower than the rest).")
    p.add_argument("--chart-from", default=None,
                   help="Only (re)draw --out-png from an existing results JSON (no GPU).")
    p.add_argument("--deterministic", action="store_true",
                   help="Give every run the deterministic Transformer Engine settings of "
                        "hfsdp/te_determinism.py (flags and environment; Triton choices shared through "
                        "TRITON_CACHE_AUTOTUNING), so losses of one spec can agree bit for bit. Timings "
                        "are then those of the deterministic kernels. --env and flags after -- win.")
    p.add_argument("--base", action="append", default=None, metavar="NAMES",
                   help=f"Megatron trees to run each configuration on, comma-separated or repeated: "
                        f"{', '.join(bases.CHOICES)} (default fork). A release runs pristine, from "
                        f"--bases-dir (hfsdp/bench/bases.py); its rows are named <base>:<config>.")
    p.add_argument("--release-configs", default=None, metavar="CONFIGS",
                   help="Comma-separated subset of --configs that the releases of --base run (default: all "
                        "of them); the fork runs every one unless --fork-configs narrows it.")
    p.add_argument("--fork-configs", default=None, metavar="CONFIGS",
                   help="Comma-separated subset of --configs that the fork runs (default: all of them): "
                        "its best against releases that run other configurations, in one invocation.")
    p.add_argument("--bases-dir", default=bases.DEFAULT_DIR,
                   help="Where `python -m hfsdp.bench.bases prepare` put the releases (default out/bases).")
    add_env_option(p)
    opts = p.parse_args(argv[:split])
    opts.trees = {}  # base -> its extracted tree, filled by _main (bases.resolve)
    opts.env = parse_assignments(opts.env)
    if opts.deterministic:
        # With several ranks per GPU nothing is timed, so every process takes the pinned Triton
        # choice: a shared timed choice is only shared once one process has cached it, and two
        # ranks timing the same kernel at once may choose differently (seen at DP=2 on one GPU).
        choice: te_determinism.TritonChoice = "pin" if opts.ranks_per_gpu > 1 else "cache"
        opts.env = {**te_determinism.env(choice), **opts.env}
    opts.env = {**shared_autotune(os.environ, opts.env), **opts.env}
    if opts.repeats < 3:
        print(f"note: --repeats {opts.repeats} < 3; medians over so few runs are noisy")
    return opts, argv[split + 1:]


class Plans:
    """Planned pool bytes per configuration (weights + grads) from CPU-only planner runs.

    The planner builds the preset's model with local specs (no TE on a CPU); a TE configuration
    has the same parameters per unit, so its planned pool is the local one (bucket padding may
    differ slightly; the measured pool is in the run report). ``names``: the configurations to
    plan (default all); only their lane counts are asked of the planner, so a model too small
    for a lanes configuration that was not asked for still gets its other plans. Configurations
    whose own flags change the plan (cfgs.plan_flags: the gradient buffers' dtype) get one planner
    run per distinct set of them.

    The planner processes (:class:`hfsdp.planner.pools.PlannerRun`) start at construction and run
    side by side, at a lower CPU priority, beside the GPU runs (each builds the model on the CPU,
    which a large preset makes slow); :meth:`result` waits for them, and :meth:`stop` ends any
    still running, so an interrupted invocation leaves none behind.
    """

    def __init__(self, flags: Sequence[str], nproc: int, extra_env: dict[str, str] | None = None,
                 names: Sequence[str] | None = None) -> None:
        wanted = list(cfgs.CONFIGS) if names is None else list(names)
        groups: dict[tuple[str, ...], list[str]] = {}
        for name in wanted:
            groups.setdefault(cfgs.plan_flags(name), []).append(name)
        env = job_env(os.environ, extra_env or {})
        self._jobs: list[tuple[list[str], pools.PlannerRun]] = []
        for own, members in groups.items():
            lanes = sorted({cfgs.CONFIGS[n].lanes for n in members if cfgs.CONFIGS[n].plan == "lanes"})
            self._jobs.append((members, pools.PlannerRun(cfgs.override_flags(flags, own), nproc, env, lanes)))

    def result(self) -> dict[str, dict[str, int]]:
        """The pools of every configuration; {} (said once) when a planner run failed."""
        out: dict[str, dict[str, int]] = {}
        try:
            for members, run in self._jobs:
                plan, said = run.result()
                if plan is None:
                    print("planner failed; continuing without planned sizes:\n" + said)
                    return {}
                out.update(pools_from_plan(plan, members))
            return out
        finally:
            self.stop()

    def stop(self) -> None:
        for _, run in self._jobs:
            run.stop()


def planned_pools(flags: Sequence[str], nproc: int, extra_env: dict[str, str] | None = None,
                  names: Sequence[str] | None = None) -> dict[str, dict[str, int]]:
    """:class:`Plans` run to the end: the planned pools of ``names`` (default all)."""
    return Plans(flags, nproc, extra_env, names).result()


def pools_from_plan(plan: dict[str, Any], names: Sequence[str] | None = None) -> dict[str, dict[str, int]]:
    """Per configuration with a ``plan`` figure: its planned pool (weights + grads) from the
    planner's JSON, and the analytic minimum of the 2-group pools it is compared with."""
    minimum = pools.total(plan, "analytic_minimum_bytes")
    out: dict[str, dict[str, int]] = {}
    for name in cfgs.CONFIGS if names is None else names:
        config = cfgs.CONFIGS[name]
        if config.plan == "lanes":
            # The analytic minimum counts two groups of the largest unit: not this pool's bound.
            out[name] = {"pool_bytes": pools.lanes_pool_bytes(plan, config.lanes)}
        elif config.plan is not None:
            key = {"fixed_pool": "fixed_pool_pool_bytes", "maxpool": "maxpool_pool_bytes"}[config.plan]
            out[name] = {"pool_bytes": pools.total(plan, key), "analytic_minimum_bytes": minimum}
    return out


def profiling(opts: argparse.Namespace) -> bool:
    """Profiling passes run in the bench worker (in-process hooks); timing runs in pretrain."""
    return bool(opts.profile_dir or opts.pyprofile_dir or opts.memory_trace_dir)


def log_tail(text: str, size: int = 3000) -> str:
    """A failed run's log as the summary shows it: its last ``size`` characters, led by the log's last
    error line when that lies further up (torchrun's report of four failed ranks alone fills them). Paths
    inside the checkout are written relative to it: the JSON names no machine's folders."""
    text = text.replace(REPO_ROOT + os.sep, "")
    tail = text[-size:]
    said = bases.last_error_line(text)
    if said is not None and bases.last_error_line(tail) is None:
        return f"{said}\n[...]\n{tail}"
    return tail


def launch(config: cfgs.BenchConfig, repeat: int, flags: Sequence[str], opts: argparse.Namespace,
           workdir: str, timeout_s: int | None = None) -> tuple[res.RunResult | None, str]:
    if not profiling(opts):
        return launch_pretrain(config, repeat, flags, opts, workdir, timeout_s)
    result = os.path.join(workdir, f"{config.name}-{repeat}.json")
    log = os.path.join(workdir, f"{config.name}-{repeat}.log")
    placement = torchrun.Placement(nproc=opts.nproc, ranks_per_gpu=opts.ranks_per_gpu)
    cmd = torchrun.command(placement, [
        "-m", "hfsdp.bench.worker", "--result", result, "--config", config.name, "--repeat", str(repeat),
        "--warmup-steps", str(opts.warmup_steps), "--timed-steps", str(opts.timed_steps),
        *(["--profile-dir", opts.profile_dir] if opts.profile_dir else []),
        *(["--profile-stack"] if opts.profile_dir and opts.profile_stack else []),
        *(["--pyprofile-dir", opts.pyprofile_dir] if opts.pyprofile_dir else []),
        *(["--memory-trace-dir", opts.memory_trace_dir] if opts.memory_trace_dir else []),
        "--", *flags, *config.flags])
    with open(log, "w") as f:
        ended = run_group(cmd, timeout_s=timeout_s or opts.run_timeout,
                          env=job_env(os.environ, opts.env, dict(config.env)), stdout=f)
    rc = "timeout" if ended.timed_out else ended.returncode
    if rc != 0 or not os.path.exists(result):
        with open(log, errors="replace") as f:
            tail = log_tail(f.read())
        return None, f"rc={rc}; log tail:\n{tail}"
    with open(result) as f:
        return res.run_from_dict(json.load(f)), log


def launch_pretrain(config: cfgs.BenchConfig, repeat: int, flags: Sequence[str],
                    opts: argparse.Namespace, workdir: str,
                    timeout_s: int | None = None) -> tuple[res.RunResult | None, str]:
    """One timing run through Megatron's own training loop (hfsdp/bench/pretrain_launch.py)."""
    stem = os.path.join(workdir, f"{config.name}-{repeat}")
    steps = opts.warmup_steps + opts.timed_steps
    cmd = pretrain.command([*flags, *config.flags], opts.nproc, steps, opts.ranks_per_gpu)
    caller = job_env(os.environ, opts.env)
    env = job_env(caller, dict(config.env), bases.run_env(config.name, opts.trees, caller),
                  pretrain.report_env(f"{stem}.report.json"))
    with open(f"{stem}.log", "w") as f:
        f.write(pretrain_launch.launch_line())
        f.flush()
        try:
            ended = run_group(cmd, timeout_s=timeout_s or opts.run_timeout, env=env, stdout=f)
        except BaseException as exc:  # Ctrl-C or SIGTERM of the invocation: keep what the run wrote
            if opts.keep_logs:
                f.flush()
                run_logs.keep_run(stem, opts.keep_logs, f"interrupted ({type(exc).__name__}) before the run ended")
            raise
    rc = "timeout" if ended.timed_out else ended.returncode
    failed: str | None = "not read"  # why the run does not count; kept beside its log (--from-logs)
    try:
        if rc != 0:
            raise pretrain_launch.RunFailed(f"rc={rc}")
        run = run_logs.read_run(config, repeat, stem, flags, opts)
        failed = None
    except pretrain_launch.RunFailed as exc:
        with open(f"{stem}.log", errors="replace") as f:
            text = f.read()
        said = bases.last_error_line(text)
        failed = f"{exc}: {said}" if said else str(exc)  # the marker names the error, not only the exit code
        return None, f"{exc}; log tail:\n{log_tail(text)}"
    finally:
        if opts.keep_logs:
            run_logs.keep_run(stem, opts.keep_logs, failed)
    return run, f"{stem}.log"


def startup_words(run: res.RunResult | None) -> str:
    """', step 2 at N s' where the run's log says when step 2 ended ([Note: start-up time])."""
    return "" if run is None or run.startup_s is None else f", step 2 at {run.startup_s:.0f}s"


def run_estimate(walls: Sequence[float]) -> tuple[float, str]:
    """How long the next run may take, for ``--time-budget``, and what that figure is: the longest
    run after the first once one has ended, else the first. The invocation's first run alone pays
    for cold caches (Triton compiles and autotuning, TE's kernels: minutes on a fresh machine,
    [Note: priming]); the runs after it find them filled, so it would overstate every later run."""
    if len(walls) > 1:
        return max(walls[1:]), "the longest run after the first"
    return walls[0], "the only run so far"


def run_all(order: Sequence[tuple[int, str]], flags: Sequence[str], opts: argparse.Namespace,
            start: float) -> tuple[list[res.RunResult], dict[str, str], dict[str, Any]]:
    """Launch every (repeat, configuration) of ``order``, after the optional priming run."""
    runs: list[res.RunResult] = []
    failures: dict[str, str] = {}
    primed: dict[str, Any] = {}
    kept = run_logs.kept_runs(opts.keep_logs, order, flags, opts) if opts.resume else {}
    with tempfile.TemporaryDirectory(prefix="hfsdp-bench-") as workdir:
        if order and not opts.no_prime and not kept:  # a resumed machine's caches are warm already
            # [Note: priming] The first process on a fresh machine compiles (Triton, inductor) and
            # autotunes, and takes far longer than the processes after it; a user-buffer run also
            # builds Megatron's NCCL allocator once. One discarded run per start-up class
            # (cfgs.startup_class) pays those costs before anything is timed.
            for name in bases.priming_runs([n for _, n in order]):
                t0 = time.time()
                run, _ = launch(bases.config(name), -1, flags, opts, workdir,
                                timeout_s=max(2 * opts.run_timeout, 300))
                wall = round(time.time() - t0, 1)
                primed[name] = {"wall_s": wall, "ok": run is not None,
                                "startup_s": run.startup_s if run is not None else None}
                print(f"[prime] {name} (discarded) {'ok' if run else 'FAILED'} in {wall:.0f}s"
                      f"{startup_words(run)}", flush=True)
        refused = run_logs.kept_upstream_failures(opts.keep_logs, order) if opts.resume else {}
        walls: list[float] = []  # every launched run's length: the estimate --time-budget uses
        for k, (repeat, name) in enumerate(order, 1):
            if (repeat, name) in kept:
                runs.append(kept[repeat, name])
                print(f"[{k}/{len(order)}] repeat {repeat} {name:<11} kept in {opts.keep_logs}", flush=True)
                continue
            if name in refused:  # a release that cannot run a configuration fails the same way again
                failures[f"{name}#{repeat}"] = f"not repeated: {refused[name]}"
                print(f"[{k}/{len(order)}] repeat {repeat} {name} not repeated (an earlier repeat failed)",
                      flush=True)
                continue
            # A run not repeated costs no time, so the budget is checked after that.
            if opts.time_budget and walls:
                estimate, what = run_estimate(walls)
                if time.time() - start + estimate > opts.time_budget:
                    failures[f"{name}#{repeat}"] = (f"not launched: --time-budget {opts.time_budget}s would end "
                                                    f"during it (estimate {estimate:.0f}s, {what})")
                    print(f"[{k}/{len(order)}] repeat {repeat} {failures[f'{name}#{repeat}']}", flush=True)
                    continue
            t0 = time.time()
            run, info = launch(bases.config(name), repeat, flags, opts, workdir)
            wall = time.time() - t0
            walls.append(wall)
            if run is None:
                failures[f"{name}#{repeat}"] = info
                if bases.split(name)[0] == bases.FORK:
                    print(f"[{k}/{len(order)}] repeat {repeat} {name:<11} FAILED after {wall:.0f}s\n{info}",
                          flush=True)
                else:  # an upstream release that cannot run a configuration: the reason in one line
                    why, _, tail = info.partition("; log tail:\n")
                    failures[f"{name}#{repeat}"] = refused[name] = bases.failure_line(name, why, tail)
                    print(f"[{k}/{len(order)}] repeat {repeat} {failures[f'{name}#{repeat}']} ({wall:.0f}s)",
                          flush=True)
                continue
            runs.append(run)
            step = f"median step {run.median_step_s * 1e3:8.1f} ms  " if opts.ranks_per_gpu == 1 else ""
            print(f"[{k}/{len(order)}] repeat {repeat} {name:<11} {step}peak alloc "
                  f"{run.peak_allocated_bytes / res.MIB:9.1f} MiB  peak reserved "
                  f"{run.peak_reserved_bytes / res.MIB:9.1f} MiB  (run {wall:.0f}s{startup_words(run)}, "
                  f"total {time.time() - start:.0f}s)", flush=True)
    return runs, failures, primed


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("benchmark_double_buffer", lambda: _with_trees(sys.argv[1:] if argv is None else argv))


def _with_trees(argv: Sequence[str]) -> int:
    """:func:`_main`, with a folder for the upstream trees it extracts that is removed when it ends."""
    with contextlib.ExitStack() as stack:
        return _main(argv, stack)


def wanted_configs(text: str) -> list[str]:
    """The configurations ``--configs`` names, in order; an unknown, missing or repeated name is refused."""
    return comma_choices("--configs", text, list(cfgs.CONFIGS), "configuration",
                         once="name each configuration once; --repeats runs each several times")


# Model flags the benchmark reads itself (tokens per step, the global batch): whole numbers > 0.
COUNTED_FLAGS = ("--seq-length", "--micro-batch-size", "--global-batch-size")


def check_counted_flags(flags: Sequence[str]) -> None:
    """Refuse a value of :data:`COUNTED_FLAGS` that is no count, before anything runs."""
    for i, tok in enumerate(flags):
        if tok in COUNTED_FLAGS:
            value = flags[i + 1] if i + 1 < len(flags) else None
            if value is None or value.startswith("--"):
                raise UserError(f"{tok} has no value", f"write {tok} N (after --, or in the preset)")
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"{tok} {value} is not a whole number > 0", f"write {tok} N, e.g. {tok} 2")


def check_paths(opts: argparse.Namespace, shared: bool) -> None:
    """Refuse, before anything runs, an output the end of the invocation could not write, and
    options that --from-logs, which launches nothing, would not use."""
    launch_only = [f"--{k.replace('_', '-')}" for k in ("keep_logs", "profile_dir", "pyprofile_dir",
                                                        "memory_trace_dir") if getattr(opts, k)]
    if opts.from_logs and launch_only:
        raise UserError(f"--from-logs launches nothing, so {', '.join(launch_only)} would record nothing",
                        f"drop {', '.join(launch_only)}, or drop --from-logs to launch the runs")
    if opts.resume and not opts.keep_logs:
        raise UserError("--resume takes the runs a --keep-logs folder holds, and no --keep-logs is given",
                        "add --keep-logs DIR (the folder of the invocation to go on with)")
    outputs = [("--out-json", opts.out_json)]
    if not opts.no_chart and not shared:
        outputs.append(("--out-png", opts.out_png))
    for option, path in outputs:
        output_file(option, path)
        try:  # made now, not after the runs: a folder that cannot be made is said before them
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        except OSError as exc:
            raise UserError(f"{option} {path}: its folder cannot be made ({exc.strerror or exc})",
                            f"give {option} a file in a folder you can write to") from None
    for option in launch_only:
        output_folder(option, getattr(opts, option[2:].replace("-", "_")))
    if opts.keep_logs:  # [Note: made by us] in hfsdp/functional/outdir.py; machine.json marks the folders we made
        refuse_foreign("--keep-logs", Path(opts.keep_logs), "give --keep-logs a new or empty folder",
                       marker=run_logs.MACHINE_FILE, ours=None, maker="the benchmark",
                       rule="it writes only into empty folders or those it made")


def chart_from(opts: argparse.Namespace) -> int:
    """``--chart-from``: redraw the chart of a results JSON."""
    from hfsdp.bench.chart import write_chart

    path = opts.chart_from
    fix = "give --chart-from a results JSON an earlier invocation wrote (--out-json)"
    if why := not_a_regular_file(path):
        raise UserError(f"--chart-from {path} {why}", fix)
    try:
        with open(path) as f:
            doc = loads_strict(f.read())
    except OSError as exc:
        raise UserError(f"--chart-from {path}: {exc.strerror or exc}", fix) from exc
    except ValueError as exc:
        raise UserError(f"--chart-from {path} is not JSON ({exc})", fix) from exc
    try:
        summaries = [res.ConfigSummary(**d) for d in doc["summary"]]
        title = (f"Megatron-FSDP double buffering, {doc['meta'].get('preset')} model, "
                 f"{gpus(doc['meta'].get('nproc'))}")
    except (KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"--chart-from {path} is not a benchmark results file (its summary or meta "
                        f"is missing or malformed)", fix) from exc
    output_file("--out-png", opts.out_png)
    write_chart(opts.out_png, summaries, title)
    print(f"wrote {opts.out_png}")
    return 0


def check_machine(flags: Sequence[str], opts: argparse.Namespace) -> None:
    """Refuse, before the priming run, a machine where every run would fail: too few CUDA GPUs for
    the ranks, or an optional package the model needs (as the main job and the entry do)."""
    from hfsdp.planner.setup import parse_flags
    from hfsdp.training.spec_error import SpecError

    gpus = fit.gpu_memory(env=job_env(os.environ, opts.env))
    torchrun.check_gpus(torchrun.Placement(nproc=opts.nproc, ranks_per_gpu=opts.ranks_per_gpu), len(gpus),
                        own_gpus_too=True)
    try:
        requirements.check(parse_flags(flags))
    except SpecError as exc:
        raise exc.user_error("install what the model needs, or change its flags after --") from None


def _narrowed(option: str, value: str | None, wanted: Sequence[str], runnable: list[str]) -> list[str]:
    """The runnable configurations that ``option`` (a comma-separated subset of --configs) keeps, in
    --configs order; all of them when it is not given."""
    if value is None:
        return list(runnable)
    keep = comma_choices(option, value, wanted, "configuration of --configs")
    return [n for n in runnable if n in keep]


def _main(argv: Sequence[str], stack: contextlib.ExitStack) -> int:
    opts, extra = parse(argv)
    base_names = bases.names(opts.base)
    if opts.chart_from:
        return chart_from(opts)
    # Flags after -- win over --deterministic's, which win over the preset's (its layout included).
    flags = cfgs.model_flags(opts.preset, cfgs.override_flags(
        cfgs.override_flags(cfgs.parallel_flags(opts.preset, opts.nproc),
                            te_determinism.argv() if opts.deterministic else []), extra))
    if opts.data_path is not None:
        flags = cfgs.with_data(flags, opts.data_path)
    check_counted_flags(flags)
    wanted = wanted_configs(opts.configs)
    if refusal := cfgs.preset_refusal(opts.preset, wanted):
        raise UserError(refusal, f"give te_* configurations with --preset {opts.preset}, or another preset")
    if not opts.from_logs and (absent := [m for m in cfgs.PRESET_NEEDS.get(opts.preset, ())
                                          if not requirements.importable(m)]):
        raise UserError(f"the {opts.preset} preset needs {', '.join(absent)}, which "
                        f"{'is' if len(absent) == 1 else 'are'} not importable here",
                        "install the GPU extras (docs/benchmark.md), or pick another preset")
    # --deterministic-mode from --deterministic or after --: what Megatron refuses beside it fails every run.
    if "--deterministic-mode" in flags and (clash := {n: r for n in wanted if (
            r := te_determinism.refused([*flags, *cfgs.CONFIGS[n].flags]))}):
        refused = sorted({f for r in clash.values() for f in r})
        source = "--deterministic gives every run" if opts.deterministic else "the flags after -- give every run"
        raise UserError(f"{source} --deterministic-mode, which Megatron refuses together with "
                        f"{', '.join(refused)} ({', '.join(clash)})",
                        "drop --deterministic-mode, or those configurations and flags")
    te_wanted = [n for n in wanted if cfgs.CONFIGS[n].spec == "te"]
    if te_wanted and not opts.from_logs and not requirements.importable("transformer_engine"):
        raise UserError(f"{', '.join(te_wanted)} need Transformer Engine, which is not importable here",
                        f"install the TE extra, "
                        f"{extras.install_hint(extras.te_extra(requirements.torch_cuda_version()))}, "
                        "or drop the te_* configurations from --configs")
    graphed = [n for n in wanted if cfgs.CONFIGS[n].graphed]
    if profiling(opts) and base_names != [bases.FORK]:
        raise UserError("the profiling passes (--profile-dir, --pyprofile-dir, --memory-trace-dir) run the bench "
                        "worker, which needs the fork's tree", "profile the fork alone (--base fork)")
    if graphed and profiling(opts):
        raise UserError(f"{', '.join(graphed)} run under a CUDA graph inside pretrain, which the profiling "
                        "passes (--profile-dir, --pyprofile-dir, --memory-trace-dir) cannot time: they use "
                        "the bench worker", "drop those configurations or the profiling option")
    if graphed and opts.warmup_steps < GRAPH_WARMUP_STEPS + 2:
        raise UserError(f"--warmup-steps {opts.warmup_steps} would time the eager warm-up or the capture step "
                        f"of {', '.join(graphed)}", f"give --warmup-steps {GRAPH_WARMUP_STEPS + 2} or more")
    try:
        every = pretrain.log_interval(flags)
    except ValueError:
        every = 0
    if every < 1:
        raise UserError(f"--log-interval {pretrain.flag_value(flags, '--log-interval')} (after --) is not a whole "
                        "number of steps", "give --log-interval 1 or more, or leave it out (every step is logged)")
    if opts.warmup_steps % every or opts.timed_steps % every:
        raise UserError(f"--log-interval {every} logs every {every}th step, so --warmup-steps {opts.warmup_steps} "
                        f"and --timed-steps {opts.timed_steps} must be multiples of it (a timed value is the mean "
                        "of one interval)", f"give multiples of {every}, or another --log-interval")
    if every > pretrain_launch.STARTUP_STEP:
        print(f"note: --log-interval {every} leaves step {pretrain_launch.STARTUP_STEP} unlogged, so no run reports "
              "its start-up", flush=True)
    shared = opts.ranks_per_gpu > 1
    check_paths(opts, shared)
    if not opts.from_logs:
        check_machine(flags, opts)
    if shared and (opts.profile_dir or opts.pyprofile_dir):
        raise UserError(f"--profile-dir and --pyprofile-dir time the steps, and at --ranks-per-gpu "
                        f"{opts.ranks_per_gpu} the ranks share a GPU, so their timings say nothing",
                        "profile with one rank per GPU (--memory-trace-dir works in either mode)")
    if shared and not opts.from_logs:
        placement = torchrun.Placement(nproc=opts.nproc, ranks_per_gpu=opts.ranks_per_gpu)
        steps = opts.warmup_steps + opts.timed_steps
        print(fit.preflight(placement, pretrain.training_flags(flags, opts.nproc, steps),
                            environ=job_env(os.environ, opts.env)), flush=True)
    if opts.deterministic:
        print(te_determinism.describe(), flush=True)  # what every run of this invocation gets, and why
    if opts.baseline not in wanted:
        if opts.baseline != res.BASELINE:
            raise UserError(f"--baseline {opts.baseline} is not among --configs ({', '.join(wanted)})",
                            f"add {opts.baseline} to --configs, or name one of them")
        print(f"note: {res.BASELINE} not selected; ratios vs baseline will be empty")
    runnable, skipped = [], {}
    for name in wanted:
        reason = cfgs.availability(name)
        if reason is None:
            runnable.append(name)
        else:
            skipped[name] = reason
            print(f"skip {name}: {reason}")
    if opts.fork_configs is not None and bases.FORK not in base_names:
        raise UserError("--fork-configs narrows what the fork runs, but --base does not name the fork",
                        f"add {bases.FORK} to --base, or leave --fork-configs out")
    fork_configs = _narrowed("--fork-configs", opts.fork_configs, wanted, runnable)
    release_configs = _narrowed("--release-configs", opts.release_configs, wanted, runnable)
    rows = fork_configs if bases.FORK in base_names else []
    opts.trees, base_meta = bases.resolve(base_names, Path(opts.bases_dir), stack, build=not opts.from_logs)
    if upstream := [b for b in base_names if b != bases.FORK]:
        for base in upstream:
            offers = bases.capabilities(base, opts.trees, job_env(os.environ, opts.env))
            for name in release_configs:
                row = bases.run_name(base, name)
                if (reason := bases.refusal(row, flags, offers)) is None:
                    rows.append(row)
                else:
                    skipped[row] = reason
                    print(f"skip {row}: {reason}")
    fork_rows = [n for n in rows if n in cfgs.CONFIGS]  # the planner plans the fork's pools only
    plans = None if opts.no_plan or not fork_rows else Plans(flags, opts.nproc, opts.env, fork_rows)
    order = res.interleaved_order(rows, opts.repeats)
    start = time.time()
    primed: dict[str, Any] = {}
    try:
        if opts.from_logs:
            runs, failures = run_logs.runs_from_logs(opts.from_logs, order, flags, opts)
        else:
            if opts.keep_logs:
                run_logs.claim_machine(opts.keep_logs)  # before any run: a folder holds one machine's runs
            runs, failures, primed = run_all(order, flags, opts, start)  # the planner runs meanwhile
        planned = {} if plans is None else plans.result()
    finally:
        if plans is not None:
            plans.stop()
    # Without the fork, ratios divide by the first release's row of --baseline.
    baseline = bases.run_name(base_names[0], opts.baseline)
    summaries = res.summarize(runs, planned=planned, baseline=baseline)
    print("\n".join(res.format_table(summaries, speed=not shared)))
    if opts.baseline != res.BASELINE:
        print(f"x base: against {opts.baseline}")
    if shared:
        print(res.no_speed_note(opts.ranks_per_gpu))
    # TE configurations also against their own eager baseline (the TE targets are ratios to it).
    te_runs = [r for r in runs if bases.config(r.config).spec == "te"]
    te_summaries = res.summarize(te_runs, planned=planned, baseline=cfgs.BASELINES["te"])
    if te_runs:
        print(f"Transformer Engine configurations, x base against {cfgs.BASELINES['te']}:")
        print("\n".join(res.format_table(te_summaries, speed=not shared)))
    agreements = {base: res.loss_agreement([r for r in runs if r.config in names], base)
                  for base, names in bases.loss_groups([r.config for r in runs]).items()}
    for agreement in agreements.values():
        print("\n".join(res.format_loss_agreement(agreement)))
    print("\n".join(res.format_pool_check(summaries, runs, baseline, dp_size=opts.nproc)))
    if startup := res.format_startup(runs):
        print("\n".join(startup))
    best = bases.best_per_base(summaries) if not shared else {}
    if best_lines := bases.format_best(best):
        print("\n".join(best_lines))
    for key, why in failures.items():  # a release's failed runs again, one line each, below its best
        if (base := bases.split(key)[0]) != bases.FORK:
            print(why if why.startswith(f"{base} ") else f"{key}: {why}")
    speed = model_speed(flags, summaries, runs, opts) if not shared else {}
    meta = {
        "preset": opts.preset, "model_flags": flags, "nproc": opts.nproc, "baseline": opts.baseline,
        "ranks_per_gpu": opts.ranks_per_gpu, "speed": res.no_speed_note(opts.ranks_per_gpu) if shared else "measured",
        "repeats": opts.repeats, "warmup_steps": opts.warmup_steps,
        "timed_steps": opts.timed_steps, "order": order, "skipped": skipped,
        "failures": failures, "primed": primed, "env": opts.env, "from_logs": opts.from_logs,
        "resumed_from": opts.keep_logs if opts.resume else None,
        "configs": {n: cfgs.CONFIGS[n].description for n in wanted},
        # The runs' own machine (their reports); profiling runs report none: this process's torch.
        "torch": _torch_version(), **res.machine(runs),
        "optional_packages": requirements.installed_versions(),  # the runs inherit this environment
        "wall_s": None if opts.from_logs else round(time.time() - start, 1),
        "deterministic": opts.deterministic,
        # Per --base: the fork's version, or a release's sdist (file name, sha256, where it came from).
        "bases": base_meta, "best_per_base": best,
        "peak_memory_from": ("the run report pretrain_gpt.py writes (HFSDP_RUN_REPORT), on the fork and on "
                             "upstream trees alike; upstream rows have no pool or home-miss figures"),
        **speed,
    }
    doc = res.to_json(summaries, runs, meta, agreements)
    if te_runs:
        doc["summary_te"] = [dataclasses.asdict(s) for s in te_summaries]
    if shared:
        doc = res.without_speed(doc)
    try:
        res.write_json(opts.out_json, doc)
    except NonFiniteJSON as exc:  # a number no run should have let through: refused, not half-written
        raise UserError(str(exc), "the runs' logs and reports hold it: check them; nothing was written") from exc
    print(f"wrote {opts.out_json}")
    if shared and not opts.no_chart:
        print("chart skipped: it plots step times, which this mode does not measure")
    elif not opts.no_chart and summaries:
        from hfsdp.bench.chart import ChartUnavailable, write_chart

        try:
            write_chart(opts.out_png, summaries,
                        f"Megatron-FSDP double buffering, {opts.preset} model, {gpus(opts.nproc)}")
            print(f"wrote {opts.out_png}")
        except ChartUnavailable as exc:
            print(f"chart skipped: {exc}")
    return 1 if failures else 0


def model_speed(flags: Sequence[str], summaries: Sequence[res.ConfigSummary], runs: Sequence[res.RunResult],
                opts: argparse.Namespace) -> dict[str, Any]:
    """Model FLOPs per token and each configuration's MFU ([Note: model FLOPs] in flops.py),
    printed and returned for the JSON's meta."""
    from hfsdp.planner.setup import parse_flags

    model = flops.model_flops(parse_flags(flags))
    device = res.machine(runs).get("device")
    peak = flops.peak_flops(device, opts.peak_tflops)
    per_config = {s.config: flops.mfu(s.tokens_per_s, opts.nproc, model.training, peak) for s in summaries}
    # FP8 configurations against the FP8 peak as well (a given --peak-tflops is the bf16 one).
    fp8_peak = flops.peak_flops(device, fp8=True) if opts.peak_tflops is None else None
    per_fp8 = {s.config: flops.mfu(s.tokens_per_s, opts.nproc, model.training, fp8_peak) for s in summaries
               if cfgs.FP8_FLAG in bases.config(s.config).flags}
    where = f"{peak / 1e12:.0f} TFLOP/s a GPU" if peak else f"no MFU: the peak of {device or 'this GPU'} is unknown"
    print(f"model FLOPs per token, training: {model.training / 1e9:.2f} GFLOP ({where}; --peak-tflops gives one)")
    for config, value in per_config.items():
        if value is not None:
            fp8 = per_fp8.get(config)
            against = f" (bf16 peak); {fp8 * 100:.1f} % of the FP8 peak" if fp8 is not None else ""
            print(f"  {config:<20} MFU {value * 100:.1f} %{against}")
    return {"model_flops_per_token": model.training, "model_flops_forward": dataclasses.asdict(model),
            "peak_flops_per_gpu": peak, "mfu": per_config,
            **({"peak_fp8_flops_per_gpu": fp8_peak, "mfu_fp8_peak": per_fp8} if per_fp8 else {})}


def gpus(n: Any) -> str:
    """'1 GPU', '2 GPUs' (chart titles)."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _torch_version() -> Any:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return None
