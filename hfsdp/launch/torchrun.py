"""The torchrun command line of every launcher of ours: N ranks on this host, over its GPUs.

The functional driver, the benchmark, the main job and the GPU test harnesses build their
launches here, so each of them takes ``--ranks-per-gpu`` the same way.

[Note: several ranks on one GPU]
NCCL refuses two ranks on one device ("Duplicate GPU detected") because it sees them on one
host. Give each rank its own host identity (``NCCL_HOSTID``) and NCCL connects them through its
socket transport on loopback, like ranks on separate machines. Nothing else changes: each rank
is its own process with its own CUDA context, allocator, parameters and NCCL communicators, so
per-rank memory, pool plans and every reduced bit are those of a real run at the same
data-parallel size. ``--ranks-per-gpu N`` places rank ``r`` of this host's G GPUs on GPU
``r % G`` (round robin: where torch's NCCL process group puts a collective issued before a device
is bound, as Megatron's first barrier is); each rank starts through
:mod:`hfsdp.launch.shared_gpu`, which sets its environment (``LOCAL_RANK`` = the GPU index, which
Megatron passes to ``torch.cuda.set_device``) and then execs the real target, so torchrun still
watches the rank's own pid.

What this mode cannot show: speed (the ranks time-slice one GPU and talk over loopback sockets),
compute/communication overlap, NVLink and P2P transports. It runs on one host only.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hfsdp.usererror import UserError, positive

# Exported to every rank of the shared mode, so a launcher running inside a rank (a test that
# starts its own torchrun) keeps the mode for its children.
RANKS_PER_GPU_ENV = "HFSDP_RANKS_PER_GPU"
SHARED_GPU_MODULE = "hfsdp.launch.shared_gpu"
DOC = "docs/several-ranks-per-gpu.md"


@dataclass(frozen=True)
class Placement:
    """Where the ranks of one launch go. ``nproc`` is this host's rank count."""

    nproc: int
    ranks_per_gpu: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port of this host (one node only)

    @property
    def gpus(self) -> int:
        """GPUs this host's ranks use."""
        return -(-self.nproc // self.ranks_per_gpu)

    @property
    def shared(self) -> bool:
        return self.ranks_per_gpu > 1


MAX_NPROC = 1024  # ranks on one host: a typo, not a launch, beyond this (torchrun would try to start them all)


def check(placement: Placement) -> None:
    """Refuse a placement that cannot start, in one sentence (no GPU is looked at here)."""
    p = placement
    if p.nproc < 1 or p.ranks_per_gpu < 1 or p.nnodes < 1:
        raise UserError(f"ranks {p.nproc}, ranks per GPU {p.ranks_per_gpu} and nodes {p.nnodes} must all be >= 1",
                        "give positive counts")
    if p.nproc > MAX_NPROC:
        raise UserError(f"{p.nproc:,} ranks is more ranks on one host than any launch can start (at most {MAX_NPROC})",
                        "give the ranks per host, e.g. --nproc 8")
    if not 0 <= p.node_rank < p.nnodes:
        raise UserError(f"node rank {p.node_rank} is not in [0, nodes {p.nnodes})",
                        "pass the node's index, 0 for the first node")
    if p.shared and p.nnodes > 1:
        raise UserError(f"--ranks-per-gpu {p.ranks_per_gpu} runs on one host only, and this launch spans "
                        f"{p.nnodes} nodes", f"run it on one node, or drop --ranks-per-gpu ({DOC})")
    if p.ranks_per_gpu > p.nproc:
        raise UserError(f"--ranks-per-gpu {p.ranks_per_gpu} is more than the {p.nproc} ranks of this launch, so no GPU "
                        "would hold that many", f"give --ranks-per-gpu {p.nproc} or fewer, a divisor of {p.nproc}")
    if p.nproc % p.ranks_per_gpu:
        raise UserError(f"{p.nproc} ranks do not split evenly over GPUs at --ranks-per-gpu {p.ranks_per_gpu}",
                        f"give a rank count that is a multiple of {p.ranks_per_gpu}")
    if p.nnodes > 1 and p.master_port is None:
        raise UserError(f"a launch over {p.nnodes} nodes needs the master's port", "pass --master-port")


def check_gpus(placement: Placement, gpu_count: int, own_gpus_too: bool = False) -> None:
    """Refuse a shared placement that needs more GPUs than ``gpu_count`` (the mode needs a GPU).

    With one rank per GPU nothing is checked here (torchrun and Megatron report it), unless
    ``own_gpus_too``: a caller that would otherwise start several runs that all fail."""
    p = placement
    if not p.shared:
        if own_gpus_too and not gpu_count:
            raise UserError(f"{p.nproc} ranks train on CUDA GPUs, one each, and this machine has none",
                            "run it on a machine with NVIDIA GPUs (on this one the memory planner, "
                            "scripts/fsdp_memory_planner.py, plans the same model)")
        if own_gpus_too and p.nproc > gpu_count:
            raise UserError(f"{p.nproc} ranks, one per CUDA GPU, need {p.nproc} GPUs, and {gpu_count} are visible",
                            f"give {gpu_count} ranks or fewer, or --ranks-per-gpu {-(-p.nproc // gpu_count)}")
        return
    if gpu_count < 1:
        raise UserError(f"--ranks-per-gpu {p.ranks_per_gpu} shares CUDA GPUs between ranks, and this machine "
                        "has none", f"run it on a machine with an NVIDIA GPU ({DOC})")
    if p.gpus > gpu_count:
        raise UserError(f"{p.nproc} ranks at {p.ranks_per_gpu} per GPU need {p.gpus} GPUs, and this machine "
                        f"has {gpu_count}", f"give --ranks-per-gpu {-(-p.nproc // gpu_count)} or fewer ranks")


# [Note: the master's port]
# torchrun's master binds its port only once it starts, so a port that is free when the launcher
# picks it can be taken meanwhile. Ports the kernel hands out to outgoing connections (its
# ephemeral range) are the usual thief: the NCCL and store sockets of a launch running beside this
# one take them by the hundred. So the launcher picks, at random, a port below that range that
# nothing listens on; two of its own launches would also have to draw the same one.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000  # above the well-known and most registered services


def free_port(rng: random.Random | None = None) -> int:
    """A TCP port nobody listens on now, outside the kernel's ephemeral range ([Note: the master's
    port]); where no such port is free, one the kernel picks."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    rng = rng or random.SystemRandom()
    candidates = list(range(LOWEST_PORT, max(ephemeral_low, LOWEST_PORT)))
    rng.shuffle(candidates)
    for port in [*candidates[:64], 0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no TCP port can be bound on 127.0.0.1")


def command(placement: Placement, target: Sequence[str], python: str = sys.executable) -> list[str]:
    """``python -m torch.distributed.run ... TARGET``; ``target`` is ``[script, *args]`` or
    ``["-m", module, *args]``. In the shared mode each rank first runs :mod:`hfsdp.launch.shared_gpu`."""
    check(placement)
    assert target, "a launch needs a target: a script path or -m MODULE, then its arguments"
    p = placement
    port = p.master_port if p.master_port is not None else free_port()
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(p.nproc),
           "--nnodes", str(p.nnodes), "--node-rank", str(p.node_rank),
           "--master-addr", p.master_addr, "--master-port", str(port), "--max-restarts", "0"]
    if p.shared:
        # torchrun runs "-m MODULE args" as the rank; the wrapper execs ``target`` itself.
        return [*cmd, "-m", SHARED_GPU_MODULE, "--ranks-per-gpu", str(p.ranks_per_gpu), "--", *target]
    return [*cmd, *target]


def ranks_per_gpu_count(text: str) -> int:
    """argparse ``type=`` of ``--ranks-per-gpu`` in the launchers that take a count (not ``auto``)."""
    if text.strip().lower() == "auto":
        raise argparse.ArgumentTypeError("'auto' is taken only by `python -m hfsdp.launch`; give a whole number "
                                         "of ranks per GPU >= 1")
    return positive(int)(text)  # type: ignore[return-value]


def add_ranks_per_gpu_option(parser: argparse.ArgumentParser) -> None:
    """``--ranks-per-gpu N`` (default 1), with the same words in every launcher."""
    parser.add_argument(
        "--ranks-per-gpu", type=ranks_per_gpu_count, default=1, metavar="N",
        help="start N ranks on each GPU (one host only): data-parallel runs on fewer GPUs, for "
             f"numerics, memory and exit-path checks, never for speed ({DOC})",
    )


def ranks_per_gpu_for(nproc: int, gpu_count: int) -> int:
    """The fewest ranks per GPU that place ``nproc`` ranks on ``gpu_count`` GPUs (1 if they fit).

    For test harnesses that must run a fixed number of ranks on whatever machine they get.
    """
    assert nproc >= 1 and gpu_count >= 1, f"need ranks and GPUs, got nproc={nproc}, gpu_count={gpu_count}"
    return -(-nproc // gpu_count)
