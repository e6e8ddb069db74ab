"""What each rank of the several-ranks-per-GPU mode runs first (torchrun starts it).

    python -m hfsdp.launch.shared_gpu --ranks-per-gpu N -- TARGET [ARGS ...]

sets this rank's environment (:func:`rank_env`) and replaces itself with ``python TARGET ARGS``
(``TARGET`` is a script or ``-m MODULE``), keeping its pid, so torchrun's signals and exit
status reach the real rank. [Note: several ranks on one GPU] in hfsdp/launch/torchrun.py.

Standard library only.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Mapping, Sequence

from hfsdp.launch.torchrun import RANKS_PER_GPU_ENV

# NCCL's own names. A value the user set for the socket variables is kept; the host identity is
# always made per rank (one shared value would bring back "Duplicate GPU detected").
HOSTID = "NCCL_HOSTID"
SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
IB_DISABLE = "NCCL_IB_DISABLE"


def rank_env(environ: Mapping[str, str], ranks_per_gpu: int, hostname: str | None = None) -> dict[str, str]:
    """The environment of one rank: ``environ`` (torchrun's, with its ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``, or an srun task's ``LOCAL_RANK`` and ``WORLD_SIZE``) plus

    * ``LOCAL_RANK`` = the GPU index, ``LOCAL_RANK % G`` over the host's G = ``LOCAL_WORLD_SIZE /
      ranks_per_gpu`` GPUs, for ``set_device``: round robin, because torch's NCCL process group
      places a collective issued before a device is bound (Megatron's first barrier) on GPU
      ``rank % G``, and the two must agree;
    * ``NCCL_HOSTID`` = ``<host>-slot<LOCAL_RANK // G>``: the ranks of one GPU get different
      identities, so NCCL sees them on separate hosts; the ranks of one slot (one per GPU) share
      one, so NCCL may still join them by P2P. ``<host>`` is the user's ``NCCL_HOSTID`` if set,
      else the host name;
    * ``NCCL_SOCKET_IFNAME=lo`` and ``NCCL_IB_DISABLE=1``, unless the user set them: the
      "separate hosts" are one machine, reached over loopback;
    * ``HFSDP_RANKS_PER_GPU`` = ``ranks_per_gpu``, so launchers inside the rank keep the mode.

    Everything else passes through unchanged.
    """
    assert ranks_per_gpu >= 1, f"ranks_per_gpu must be >= 1, got {ranks_per_gpu}"
    local = environ.get("LOCAL_RANK")
    assert local is not None and local.isdigit(), (
        f"LOCAL_RANK={local!r}: {__name__} runs as a torchrun rank (hfsdp.launch.torchrun.command)")
    # torchrun sets LOCAL_WORLD_SIZE; srun-per-GPU tasks get WORLD_SIZE, which is the same on the
    # one host the mode runs on.
    world = environ.get("LOCAL_WORLD_SIZE") or environ.get("WORLD_SIZE")
    assert world is not None and world.isdigit() and int(world) % ranks_per_gpu == 0, (
        f"LOCAL_WORLD_SIZE/WORLD_SIZE={world!r} is not a multiple of ranks_per_gpu {ranks_per_gpu} "
        f"({__name__} runs as a torchrun rank or an srun task)")
    slot, gpu = divmod(int(local), int(world) // ranks_per_gpu)
    env = dict(environ)
    host = environ.get(HOSTID) or hostname or socket.gethostname()
    env["LOCAL_RANK"] = str(gpu)
    env[HOSTID] = f"{host}-slot{slot}"
    env.setdefault(SOCKET_IFNAME, "lo")
    env.setdefault(IB_DISABLE, "1")
    env[RANKS_PER_GPU_ENV] = str(ranks_per_gpu)
    return env


def parse(argv: Sequence[str]) -> tuple[int, list[str]]:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks-per-gpu", type=int, required=True)
    parser.add_argument("target", nargs=argparse.REMAINDER)
    ns = parser.parse_args(list(argv))
    target = ns.target[1:] if ns.target[:1] == ["--"] else ns.target
    if ns.ranks_per_gpu < 1 or not target:
        parser.error("give --ranks-per-gpu N (>= 1), then -- and the target to run")
    return ns.ranks_per_gpu, target


def main(argv: Sequence[str] | None = None) -> int:
    ranks_per_gpu, target = parse(sys.argv[1:] if argv is None else argv)
    env = rank_env(os.environ, ranks_per_gpu)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-u", *target], env)
    return 0  # not reached: execve replaces this process


if __name__ == "__main__":
    sys.exit(main())
