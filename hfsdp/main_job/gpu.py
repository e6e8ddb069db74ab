"""The main job on this machine's GPUs: the graphed run (eager where the model cannot be
captured, saying why), a short eager run for comparison and, on one GPU, the DP=2 rehearsal
(:mod:`hfsdp.main_job.rehearsal`). The package docstring (:mod:`hfsdp.main_job`) names its knobs."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hfsdp.flagsets import GRAPH_FLAGS, MAXPOOL_FLAGS
from hfsdp.launch import fit
from hfsdp.main_job.logs import IN_PROCESS_LOG, job_folder, shown, stderr_into
from hfsdp.main_job.rehearsal import REHEARSAL_NPROC, rehearse
from hfsdp.main_job.runs import (
    SETTLE_STEPS,
    TRAIN_FLAGS,
    capture_problems,
    median_step_ms,
    one_logger_flags,
    train,
)
from hfsdp.planner.pools import NEVER_GATHERED
from hfsdp.planner.setup import DEFAULT_MODEL_FLAGS
from hfsdp.usererror import env_number, run_cli


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
        print(f"{NEVER_GATHERED}, so nothing passed through "
              "the double buffer in the runs above" + ("; the DP=2 rehearsal exercised it" if rehearsal else ""))
    if rehearsal is not None:
        print("\n".join(rehearsal.lines()))
    print(f"The runs' whole output: {shown(job)}")
    if rehearsal is not None and (rehearsal.failed or rehearsal.identical_steps != rehearsal.steps
                                  or rehearsal.home_misses):
        return 1
    return 0
