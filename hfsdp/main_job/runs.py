"""One ``pretrain`` run of the main job: its flags, its environment, the CUDA-graph capture check
of its flags, the run itself (whole output to a log file, step lines to the console) and its
median step time."""

from __future__ import annotations

import os
import shlex
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hfsdp.flagsets import GRAPH_FLAGS, GRAPH_WARMUP_STEPS
from hfsdp.functional import logparse
from hfsdp.launch import pretrain
from hfsdp.launch.env import shared_autotune
from hfsdp.main_job.logs import FAILED_TAIL_LINES, failed_lines, shown
from hfsdp.usererror import UserError

MIB = 2**20
# Steps before the timed window: the eager warm-up steps, the capture step and one replay.
SETTLE_STEPS = GRAPH_WARMUP_STEPS + 2
TRAIN_FLAGS = ("--megatron-fsdp-main-params-dtype", "fp32", "--megatron-fsdp-main-grads-dtype",
               "fp32", "--lr-warmup-iters", "3", "--weight-decay", "0.1", "--clip-grad", "1.0")
# Megatron turns on one_logger (an NVIDIA-internal metrics package) unless told otherwise, and
# without the package every run prints a warning whose link only NVIDIA staff can open. The runs
# pass --no-one-logger unless the package is installed or the caller chose.
NO_ONE_LOGGER = "--no-one-logger"
# Under a full-iteration graph, cache the eager warm-up left in segments that a live block pins
# stays reserved beside the graph's pool; expandable segments hand it back page by page
# (docs/cuda-graphs.md, "Memory"; measured in docs/results.md). Only on one GPU: with several ranks a
# graph holds NCCL collectives, which need NCCL_GRAPH_REGISTER=0 beside expandable segments
# (megatron/training/cuda_graph_checks.py), and Megatron-FSDP refuses it with --use-nccl-ub on
# torch < 2.11. An allocator setting the caller made (either variable) is kept whole.
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_DEFAULT = "expandable_segments:True"


def one_logger_flags(flags: Sequence[str]) -> list[str]:
    """``--no-one-logger`` when one_logger is not installed and ``flags`` do not have it yet."""
    import importlib.util

    if NO_ONE_LOGGER in flags or importlib.util.find_spec("one_logger") is not None:
        return []
    return [NO_ONE_LOGGER]


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


def median_step_ms(log_path: str, first_step: int) -> float | None:
    times = logparse.parse_file(log_path).get("iteration-time", {})
    window = [t for step, t in times.items() if step >= first_step]
    return statistics.median(window) * 1e3 if window else None


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

    cmd = pretrain.command(flags, nproc, steps, ranks_per_gpu)
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
