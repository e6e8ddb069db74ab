"""Timing runs through Megatron's own training loop.

One run is one fresh ``torchrun pretrain_gpt.py`` of one configuration: the same ``pretrain``
users launch, so a full-iteration CUDA graph (which lives inside ``train_step``) is timed the
way it runs in training. Step times and losses come from Megatron's log (``--log-interval
1``: "elapsed time per iteration" is the wall time between consecutive steps, data loading,
optimizer step and logging included; with ``-- --log-interval K`` each timed value and loss is the
mean over one interval of K steps, as a training run logs them); peak memory, pool bytes and max-pool home misses come
from the run report the entry point writes (``HFSDP_RUN_REPORT``, hfsdp/training/run_report.py).
The command and its flags are the one way our tools launch ``pretrain`` (hfsdp/launch/pretrain.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime

from hfsdp.bench.results import RunResult
from hfsdp.functional import logparse
from hfsdp.launch.pretrain import flag_value, log_interval, training_flags
from hfsdp.training import run_report
from hfsdp.usererror import not_a_regular_file

# [Note: start-up time] A run's start-up is the wall time from its launch to the line of step 2:
# imports, model build, the first step (Triton and inductor compiles, autotuning, the NCCL
# allocator's build, graph warm-up) and one more step. The launcher writes the launch time as the
# log's first line, in Megatron's own stamp format, so a kept log (--keep-logs, --from-logs)
# still has it; both stamps come from this machine's local clock.
LAUNCH_MARK = "[hfsdp-bench] launched at "
STARTUP_STEP = 2


def launch_line(now: datetime | None = None) -> str:
    """The first line of a run's log: when it was launched."""
    return f"{LAUNCH_MARK}[{(now or datetime.now()).strftime(logparse.TIME_FORMAT)}]\n"


def startup_seconds(log_path: str) -> float | None:
    """Seconds from the launch line to step :data:`STARTUP_STEP`'s line, or None when the log lacks
    either (a log written before launch lines existed, or a run that ended sooner)."""
    launched: float | None = None
    with open(log_path, errors="replace") as f:
        first = f.readline()
        if first.startswith(LAUNCH_MARK):
            launched = logparse.clock(first[len(LAUNCH_MARK):].strip().strip("[]"))
        steps = logparse.step_clock(f)
    if launched is None or STARTUP_STEP not in steps:
        return None
    return round(steps[STARTUP_STEP] - launched, 1)


class RunFailed(RuntimeError):
    """A run finished without the numbers a result needs; the message says which."""


def result(config: str, repeat: int, log_path: str, report_path: str, *, warmup_steps: int,
           timed_steps: int, nproc: int, flags: Sequence[str]) -> RunResult:
    """The RunResult of a finished run, from its log and its run report.

    A run without a usable timing fails (:class:`RunFailed`, one sentence naming the file): a
    timed step whose time is missing, not a number > 0 (``nan``, ``inf``), a loss that is not
    finite (the run diverged, so its steps are not those of training), or a run report that
    cannot be read as one."""
    if why := not_a_regular_file(log_path):  # a named pipe or a device would block the read, or never end
        raise RunFailed(f"log {log_path} {why}")
    try:
        metrics = logparse.parse_file(log_path)
    except OSError as exc:
        raise RunFailed(f"log unreadable: {log_path}: {exc.strerror or exc}") from exc
    times = metrics.get("iteration-time", {})
    # With --log-interval K Megatron logs every K-th step, its time and loss the means over the K steps.
    every = log_interval(flags)
    timed = [s for s in range(warmup_steps + 1, warmup_steps + timed_steps + 1) if s % every == 0]
    if other := [s for s in sorted(times) if s > 1 and s % every]:
        raise RunFailed(f"{log_path} logs step {other[0]}: it was not written with --log-interval {every}, whose "
                        "intervals this invocation times")
    missing = [s for s in timed if s not in times]
    if missing:
        raise RunFailed(f"no step time logged for steps {missing[:5]}"
                        f"{'...' if len(missing) > 5 else ''} in {log_path}")
    if bad := [s for s in timed if not (math.isfinite(times[s]) and times[s] > 0)]:
        raise RunFailed(f"step {bad[0]} took {times[bad[0]] * 1e3:g} ms by {log_path}, not a time; "
                        f"{len(bad)} of the {len(timed)} timed steps have none")
    losses = metrics.get("lm loss", {})
    total = warmup_steps + timed_steps
    if diverged := [s for s in range(1, total + 1) if s in losses and not math.isfinite(losses[s])]:
        raise RunFailed(f"lm loss is {losses[diverged[0]]} at step {diverged[0]} in {log_path}: the run diverged")
    try:
        report = run_report.read(report_path, nproc)
    except OSError as exc:
        raise RunFailed(f"run report unreadable: {exc.filename or report_path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise RunFailed(f"run report unreadable: {exc}") from exc
    seq = int(flag_value(flags, "--seq-length") or 0)
    gbs = int(flag_value(training_flags(flags, nproc, total), "--global-batch-size") or 0)
    return RunResult(
        config=config, repeat=repeat,
        step_times_s=tuple(times[s] for s in timed),
        tokens_per_step=gbs * seq,
        peak_allocated_bytes=int(report["peak_allocated_bytes"]),
        peak_reserved_bytes=int(report["peak_reserved_bytes"]),
        pool_bytes_measured=report.get("pool_bytes_measured"),
        lm_loss=tuple(losses.get(s) for s in range(1, total + 1)),
        maxpool_stats=report.get("maxpool_stats"),
        cuda_graph_captured=report.get("cuda_graph_captured"),
        torch=report.get("torch"), device=report.get("device"),
        startup_s=startup_seconds(log_path),
    )
