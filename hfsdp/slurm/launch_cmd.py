"""Print, one argument per line, the direct (no torchrun) command for a case's single run.

Used by the srun-per-GPU sbatch mode: every task runs this command with RANK/LOCAL_RANK/
WORLD_SIZE taken from SLURM, so the driver is not in the loop while training. ``--env KEY=VALUE``
wins over the case's ENV_VARS, as in the driver; ``--ranks-per-gpu N`` starts each rank through
:mod:`hfsdp.launch.shared_gpu` (``LOCAL_RANK`` = ``SLURM_LOCALID`` -> the GPU index).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from hfsdp.functional import outdir
from hfsdp.functional.recipe import args_to_argv, load_recipe
from hfsdp.functional.run_case import output_dir_for, path_variables, script_target
from hfsdp.launch.env import add_env_option, parse_assignments
from hfsdp.launch.torchrun import SHARED_GPU_MODULE, add_ranks_per_gpu_option
from hfsdp.usererror import UserError, run_cli


def command(case_dir: Path, output_root: Path | None, exit_mins: float | None,
            python: str = sys.executable, env: Mapping[str, str] | None = None,
            ranks_per_gpu: int = 1) -> list[str]:
    """The rank's command: ``env`` (``--env``) wins over the case's ENV_VARS, as in the driver."""
    recipe = load_recipe(case_dir)
    if recipe.test_type == "ckpt-resume":
        raise UserError(f"{case_dir} is a ckpt-resume case; srun-per-GPU mode runs single-run cases only",
                        "submit it with --launcher torchrun")
    if output_root is not None:
        outdir.check_root(output_root)
    out = outdir.prepare(output_dir_for(recipe, output_root), clear=True)  # no stale checkpoint
    argv = args_to_argv(recipe.model_args, path_variables(out))
    if exit_mins is not None and "--exit-duration-in-mins" not in argv:
        argv += ["--exit-duration-in-mins", f"{exit_mins:g}"]
    layers: dict[str, str | None] = {**recipe.env_vars, **(env or {})}
    unset = [a for k, v in layers.items() if v is None for a in ("-u", k)]  # None: unset, as in the driver
    assign = [f"{k}={v}" for k, v in layers.items() if v is not None]
    target = [*script_target(recipe), *argv]
    if ranks_per_gpu > 1:  # LOCAL_RANK (SLURM_LOCALID) -> GPU index and NCCL host identity per rank
        target = ["-m", SHARED_GPU_MODULE, "--ranks-per-gpu", str(ranks_per_gpu), "--", *target]
    return (["env", *unset, *assign] if layers else []) + [python, *target]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch_cmd", description=__doc__.split("\n")[0])
    parser.add_argument("case_dir", type=Path)
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--exit-duration-in-mins", type=float, default=None)
    add_ranks_per_gpu_option(parser)
    add_env_option(parser)

    def run() -> int:
        ns = parser.parse_args(argv)  # inside run_cli: --help into a closed pipe ends quietly
        args = command(ns.case_dir, ns.output_dir, ns.exit_duration_in_mins, env=parse_assignments(ns.env),
                       ranks_per_gpu=ns.ranks_per_gpu)
        if bad := [a for a in args if "\n" in a]:
            raise UserError(f"argument {bad[0]!r} holds a newline and cannot be passed one per line",
                            "remove the newline from the case's MODEL_ARGS / ENV_VARS")
        print("\n".join(args))
        return 0

    return run_cli("launch_cmd", run)


if __name__ == "__main__":
    sys.exit(main())
