"""``python -m hfsdp.launch --nproc N [--ranks-per-gpu M|auto] -- TARGET [ARGS ...]``: start N ranks.

TARGET is a script or ``-m MODULE``. The same torchrun line our launchers build
(hfsdp/launch/torchrun.py), for launches of your own and for our GPU test scripts. With several
ranks per GPU it checks first that the GPUs are there and, when TARGET is a ``pretrain_*.py``
script, that the ranks' planned memory fits each GPU. ``auto`` takes the fewest ranks per GPU
that place N ranks on this machine's GPUs (1 where each rank gets its own). A TARGET that is
not there is refused before anything starts. The caller's environment is passed through; Ctrl-C
or SIGTERM ends every rank, and a launch whose ranks fail ends with one line saying so, with
torchrun's exit status.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence

from hfsdp.launch import fit, torchrun
from hfsdp.proc import run_group
from hfsdp.training import entries
from hfsdp.usererror import UserError, not_a_regular_file, positive, run_cli


def ranks_per_gpu_arg(text: str) -> int | str:
    """argparse ``type=``: a whole number >= 1, or ``auto``."""
    return text if text == "auto" else positive(int)(text)  # type: ignore[return-value]


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m hfsdp.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=positive(int), required=True, help="ranks on this host")
    parser.add_argument("--ranks-per-gpu", type=ranks_per_gpu_arg, default=1, metavar="N|auto",
                        help="ranks on each GPU (default 1); auto: as many as N ranks need on this machine")
    ns = parser.parse_args(argv[:split])
    target = argv[split + 1:]
    if not target:
        parser.error("give -- and then the script (or -m MODULE) to run, with its arguments")
    return ns, target


def check_target(target: Sequence[str]) -> None:
    """Refuse a script that is not a regular file, or a ``-m`` module Python cannot find."""
    if target[0] == "-m":
        name = target[1] if len(target) > 1 else ""
        try:
            found = bool(name) and importlib.util.find_spec(name) is not None  # imports its parent packages
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UserError(f"-m {name!r} names no module Python finds here (sys.path: the current folder, "
                            "PYTHONPATH, site-packages)", "give the module's dotted name, or a script's path")
        return
    if (why := not_a_regular_file(target[0])) is not None:
        raise UserError(f"the script {target[0]} {why}", "give the path of the script to run on every rank")


def main(argv: Sequence[str] | None = None) -> int:
    def run() -> int:
        ns, target = parse(sys.argv[1:] if argv is None else argv)  # inside run_cli: --help | head
        gpus = fit.gpu_memory() if ns.ranks_per_gpu != 1 else []
        if ns.ranks_per_gpu == "auto":
            if not gpus:
                raise UserError("--ranks-per-gpu auto places ranks on CUDA GPUs, and this machine has none",
                                "run it on a machine with an NVIDIA GPU, or give --ranks-per-gpu 1")
            ranks_per_gpu = torchrun.ranks_per_gpu_for(ns.nproc, len(gpus))
        else:
            ranks_per_gpu = int(ns.ranks_per_gpu)
        placement = torchrun.Placement(nproc=ns.nproc, ranks_per_gpu=ranks_per_gpu)
        pretrain = entries.training_entry(target[0]) is not None
        line = fit.preflight(placement, entries.megatron_flags(target[0], target[1:]) if pretrain else None, gpus)
        if line:
            print(f"hfsdp.launch: {line}", file=sys.stderr, flush=True)
        check_target(target)
        done = run_group(torchrun.command(placement, target))
        if done.returncode != 0:
            print(f"hfsdp.launch: the launch of {' '.join(target[:2])} failed (torchrun exited with "
                  f"{done.returncode}); each failing rank's own output is above", file=sys.stderr, flush=True)
        return done.returncode if done.returncode >= 0 else 128 - done.returncode  # killed by signal N: 128 + N

    return run_cli("hfsdp.launch", run)


if __name__ == "__main__":
    from hfsdp.environment import require_environment

    require_environment("python -m hfsdp.launch")
    sys.exit(main())
