"""Whether the ranks a launch puts on one GPU fit in its memory, from the planner (no GPU work).

Used before a several-ranks-per-GPU launch of ``pretrain`` ([Note: several ranks on one GPU] in
hfsdp/launch/torchrun.py): N ranks on one GPU need N times one rank's memory. The planner gives
what a rank holds for the whole run (:class:`RankMemory`): its shard of the parameters, of the
optimizer's main parameters, gradients and moments, and the double-buffer pools. Activations and
temporary buffers come on top and are not planned, so this is a lower bound: a launch it refuses
cannot fit, and one it passes may still run out of memory at a large micro-batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from unittest import mock

from hfsdp.launch.torchrun import Placement, check_gpus
from hfsdp.planner.memory import GIB, RankMemory, planned_memory
from hfsdp.usererror import UserError

# Per process, beside what the planner sees: the CUDA context, cuBLAS/cuDNN workspaces and NCCL's
# buffers (each rank of the shared mode has its own of all three).
CONTEXT_BYTES = 1 * GIB
# Switches that only Transformer Engine's specs take; the plan, made with local specs, leaves them out.
TE_SPEC_ONLY = frozenset({"--moe-grouped-gemm"})


def _flag(flags: Sequence[str], name: str, default: str) -> str:
    value = default
    for i, tok in enumerate(flags):
        if tok == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif tok.startswith(name + "="):
            value = tok.split("=", 1)[1]
    return value


def data_parallel_size(flags: Sequence[str], world_size: int) -> int:
    """The data-parallel size of ``world_size`` ranks under the flags' model parallelism."""
    model = 1
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        value = _flag(flags, name, "1")
        model *= int(value) if value.isdigit() and int(value) > 0 else 1
    if world_size % model:
        raise UserError(f"{world_size} ranks do not divide into model-parallel groups of {model}",
                        "give a rank count that is a multiple of tensor x pipeline x context parallel sizes")
    return world_size // model


def rank_memory(flags: Sequence[str], world_size: int, environ: Mapping[str, str] | None = None) -> RankMemory:
    """One rank's planned memory for pretrain ``flags`` at ``world_size`` ranks (CPU only).

    ``environ``: the launched job's environment, which Megatron's argument checks (e.g.
    ``--deterministic-mode`` asks for ``NCCL_ALGO``) and the unit list
    (``$HFSDP_FSDP_UNIT_MODULES``) read; it applies during the parse and the plan only.

    The model is planned with local layer specs: Transformer Engine's give each unit the same
    parameters. Flags that only TE specs take (:data:`TE_SPEC_ONLY`) are left out of the plan:
    ``--moe-grouped-gemm`` holds the experts' weights as TE's grouped GEMM does, and the local specs'
    per-expert layers hold the same ones. Pools: the lanes training holds
    (``--megatron-fsdp-max-pool-lanes`` 3 or more with the max-pool double buffer), else the max-pool
    plan (also what two live unsharded units take without double buffering).
    """
    from hfsdp.planner import cli, setup
    from hfsdp.training import fsdp_units

    with mock.patch.dict(os.environ, dict(environ or {})):
        args = setup.parse([*(f for f in flags if f not in TE_SPEC_ONLY), "--transformer-impl", "local",
                            "--plan-dp-size", str(data_parallel_size(flags, world_size))])
        layout, results = cli.plan_from_args(args)
    return planned_memory(args, layout, results, fsdp_units.training_lanes(args))


def check_fits(memory: RankMemory, ranks_per_gpu: int, gpu_bytes: int) -> str:
    """One line saying that ``ranks_per_gpu`` such ranks fit ``gpu_bytes``; a UserError if not."""
    per_rank = memory.total + CONTEXT_BYTES
    need = ranks_per_gpu * per_rank
    line = (f"{ranks_per_gpu} ranks per GPU: {ranks_per_gpu} x ({memory.describe()} planned + "
            f"{CONTEXT_BYTES / GIB:.0f} GiB context) = {need / GIB:.2f} GiB of the GPU's {gpu_bytes / GIB:.2f} GiB, "
            "before activations")
    if need > gpu_bytes:
        raise UserError(f"{ranks_per_gpu} ranks on one GPU need at least {need / GIB:.2f} GiB, more than its "
                        f"{gpu_bytes / GIB:.2f} GiB: each rank plans {memory.describe()} plus "
                        f"{CONTEXT_BYTES / GIB:.0f} GiB of CUDA context and NCCL buffers",
                        "give fewer --ranks-per-gpu, use more GPUs, or a smaller model")
    return line


def gpu_memory(python: str = sys.executable, env: Mapping[str, str] | None = None) -> list[int]:
    """Total bytes of each visible CUDA GPU ([] without one), asked of a short-lived process so
    that this one never holds a CUDA context beside the ranks it launches. ``env``: the
    environment the ranks will get (``CUDA_VISIBLE_DEVICES``); default this process's."""
    code = ("import torch\n"
            "print(*(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))")
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                              env=None if env is None else dict(env))
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()]


def preflight(placement: Placement, flags: Sequence[str] | None, gpus: Sequence[int] | None = None,
              environ: Mapping[str, str] | None = None) -> str | None:
    """The checks before a several-ranks-per-GPU launch (None for one rank per GPU): a GPU is
    there, enough of them, and, for a ``pretrain`` launch (``flags``), the planned memory fits.
    Returns the line to print; refusals are UserErrors. ``gpus``: bytes per GPU (default: asked);
    ``environ``: the job's environment (:func:`rank_memory`)."""
    if not placement.shared:
        return None
    if gpus is None:  # the GPUs the job's ranks will see (its CUDA_VISIBLE_DEVICES)
        gpus = gpu_memory(env=None if environ is None else {**os.environ, **environ})
    check_gpus(placement, len(gpus))
    if flags is None:
        return f"{placement.ranks_per_gpu} ranks per GPU on {placement.gpus} GPU(s); no model to plan memory for"
    memory = rank_memory(flags, placement.nproc * placement.nnodes, environ)
    return check_fits(memory, placement.ranks_per_gpu, min(gpus[: placement.gpus]))
