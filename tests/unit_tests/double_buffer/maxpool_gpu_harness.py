"""The harness of the max-pool GPU tests: the hybrid models, their Megatron-FSDP runs, the
module-scoped process group and the child torchrun for scenarios that may crash a process.

A plain module with a unique name, so that test files import it (not one another); conftest.py
beside it makes its ``dist_env`` fixture theirs. Run as a script, it is that child:
``python maxpool_gpu_harness.py --fixedpool-child OUT_DIR [flags]`` under torchrun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hfsdp.launch import torchrun as launch
from hfsdp.nvls_guard import NVLS_SAFE_ENV, assert_guard
from hfsdp.proc import run_group
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)

# --------------------------------------------------------------------------------------------
# Gates
# --------------------------------------------------------------------------------------------
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
HAVE_CUDA = torch.cuda.is_available()
HAVE_MAMBA = importlib.util.find_spec("mamba_ssm") is not None
NVLS_GUARDS = NVLS_SAFE_ENV  # our GPU tests keep NVLink multicast off (hfsdp/nvls_guard.py)

# Data-parallel ranks under torchrun: 2 or more (2 and 4 are run), one GPU each or sharing one.
needs_gpu_ranks = pytest.mark.skipif(
    not (HAVE_CUDA and WORLD_SIZE >= 2 and torch.cuda.device_count() >= 1 and HAVE_MAMBA),
    reason="needs torchrun with 2 or more ranks on CUDA with mamba_ssm",
)

RESULTS_PATH = os.environ.get(
    "MAXPOOL_GPU_RESULTS", os.path.join(os.environ.get("OUT") or "/tmp", "maxpool_gpu.json")
)
ALLOCATOR_ATTRS = ("weight_alloc", "transpose_weight_alloc", "main_grad_alloc", "hsdp_grad_comm_alloc")
MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# Model / run description
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HybridCase:
    """One model + schedule. Defaults: the small 'M*E' x2 hybrid used by tests (a)-(e)."""

    pattern: str = "M*EM*E"
    hidden: int = 256
    heads: int = 4
    vocab: int = 1024
    seq: int = 128
    micro_batch: int = 2
    num_microbatches: int = 3
    steps: int = 4
    bucket_size: int | None = None
    # Mamba: d_inner = 2 * hidden, nheads = d_inner / head_dim.
    mamba_head_dim: int = 64
    mamba_num_groups: int = 2
    mamba_state_dim: int = 32
    num_experts: int = 4
    moe_ffn: int = 256
    seed: int = 1234
    mem_eff_path: bool = False  # Mamba's fused path (mamba_split_conv1d_scan_combined, causal-conv1d)
    te_spec: bool = False  # upstream's TE hybrid_stack_spec instead of the local spec


# Upstream's failing scenario (#4810): 1 attention + 1 Mamba unit, hidden 256, DP=2, bf16,
# bucket_size=4096, 5 steps x 4 micro-batches; attention first so the mode-class tie goes to it
# and Mamba is FixedPool's outlier. Mamba sizes are the TransformerConfig defaults.
# Weights dominate activations here (few tokens, wide layers), so the memory bound in (d) can
# tell "2 pooled units" from "every unit unsharded".
MEMORY_CASE = HybridCase(
    hidden=1024, heads=8, vocab=1024, seq=32, micro_batch=1, num_microbatches=2, steps=3,
    moe_ffn=1024,
)

UPSTREAM_CASE = HybridCase(
    pattern="*M",
    hidden=256,
    heads=4,
    vocab=1024,
    seq=128,
    micro_batch=2,
    num_microbatches=4,
    steps=5,
    bucket_size=4096,
    mamba_head_dim=64,
    mamba_num_groups=8,
    mamba_state_dim=128,
)


def transformer_config(case: HybridCase, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=len(case.pattern),
        hidden_size=case.hidden,
        num_attention_heads=case.heads,
        ffn_hidden_size=4 * case.hidden,
        mamba_head_dim=case.mamba_head_dim,
        mamba_num_groups=case.mamba_num_groups,
        mamba_state_dim=case.mamba_state_dim,
        use_mamba_mem_eff_path=case.mem_eff_path,
        normalization="RMSNorm",
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if "E" in case.pattern:
        kwargs.update(
            num_moe_experts=case.num_experts, moe_router_topk=2, moe_ffn_hidden_size=case.moe_ffn,
            # Local SequentialMLP experts add their bias in place on a custom-Function view,
            # which autograd forbids; MoE stacks run without linear biases anyway.
            add_bias_linear=False,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_hybrid_model(case: HybridCase, config=None):
    """HybridModel from the local spec, or upstream's TE spec (no FSDP, no Float16Module)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if case.te_spec:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as spec
    else:
        from megatron.core.models.hybrid.hybrid_local_layer_specs import hybrid_local_stack_spec as spec
    return HybridModel(
        config=config if config is not None else transformer_config(case),
        hybrid_stack_spec=spec,
        vocab_size=case.vocab,
        max_sequence_length=case.seq,
        hybrid_layer_pattern=case.pattern,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def unit_classes():
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    # Passed explicitly so the tests do not depend on the default-units patch.
    return [TransformerLayer, MoETransformerLayer, MambaLayer]


def unit_census(model: torch.nn.Module) -> dict[str, Any]:
    """Outermost unit modules (FSDP skips nested ones), their sizes, and the non-unit params."""
    units = tuple(unit_classes())
    found: list[tuple[str, torch.nn.Module]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, units) and not any(name.startswith(n + ".") for n, _ in found):
            found.append((name, mod))
    unit_param_ids = {id(p) for _, m in found for p in m.parameters()}
    non_unit = [(n, p) for n, p in model.named_parameters() if id(p) not in unit_param_ids]
    return {
        "units": [(n, type(m).__name__, sum(p.numel() for p in m.parameters())) for n, m in found],
        "non_unit_numel": sum(p.numel() for _, p in non_unit),
        "non_unit_names": [n for n, _ in non_unit],
        "total_numel": sum(p.numel() for p in model.parameters()),
    }


# --------------------------------------------------------------------------------------------
# Distributed setup
# --------------------------------------------------------------------------------------------
def _set_nvls_guards() -> None:
    for key, safe in NVLS_GUARDS.items():
        os.environ.setdefault(key, safe)
    try:
        assert_guard()
    except AssertionError as exc:
        pytest.fail(f"{exc}; GPU runs must keep NVLink multicast off")


@pytest.fixture(scope="module")
def dist_env() -> Iterator[None]:
    _set_nvls_guards()
    os.environ.setdefault("MAMBA_DETERMINISTIC", "1")
    from megatron.core import parallel_state

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    created = False
    if not dist.is_initialized():
        dist.init_process_group("nccl")
        created = True
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    yield
    torch.cuda.synchronize()
    dist.barrier()
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def rank0_print(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def record_result(key: str, value: Any) -> None:
    """Merge one test's numbers into the JSON summary (rank 0 writes)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    data: dict[str, Any] = {}
    if os.path.exists(RESULTS_PATH):
        with open(RESULTS_PATH) as f:
            data = json.load(f)
    data[key] = value
    os.makedirs(os.path.dirname(RESULTS_PATH) or ".", exist_ok=True)
    with open(RESULTS_PATH, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)


# --------------------------------------------------------------------------------------------
# Megatron-FSDP training loop
# --------------------------------------------------------------------------------------------
def ddp_config(case: HybridCase, *, maxpool: bool, double_buffer: bool) -> DistributedDataParallelConfig:
    kwargs = dict(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_reduce_in_fp32=True,  # what the 0.18.2 CLI does for bf16
        bucket_size=case.bucket_size,
        fsdp_double_buffer=double_buffer or maxpool,
    )
    if maxpool:
        kwargs["megatron_fsdp_max_pool_double_buffer"] = True
    return DistributedDataParallelConfig(**kwargs)


@dataclasses.dataclass
class Run:
    fsdp: Any
    optimizer: Any
    lm: torch.nn.Module  # the HybridModel inside Float16Module inside MegatronFSDP
    census: dict[str, Any]

    @property
    def pgb(self):
        return self.fsdp.param_and_grad_buffer

    @property
    def ag_pipeline(self):
        return self.fsdp.module.all_gather_pipeline

    def allocators(self) -> dict[str, Any]:
        out = {}
        for attr in ALLOCATOR_ATTRS:
            alloc = getattr(self.pgb, attr, None)
            if alloc is not None:
                out[attr] = alloc
        return out

    def stats(self) -> dict[str, dict[str, Any]]:
        return {k: dict(a.stats()) for k, a in self.allocators().items() if hasattr(a, "stats")}


def seed_all(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    model_parallel_cuda_manual_seed(seed)


def make_run(case: HybridCase, *, maxpool: bool, double_buffer: bool) -> Run:
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import get_global_memory_buffer
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    # Pools live in Megatron-FSDP's process-global GlobalMemoryBuffer under fixed names; drop
    # the previous run's tensors so each run starts like a fresh process (memory, growth).
    get_global_memory_buffer().buffer.clear()
    gc.collect()
    torch.cuda.empty_cache()
    seed_all(case.seed)
    config = transformer_config(case)
    lm = build_hybrid_model(case, config).cuda()
    census = unit_census(lm)
    fsdp = FullyShardedDataParallel(
        config=config,
        ddp_config=ddp_config(case, maxpool=maxpool, double_buffer=double_buffer),
        module=Float16Module(config, lm),
        fsdp_unit_modules=unit_classes(),
    )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [fsdp])
    return Run(fsdp=fsdp, optimizer=optimizer, lm=lm, census=census)


def batch(case: HybridCase, step: int, mb: int) -> dict[str, torch.Tensor]:
    """Deterministic per-(step, micro-batch, rank) tokens, identical across runs."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(case.seed * 1_000_003 + step * 1009 + mb * 31 + rank)
    tokens = torch.randint(0, case.vocab, (case.micro_batch, case.seq + 1), generator=gen)
    pos = torch.arange(case.seq).unsqueeze(0).expand(case.micro_batch, -1)
    return {
        "input_ids": tokens[:, :-1].cuda(),
        "position_ids": pos.cuda(),
        "attention_mask": None,
        "labels": tokens[:, 1:].cuda(),
    }


def train(
    run: Run,
    case: HybridCase,
    *,
    on_step_end: Callable[[int, Run], None] | None = None,
    on_backward: Callable[[bool], None] | None = None,
    tag: str = "",
) -> list[float]:
    """steps x micro-batches; returns the per-micro-batch losses (fp32 values, in order)."""
    losses: list[float] = []
    for step in range(case.steps):
        run.fsdp.zero_grad_buffer()
        run.optimizer.zero_grad()
        for mb in range(case.num_microbatches):
            last = mb == case.num_microbatches - 1
            ctx = contextlib.nullcontext() if last else run.fsdp.no_sync()
            with ctx:
                out = run.fsdp(**batch(case, step, mb))
                loss = out.float().mean()
                if on_backward:
                    on_backward(True)
                (loss / case.num_microbatches).backward()
                if on_backward:
                    on_backward(False)
            losses.append(loss.detach())
        run.fsdp.finish_grad_sync()
        result = run.optimizer.step()  # (update_successful, grad_norm, num_zeros_in_grad)
        update_ok, grad_norm = result[0], result[1]
        assert update_ok, f"{tag} step {step}: optimizer step skipped (grad_norm={grad_norm})"
        vals = [float(v) for v in losses[-case.num_microbatches :]]
        rank0_print(f"[{tag}] step {step} losses {vals} grad_norm {grad_norm}")
        if on_step_end:
            on_step_end(step, run)
    torch.cuda.synchronize()
    return [float(v) for v in losses]


def teardown_run(run: Run | None) -> None:
    """Drain outstanding work; callers drop their own reference afterwards."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()



FIXEDPOOL_JSON = os.path.join(os.environ.get("OUT") or "/tmp", "maxpool_fixedpool_outcome.json")
FIXEDPOOL_TIMEOUT_S = 240


def run_repro_child(name: str, child_args: list[str], out_json: str,
                    env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Rank 0 runs ``_repro_child`` with 2 ranks in its own torchrun (an illegal memory access cannot
    take this session down), writes the outcome to ``out_json`` and every rank returns it.

    ``child_args``: ``--emulate-0182``, ``--fused``, ``--te``, ``--maxpool`` (see ``_repro_child``);
    ``env_extra`` goes on top of this process's environment (e.g. PYTHONPATH of another tree).
    """
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        child_dir = os.path.join(os.environ.get("OUT") or "/tmp", name)
        os.makedirs(child_dir, exist_ok=True)
        for f in os.listdir(child_dir):
            os.remove(os.path.join(child_dir, f))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "GROUP_", "ROLE_"))}
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        env.update(NVLS_GUARDS)
        env.update(env_extra or {})
        # Two ranks on whatever GPUs there are: one each, or both on one ([Note: several ranks
        # on one GPU] in hfsdp/launch/torchrun.py).
        placement = launch.Placement(nproc=2, ranks_per_gpu=launch.ranks_per_gpu_for(2, torch.cuda.device_count()))
        cmd = launch.command(placement, [os.path.abspath(__file__), "--fixedpool-child", child_dir, *child_args])
        t0 = time.time()
        lines: list[str] = []
        # A process group with a timeout (hfsdp.proc): on a hang the ranks print their stacks, then
        # the whole group is ended, so no worker outlives the test holding a GPU.
        ended = run_group(cmd, timeout_s=FIXEDPOOL_TIMEOUT_S, env=env, on_line=lines.append)
        rc = "timeout" if ended.timed_out else ended.returncode
        out = "".join(lines)
        ranks = {}
        for f in sorted(os.listdir(child_dir)):
            with open(os.path.join(child_dir, f)) as fh:
                ranks[f] = json.load(fh)
        crash_lines = [
            ln for ln in out.splitlines()
            if any(s in ln for s in ("illegal memory access", "Error", "error:", "No buffer found"))
        ]
        outcome = {
            "variant": name,
            "cmd": " ".join(cmd),
            "returncode": rc,
            "seconds": round(time.time() - t0, 1),
            "ranks": ranks,
            "crash_lines": crash_lines[-20:],
            "output_tail": out[-4000:],
        }
        outcome["verdict"] = (
            "ok" if rc == 0 and ranks and all(r.get("status") == "ok" for r in ranks.values())
            else "failed"
        )
        with open(out_json, "w") as fh:
            json.dump(outcome, fh, indent=2, default=str)
        print(f"{name} outcome:", json.dumps({k: outcome[k] for k in ("returncode", "verdict", "crash_lines")}),
              flush=True)
        for rank_name, r in ranks.items():
            print(f"  {rank_name}: status={r.get('status')} outliers={r.get('outlier_units')} "
                  f"fallback_keys={r.get('fallback_keys')} backup={r.get('backup_buckets')} "
                  f"losses={r.get('losses')} error={r.get('error')}", flush=True)
        payload[0] = outcome
    dist.broadcast_object_list(payload, src=0)
    assert payload[0] is not None, f"rank 0 did not record the outcome of {name}"
    return payload[0]



CHILD_FLAGS = ("--emulate-0182", "--fused", "--te", "--maxpool")


def _repro_child(out_dir: str, flags: list[str]) -> int:
    """Child entry (under its own torchrun): the double buffer on UPSTREAM_CASE.

    ``--maxpool``: the fork's max-pool (else FixedPool); ``--emulate-0182``: FixedPool's backup
    swapped back to 0.18.2's TemporaryBucketAllocator; ``--fused``: Mamba's fused path
    (needs causal-conv1d); ``--te``: upstream's TE spec (needs Transformer Engine).
    """
    emulate_0182, maxpool = "--emulate-0182" in flags, "--maxpool" in flags
    case = dataclasses.replace(UPSTREAM_CASE, mem_eff_path="--fused" in flags, te_spec="--te" in flags)
    from megatron.core import parallel_state

    rank = int(os.environ["RANK"])
    path = os.path.join(out_dir, f"rank{rank}.json")
    rec: dict[str, Any] = {"rank": rank, "status": "starting", "losses": []}

    def dump() -> None:
        with open(path, "w") as fh:
            json.dump(rec, fh, indent=2, default=str)

    dump()
    try:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        parallel_state.initialize_model_parallel(1, 1)
        run = make_run(case, maxpool=maxpool, double_buffer=True)
        if emulate_0182:
            # 0.18.2's FixedPool backup: a TemporaryBucketAllocator whose free() drops the
            # bucket, so the next allocate makes a new storage behind saved aliases ("dropped
            # bucket" in [Note: double buffer], failure modes).
            from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
                TemporaryBucketAllocator,
            )

            for alloc in run.allocators().values():
                if hasattr(alloc, "backup_allocator"):
                    alloc.backup_allocator = TemporaryBucketAllocator()
        rec.update(emulate_0182_backup=emulate_0182, maxpool=maxpool, mem_eff_path=case.mem_eff_path,
                   te_spec=case.te_spec)
        wa = run.pgb.weight_alloc
        all_units = sorted({g.fsdp_unit_id for g in run.pgb.parameter_groups if g.fsdp_unit_id is not None})
        pooled = sorted(getattr(wa, "fsdp_double_buffer_units", []) or [])
        rec.update(
            allocators={k: type(a).__name__ for k, a in run.allocators().items()},
            units=run.census["units"],
            all_unit_ids=all_units,
            pooled_units=pooled,
            outlier_units=[u for u in all_units if u not in pooled],
            status="running",
        )
        dump()

        def after_step(step: int, r: Run) -> None:
            rec["steps_done"] = step + 1
            rec["fallback_keys"] = _fallback_keys()
            rec["backup_buckets"] = {
                k: sorted(getattr(getattr(a, "backup_allocator", None), "buckets", {}) or {})
                for k, a in r.allocators().items()
            }
            dump()

        losses = train(run, case, on_step_end=after_step, tag="upstream-fixedpool")
        rec.update(status="ok", losses=losses, finite=all(math.isfinite(v) for v in losses))
        dump()
        return 0
    except BaseException as e:  # record everything, including CUDA errors
        rec.update(status="exception", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        dump()
        return 1


def _fallback_keys() -> list[str]:
    """GlobalMemoryBuffer keys FixedPool created for buckets outside its pool ("persistent
    blow-up" in [Note: double buffer], failure modes)."""
    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import get_global_memory_buffer

        buf = get_global_memory_buffer()
        return sorted(str(k) for k in getattr(buf, "buffer", {}) if "not_fit_in_fixed_pool" in str(k))
    except Exception as e:  # diagnostic only
        return [f"<unavailable: {e}>"]


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--fixedpool-child" and set(sys.argv[3:]) <= set(CHILD_FLAGS):
        sys.exit(_repro_child(sys.argv[2], sys.argv[3:]))
    sys.exit(f"usage: {sys.argv[0]} --fixedpool-child OUT_DIR [{'] ['.join(CHILD_FLAGS)}] (run under torchrun)")
