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

Environment: ``TRAIN_ITERS`` (graphed run, default 30), ``EAGER_ITERS`` (comparison, default
10, 0 skips it), ``REHEARSAL_ITERS`` (DP=2 rehearsal, default 8, 0 skips it), ``NPROC``
(default: all GPUs). The runs get the caller's environment, plus
``TRITON_CACHE_AUTOTUNING=1`` when it is unset (see ``SHARED_AUTOTUNE_ENV``) and, on one GPU,
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when neither it nor ``PYTORCH_ALLOC_CONF``
is set (see ``ALLOC_CONF_ENV``).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hfsdp import te_determinism
from hfsdp.bench import pretrain_launch
from hfsdp.bench.configs import GRAPH_FLAGS, GRAPH_WARMUP_STEPS, MAXPOOL_FLAG
from hfsdp.functional import logparse
from hfsdp.launch import fit, torchrun
from hfsdp.planner.setup import DEFAULT_MODEL_FLAGS

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


def capture_problems(flags: Sequence[str], nproc: int) -> list[str]:
    """Why ``flags`` + full-iteration graphs cannot be captured (Megatron's own parse, CPU)."""
    import argparse
    import contextlib
    import io
    from unittest import mock

    import megatron.training.arguments as margs
    from megatron.training.cuda_graph_checks import cuda_graph_arg_problems

    # Megatron's parser reads the launcher's WORLD_SIZE and RANK for some defaults; give them
    # for this parse only, where the caller has not, so the job's own environment stays as it was.
    launch = {k: v for k, v in (("WORLD_SIZE", str(nproc)), ("RANK", "0")) if k not in os.environ}
    parser = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    with mock.patch.dict(os.environ, launch), contextlib.redirect_stderr(io.StringIO()):
        args = parser.parse_args([*flags, *GRAPH_FLAGS])
    args.world_size = nproc  # Megatron's parse_args sets it from WORLD_SIZE; the bare parser does not
    return cuda_graph_arg_problems(args, run_env(os.environ, nproc, flags))


def print_capture_check(extra: Sequence[str] = (), nproc: int = 1) -> bool:
    """Say whether the main job's model would train under a full-iteration CUDA graph."""
    problems = capture_problems([*DEFAULT_MODEL_FLAGS, *MAXPOOL_FLAGS, *extra], nproc)
    if problems:
        print("the main job's model cannot be captured; on a GPU it would train eagerly:\n  - "
              + "\n  - ".join(problems))
    else:
        print("the main job's model passes the CUDA-graph capture checks: on a GPU it trains "
              "with the max-pool double buffer under a full-iteration CUDA graph")
    return not problems


def median_step_ms(log_path: str, first_step: int) -> float | None:
    times = logparse.parse_file(log_path).get("iteration-time", {})
    window = [t for step, t in times.items() if step >= first_step]
    return statistics.median(window) * 1e3 if window else None


# Triton autotunes the Mamba kernels in the first step of every process: about 100 s per run on
# an H100 for the default model, paid again by the eager comparison. With this variable Triton
# keeps the timed choice in its on-disk cache, so the second run (and the next main job) reuses
# it. A value the caller set is kept as it is.
SHARED_AUTOTUNE_ENV = "TRITON_CACHE_AUTOTUNING"
# Under a full-iteration graph, cache the eager warm-up left in segments that a live block pins
# stays reserved beside the graph's pool; expandable segments hand it back page by page. On the
# default model with TE specs this took graphed peak reserved from 1.094x to 1.016x eager's
# (docs/cuda-graphs.md, "Memory"). Only on one GPU, where it was measured: with several ranks a
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
    env.setdefault(SHARED_AUTOTUNE_ENV, "1")
    # torch reads PYTORCH_ALLOC_CONF before PYTORCH_CUDA_ALLOC_CONF: either is the caller's choice.
    chosen = any(name in env for name in ("PYTORCH_ALLOC_CONF", ALLOC_CONF_ENV))
    if nproc == 1 and "--use-nccl-ub" not in flags and not chosen:
        env[ALLOC_CONF_ENV] = ALLOC_CONF_DEFAULT
    return env


def train(flags: Sequence[str], nproc: int, steps: int, log_path: str, ranks_per_gpu: int = 1,
          extra_env: Mapping[str, str] | None = None) -> int:
    """One ``pretrain`` run; its output goes to the terminal and to ``log_path``.

    Started as a process group (:func:`hfsdp.proc.run_group`), so no worker outlives the run.
    ``extra_env`` is added where the caller's environment leaves a variable unset.
    """
    from hfsdp.proc import run_group

    cmd = pretrain_launch.command(flags, nproc, steps, ranks_per_gpu)
    print("+ " + " ".join(cmd), flush=True)
    env = run_env(os.environ, nproc, flags)
    for key, value in (extra_env or {}).items():
        env.setdefault(key, value)
    with open(log_path, "w") as log:

        def tee(line: str) -> None:
            sys.stdout.write(line)
            log.write(line)

        ended = run_group(cmd, on_line=tee, env=env)
    if ended.stragglers:
        print(f"main_job: ended {len(ended.stragglers)} worker(s) left behind by the run",
              file=sys.stderr)
    return ended.returncode


REHEARSAL_NPROC = 2
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
    from hfsdp.launch import fit
    from hfsdp.training import run_report

    twin = [f for f in base if f not in MAXPOOL_FLAGS]
    runs = {"twin": [*twin, *REHEARSAL_FLAGS],
            "maxpool": [*base, *REHEARSAL_FLAGS, *(GRAPH_FLAGS if graphed else ())]}
    out = Rehearsal(steps=steps)
    placement = torchrun.Placement(nproc=REHEARSAL_NPROC, ranks_per_gpu=REHEARSAL_NPROC)
    # Pinned Triton choices: the DP=1 runs cached timed choices for some kernels only, and two
    # ranks timing one kernel at once may choose differently; pinned, both runs take the same.
    deterministic = te_determinism.env("pin")
    print(fit.preflight(placement, pretrain_launch.training_flags(runs["maxpool"], REHEARSAL_NPROC, steps),
                        environ={**deterministic, **os.environ}))
    reports: dict[str, dict] = {}
    losses: dict[str, dict[int, float]] = {}
    for name, flags in runs.items():
        log, report = os.path.join(workdir, f"dp2-{name}.log"), os.path.join(workdir, f"dp2-{name}.json")
        env = {**deterministic, run_report.ENV: report}
        if train(flags, REHEARSAL_NPROC, steps, log, REHEARSAL_NPROC, env) != 0:
            out.failed = f"the {name} run failed; see its output above"
            return out
        try:
            reports[name] = run_report.read(report, REHEARSAL_NPROC)
        except (OSError, ValueError, KeyError) as exc:
            out.failed = f"the {name} run left no complete run report ({exc})"
            return out
        losses[name] = logparse.parse_file(log).get("lm loss", {})
    same = [s for s in range(1, steps + 1) if s in losses["twin"] and losses["twin"][s] == losses["maxpool"].get(s)]
    out.identical_steps = len(same)
    pooled = reports["maxpool"]
    out.pool_bytes = pooled.get("pool_bytes_measured")
    out.home_misses = (pooled.get("maxpool_stats") or {}).get("home_misses")
    out.peak_allocated = (reports["twin"]["peak_allocated_bytes"], pooled["peak_allocated_bytes"])
    out.planned_pool_bytes = planned_pools(base, REHEARSAL_NPROC, names=["maxpool"]).get("maxpool", {}).get(
        "pool_bytes")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    extra = list(sys.argv[1:] if argv is None else argv)
    nproc = int(os.environ.get("NPROC") or torch.cuda.device_count())
    if nproc < 1:
        print("main_job: no CUDA GPU here; training needs one (scripts/run_main.sh runs the "
              "CPU part instead).", file=sys.stderr)
        return 2
    base = [*DEFAULT_MODEL_FLAGS, *MAXPOOL_FLAGS, *TRAIN_FLAGS, *one_logger_flags(extra), *extra]
    steps = int(os.environ.get("TRAIN_ITERS", "30"))
    problems = capture_problems(base, nproc)
    graphed = not problems and steps > SETTLE_STEPS
    if problems:
        print("main_job: this configuration cannot run under a full-iteration CUDA graph, so it "
              "trains eagerly:\n  - " + "\n  - ".join(problems))
    elif not graphed:
        print(f"main_job: TRAIN_ITERS={steps} leaves no step after the CUDA-graph capture "
              f"(it needs more than {SETTLE_STEPS}); training eagerly.")
    with tempfile.TemporaryDirectory(prefix="hfsdp-main-") as tmp:
        label = "max-pool + full-iteration CUDA graph" if graphed else "max-pool, eager"
        print(f"== main_job: training on {nproc} GPU(s): {label} ==", flush=True)
        main_log = os.path.join(tmp, "main.log")
        rc = train([*base, *(GRAPH_FLAGS if graphed else ())], nproc, steps, main_log)
        if rc != 0:
            print(f"main_job: training failed (exit {rc}); see the output above.", file=sys.stderr)
            return rc
        first = SETTLE_STEPS + 1 if graphed else 3
        ms = median_step_ms(main_log, first)
        eager_iters = int(os.environ.get("EAGER_ITERS", "10"))
        eager_ms = None
        if graphed and eager_iters > 3:
            print(f"== main_job: the same model eager, {eager_iters} steps, for comparison ==",
                  flush=True)
            eager_log = os.path.join(tmp, "eager.log")
            if train(base, nproc, eager_iters, eager_log) == 0:
                eager_ms = median_step_ms(eager_log, 3)
        idle = fit.data_parallel_size(base, nproc) == 1
        rehearsal_iters = int(os.environ.get("REHEARSAL_ITERS", "8"))
        rehearsal = None
        if idle and rehearsal_iters > 0:
            rehearsal_graphed = not capture_problems(base, REHEARSAL_NPROC) and rehearsal_iters > SETTLE_STEPS
            print(f"== main_job: data-parallel size 2 on this GPU (2 ranks share it), {rehearsal_iters} steps: "
                  "max-pool " + ("graphed" if rehearsal_graphed else "eager")
                  + " vs no double buffer, deterministic ==", flush=True)
            rehearsal = rehearse(base, rehearsal_iters, rehearsal_graphed, tmp)
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
        if rehearsal.failed or rehearsal.identical_steps != rehearsal.steps or rehearsal.home_misses:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
