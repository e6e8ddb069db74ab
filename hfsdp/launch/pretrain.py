"""A ``pretrain`` run of the fork, as our tools launch one: ``torchrun pretrain_gpt.py`` with a timing run's
common flags (hfsdp/launch/torchrun.py places the ranks). The benchmark's timing runs
(hfsdp/bench/pretrain_launch.py reads their results) and the main job's runs (hfsdp/main_job/runs.py)
are launched this one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hfsdp.launch import torchrun
from hfsdp.training import run_report

TRAINING_SCRIPT = Path(__file__).resolve().parents[2] / "pretrain_gpt.py"
# Micro-batches per step and data-parallel rank: more than one, as in real training, so the
# gradient-accumulation path is part of every timed (and captured) step.
MICRO_BATCHES = 2
# Flags every timing run shares. Full-iteration capture requires the NaN check off; eager runs
# get the same so graphed and eager runs do identical host work apart from the graph. Megatron logs
# every step unless the caller's flags give --log-interval themselves (log_interval).
COMMON_FLAGS = (
    "--no-check-for-nan-in-loss-and-grad", "--lr", "1e-4", "--min-lr", "1e-5",
    "--lr-decay-style", "cosine", "--seed", "1234", "--split", "99,1,0",
    "--eval-iters", "0", "--eval-interval", "1000000",
)
LOG_INTERVAL_FLAG = "--log-interval"


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value of the last ``name value`` pair in ``flags`` (None when absent)."""
    found = None
    for i, tok in enumerate(flags[:-1]):
        if tok == name:
            found = flags[i + 1]
    return found


def log_interval(flags: Sequence[str]) -> int:
    """Megatron's log interval for a run of ``flags``: theirs, else 1 (every step logged)."""
    return int(flag_value(flags, LOG_INTERVAL_FLAG) or 1)


def training_flags(flags: Sequence[str], nproc: int, steps: int) -> list[str]:
    """``flags`` plus what a timing run needs: step count, logging (every step unless ``flags`` give
    ``--log-interval``), and a global batch of ``MICRO_BATCHES`` micro-batches per rank unless
    ``flags`` already set one."""
    out = [*flags, *COMMON_FLAGS, LOG_INTERVAL_FLAG, str(log_interval(flags)), "--train-iters", str(steps)]
    if flag_value(flags, "--global-batch-size") is None:
        mbs = int(flag_value(flags, "--micro-batch-size") or 1)
        out += ["--global-batch-size", str(mbs * nproc * MICRO_BATCHES)]
    return out


def command(flags: Sequence[str], nproc: int, steps: int, ranks_per_gpu: int = 1) -> list[str]:
    """torchrun of ``pretrain_gpt.py`` with ``nproc`` ranks on this host (hfsdp/launch/torchrun.py)."""
    placement = torchrun.Placement(nproc=nproc, ranks_per_gpu=ranks_per_gpu)
    return torchrun.command(placement, [str(TRAINING_SCRIPT), *training_flags(flags, nproc, steps)])


def report_env(report_path: str) -> dict[str, str]:
    """The variable that makes a run write its report (layered on the caller's environment)."""
    return {run_report.ENV: report_path}
