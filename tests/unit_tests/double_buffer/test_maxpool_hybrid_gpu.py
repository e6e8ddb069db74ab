"""GPU integration tests: max-pool double buffering on a hybrid Megatron-FSDP model.

Run (2 or 4 ranks: one GPU each, or sharing one; repo root, patched tree materialized):
    . tests/gpu/setup_gpu_env.sh && MAMBA_DETERMINISTIC=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    python -m hfsdp.launch --nproc 2 --ranks-per-gpu auto -- -m pytest -q -s -x \
        tests/unit_tests/double_buffer/test_maxpool_hybrid_gpu.py
or tests/gpu/run_maxpool_gpu.sh (same, plus log + JSON summary under $OUT).

Model: HybridModel built from the TE-free ``hybrid_local_stack_spec`` (overlay module
hybrid_local_layer_specs.py); Mamba ('M'), attention ('*') and MoE ('E') layers are the FSDP
units, embedding / final norm / output layer are non-units. bf16 via Float16Module, Megatron-FSDP
``optim_grads_params`` through the MCore adapter, Megatron DistributedOptimizer (Adam).
Mamba runs mamba_ssm's Triton kernels with ``use_mamba_mem_eff_path=False`` (no causal_conv1d).

Tests: (a) losses bitwise equal with max-pool vs no double
buffering; (b) pool bytes stable after step 1; (c) zero new home misses after step 1;
(d) peak memory under an analytic bound; (e) non-unit forwards gather only non-unit buckets
(prefetch gating); (f) upstream's 1 attention + 1 Mamba repro with max-pool; (g) the same
repro with the old FixedPool, in a child torchrun so an illegal memory access cannot take the
pytest process down, outcome recorded as JSON. The models, runs and child live in
maxpool_gpu_harness.py.

Everything skips cleanly without 2 or more CUDA ranks (tests/gpu/run_maxpool_gpu.sh fails when
nothing ran); the max-pool tests also skip while the
``megatron_fsdp_max_pool_double_buffer`` config field does not exist. The CPU-only test at the
end builds the same models on CPU (no FSDP) and checks the unit census.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from maxpool_gpu_harness import (
    FIXEDPOOL_JSON,
    FIXEDPOOL_TIMEOUT_S,
    HAVE_CUDA,
    MEMORY_CASE,
    UPSTREAM_CASE,
    HybridCase,
    MiB,
    Run,
    build_hybrid_model,
    ddp_config,
    make_run,
    needs_gpu_ranks,
    rank0_print,
    record_result,
    run_repro_child,
    teardown_run,
    train,
    transformer_config,
    unit_census,
)
from rendezvous import init_one_rank_gloo


# --------------------------------------------------------------------------------------------
# (a) bitwise parity, (b) stable pool bytes, (c) no new home misses
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu_ranks
def test_maxpool_bitwise_losses_and_stable_pool(dist_env) -> None:
    case = HybridCase()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        t0 = time.time()
        base_run = make_run(case, maxpool=False, double_buffer=False)
        rank0_print("census", json.dumps(base_run.census))
        base = train(base_run, case, tag="no-db")
        teardown_run(base_run)
        del base_run

        per_step: list[dict[str, dict[str, Any]]] = []

        def snap(step: int, run: Run) -> None:
            s = run.stats()
            per_step.append(s)
            rank0_print(f"[maxpool] step {step} stats {json.dumps(s, sort_keys=True)}")

        mp_run = make_run(case, maxpool=True, double_buffer=True)
        kinds = {k: type(a).__name__ for k, a in mp_run.allocators().items()}
        rank0_print("allocators", kinds)
        mp = train(mp_run, case, on_step_end=snap, tag="maxpool")
        teardown_run(mp_run)

        repeat: list[float] | None = None
        if base != mp:
            # Tell a max-pool numerics bug apart from a non-deterministic stack.
            rerun = make_run(case, maxpool=False, double_buffer=False)
            repeat = train(rerun, case, tag="no-db-repeat")
            teardown_run(rerun)
        record_result(
            "a_bitwise",
            {
                "case": dataclasses.asdict(case),
                "losses_no_db": base,
                "losses_maxpool": mp,
                "losses_no_db_repeat": repeat,
                "equal": base == mp,
                "allocators": kinds,
                "stats_per_step": per_step,
                "seconds": time.time() - t0,
            },
        )
    finally:
        torch.use_deterministic_algorithms(False)

    assert repeat is None or repeat == base, (
        "baseline itself is not bitwise reproducible, parity cannot be judged: "
        f"{base} vs {repeat}"
    )
    # (a) bit-identical losses (torch.equal on the fp32 values).
    assert torch.equal(torch.tensor(base), torch.tensor(mp)), f"no-db {base}\nmaxpool {mp}"

    # (b) + (c): every allocator that reports stats is a max-pool and is stable after step 1.
    assert per_step and per_step[0], f"no allocator reported stats(): {kinds}"
    assert kinds.get("weight_alloc") == "MaxPoolAllocator", kinds
    for name, first in per_step[0].items():
        last = per_step[-1][name]
        assert last["pool_bytes_allocated"] == first["pool_bytes_allocated"], (
            name, first, last)
        assert last["home_misses"] == first["home_misses"], (name, first, last)
        assert last["pool_bytes_allocated"] <= last["pool_bytes_planned"], (name, last)
    assert per_step[0]["weight_alloc"]["pool_bytes_allocated"] > 0, per_step[0]
    if "main_grad_alloc" in per_step[0]:
        assert per_step[0]["main_grad_alloc"]["pool_bytes_allocated"] > 0, per_step[0]


# --------------------------------------------------------------------------------------------
# (d) peak memory under an analytic bound
# --------------------------------------------------------------------------------------------
def activation_bytes_estimate(case: HybridCase) -> int:
    """Generous upper estimate of one micro-batch's live activations (bytes).

    Only one micro-batch is live at a time (backward follows its forward). Per layer we allow
    24 tensors of T x max(hidden, d_inner, topk * moe_ffn) in fp32, which covers what Mamba
    (z, x, B, C, dt, conv in/out, y, gated norm), attention (qkv, context, norms) and MoE
    (permuted tokens, fc1 out, activation, unpermute) save, plus their grads. Attention adds
    scores/probs/grad as b x heads x s x s x fp32 x 3; the head adds fp32 logits, softmax,
    grad-of-logits and a bf16 copy: T x V x 14 bytes.
    """
    tokens = case.micro_batch * case.seq
    width = max(case.hidden, 2 * case.hidden, 2 * case.moe_ffn)
    per_layer = 24 * tokens * width * 4
    attn = case.pattern.count("*") * case.micro_batch * case.heads * case.seq * case.seq * 4 * 3
    head = tokens * case.vocab * 14
    return len(case.pattern) * per_layer + attn + head


@pytest.mark.gpu
@needs_gpu_ranks
def test_maxpool_peak_memory_within_analytic_bound(dist_env) -> None:
    case = MEMORY_CASE
    run = make_run(case, maxpool=True, double_buffer=True)
    census = run.census
    dp = dist.get_world_size()
    n_total = census["total_numel"]
    largest_unit = max(n for _, _, n in census["units"])

    peaks: list[int] = []

    def measure(step: int, r: Run) -> None:
        torch.cuda.synchronize()
        if step >= 1:  # step 0 includes Triton autotune scratch and lazy optimizer-state init
            peaks.append(torch.cuda.memory_stats()["active_bytes.all.peak"])
        torch.cuda.reset_peak_memory_stats()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train(run, case, on_step_end=measure, tag="maxpool-mem")
    peak = max(peaks)

    # Persistent, sharded over DP: bf16 model-weight shard (2 B) + fp32 main weight (4 B) +
    # fp32 main grad (4 B) + Adam exp_avg/exp_avg_sq (8 B) = 18 B per param / DP.
    sharded = 18 * n_total // dp
    # Non-units stay unsharded after their first gather (bf16, 2 B) and get a transient fp32
    # unsharded grad bucket (4 B) in backward.
    non_unit = 6 * census["non_unit_numel"]
    # The two pool groups: 2 x the largest unit's bf16 weights and 2 x its fp32 grads. The plan
    # is per-slot maxima across units, which can exceed the largest single unit when units have
    # several buckets; 1.5x covers that for this model (buckets are per dtype only here).
    pools = int(1.5 * (2 * 2 * largest_unit + 2 * 4 * largest_unit))
    # Autograd's bf16 .grad of one param before it is folded into main_grad, x2 in flight.
    transient_grads = 2 * 2 * largest_unit
    # torch Adam (foreach) temporaries over the fp32 shard: ~2 fp32 copies of the shard.
    optimizer_temps = 8 * n_total // dp
    activations = activation_bytes_estimate(case)
    subtotal = sharded + non_unit + pools + transient_grads + optimizer_temps + activations
    # Slack: allocator rounding (512 B granularity), NCCL/Megatron small workspaces,
    # cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8 -> 8 x 4 MiB), RNG states.
    slack = 48 * MiB + subtotal // 10
    bound = subtotal + slack
    # A pool that leaked one buffer per unit would hold every unit unsharded instead of 2.
    leak_if_unpooled = (len(census["units"]) - 2) * 6 * largest_unit
    breakdown = {
        "peak_bytes": peak,
        "bound_bytes": bound,
        "sharded": sharded,
        "non_unit": non_unit,
        "pools": pools,
        "transient_grads": transient_grads,
        "optimizer_temps": optimizer_temps,
        "activations_estimate": activations,
        "slack": slack,
        "leak_if_unpooled": leak_if_unpooled,
        "per_step_peaks": peaks,
        "stats": run.stats(),
        "census": census,
    }
    rank0_print("memory", json.dumps(breakdown, default=str))
    record_result("d_peak_memory", breakdown)
    teardown_run(run)
    assert peak <= bound, f"peak {peak / MiB:.1f} MiB > bound {bound / MiB:.1f} MiB: {breakdown}"


# --------------------------------------------------------------------------------------------
# (e) prefetch gating: non-unit gathers stay non-unit
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu_ranks
def test_non_unit_forward_gathers_only_its_own_buckets(dist_env) -> None:
    case = HybridCase(steps=2)
    run = make_run(case, maxpool=True, double_buffer=True)
    groups = run.pgb.parameter_groups
    phase = ["setup"]
    gathered: list[tuple[str, int]] = []

    ag = run.ag_pipeline
    orig_gather = ag.async_bucket_gather

    def spy_gather(bucket_id, *args, **kwargs):
        gathered.append((phase[0], bucket_id))
        return orig_gather(bucket_id, *args, **kwargs)

    ag.async_bucket_gather = spy_gather

    def set_phase(name: str):
        def hook(*_):
            phase[0] = name

        return hook

    # prepend=True: our marker runs before Megatron-FSDP's own pre-forward gather hook.
    run.lm.embedding.register_forward_pre_hook(set_phase("embedding"), prepend=True)
    for i, layer in enumerate(run.lm.decoder.layers):
        layer.register_forward_pre_hook(set_phase(f"unit{i}"), prepend=True)
    run.lm.output_layer.register_forward_pre_hook(set_phase("output"), prepend=True)
    orig_sps = run.fsdp.start_param_sync

    def spy_start_param_sync(*args, **kwargs):
        phase[0] = "start_param_sync"
        try:
            return orig_sps(*args, **kwargs)
        finally:
            phase[0] = "optimizer"

    # The optimizer calls model_chunk.start_param_sync() after its step: the other non-unit
    # (first-parameter) gather with prefetch=True.
    run.fsdp.start_param_sync = spy_start_param_sync

    train(run, case, on_backward=lambda fwd_done: phase.__setitem__(0, "backward" if fwd_done else "idle"),
          tag="gating")
    teardown_run(run)

    non_unit_phases = ("embedding", "start_param_sync")
    offenders = [
        (ph, b, groups[b].fsdp_unit_id)
        for ph, b in gathered
        if ph in non_unit_phases and groups[b].fsdp_unit_id is not None
    ]
    emb_buckets = sorted({b for ph, b in gathered if ph == "embedding"})
    summary = {
        "gathers": len(gathered),
        "embedding_phase_buckets": emb_buckets,
        "start_param_sync_buckets": sorted({b for ph, b in gathered if ph == "start_param_sync"}),
        "offenders": offenders,
        "bucket_units": [g.fsdp_unit_id for g in groups],
    }
    rank0_print("gating", json.dumps(summary))
    record_result("e_prefetch_gating", summary)
    assert emb_buckets, f"spy saw no gather during the embedding forward: {gathered}"
    assert not offenders, f"non-unit gathers pulled unit buckets (phase, bucket, unit): {offenders}"


# --------------------------------------------------------------------------------------------
# (f) upstream's failing scenario with max-pool
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu_ranks
def test_upstream_attention_mamba_repro_with_maxpool(dist_env) -> None:
    case = UPSTREAM_CASE
    run = make_run(case, maxpool=True, double_buffer=True)
    units = run.census["units"]
    rank0_print("upstream-case units", units)
    assert [cls for _, cls, _ in units] == ["TransformerLayer", "MambaLayer"], units
    losses = train(run, case, tag="upstream-maxpool")
    stats = run.stats()
    teardown_run(run)
    record_result("f_upstream_maxpool", {"losses": losses, "units": units, "stats": stats})
    assert len(losses) == case.steps * case.num_microbatches
    assert all(math.isfinite(v) for v in losses), losses




def run_fixedpool_case(variant: str) -> None:
    """(g): run FixedPool on the asymmetric pair in a child torchrun, record its outcome (JSON too) as
    ``g_fixedpool_outcome_<variant>`` and hold it to :func:`check_fixedpool_outcome`."""
    rec = run_repro_child(f"fixedpool_child_{variant}", [] if variant == "fork" else ["--emulate-0182"],
                          FIXEDPOOL_JSON.replace(".json", f"_{variant}.json"))
    record_result(f"g_fixedpool_outcome_{variant}", rec)
    if dist.get_rank() == 0:
        check_fixedpool_outcome(rec, variant)


@pytest.mark.gpu
@needs_gpu_ranks
def test_fixedpool_trains_the_asymmetric_pair_with_mamba_outside_the_pool(dist_env) -> None:
    """This tree's FixedPool (its backup allocator keeps bucket storage, patch P1) on the asymmetric
    attention + Mamba pair trains every step with finite losses and pools only the attention unit
    (:func:`check_fixedpool_outcome`, ``fork``, as docs/results.md reports)."""
    run_fixedpool_case("fork")


@pytest.mark.gpu
@needs_gpu_ranks
def test_fixedpool_with_the_0182_backup_completes_or_dies_in_a_cuda_fault(dist_env) -> None:
    """The same pair with the backup swapped back to 0.18.2's TemporaryBucketAllocator, which drops the
    bucket on free, to show what unpatched users hit: what follows is undefined, so the run either
    completes with the Mamba unit outside the pool or dies in a CUDA fault on every failing rank; a
    hang or any other failure fails the test (:func:`check_fixedpool_outcome`, ``emulate-0.18.2-backup``)."""
    run_fixedpool_case("emulate-0.18.2-backup")


# What a use-after-free of a freed bucket looks like when it is caught (a rank's error).
CUDA_FAULTS = ("CUDA error", "illegal memory access", "CUBLAS_STATUS_EXECUTION_FAILED")


def check_fixedpool_outcome(rec: dict[str, Any], variant: str) -> None:
    """The measured outcome of (g) (docs/results.md), asserted so a change is noticed.

    ``fork``: FixedPool with this tree's backup allocator trains all steps with finite losses,
    but pools only unit 0 (attention): unit 1 (Mamba) is silently outside the pool, so neither
    registrable nor address-stable. If it starts to crash, or to pool the Mamba unit, this fails
    and the finding must be re-measured and re-documented.

    ``emulate-0.18.2-backup``: 0.18.2's backup frees the bucket's storage while views of it live
    on, so what follows is undefined: the same run completes (2 ranks on H100) or dies in a CUDA
    error (4 x H200). Either is accepted, and recorded; a hang, a missing rank record, a failure
    that is no CUDA fault, or a completed run that pools the Mamba unit is not.
    """
    tail = rec.get("output_tail", "")[-2000:]
    assert rec["returncode"] != "timeout", f"FixedPool child hung past {FIXEDPOOL_TIMEOUT_S} s:\n{tail}"
    assert sorted(rec["ranks"]) == ["rank0.json", "rank1.json"], f"rank records {sorted(rec['ranks'])}:\n{tail}"
    if variant != "fork" and rec["verdict"] != "ok":
        faults = [r.get("error") or "" for r in rec["ranks"].values() if r.get("status") != "ok"]
        assert rec["returncode"] != 0 and faults and all(any(f in e for f in CUDA_FAULTS) for e in faults), (
            f"{variant}: failed without a CUDA fault on every failing rank (rc={rec['returncode']}, "
            f"errors {faults}):\n{tail}")
        return
    assert rec["returncode"] == 0 and rec["verdict"] == "ok", (
        f"FixedPool child failed (rc={rec['returncode']}, crash lines {rec['crash_lines']}); (g) documents a "
        f"completed run:\n{tail}")
    case_steps = UPSTREAM_CASE.steps * UPSTREAM_CASE.num_microbatches
    for name, r in rec["ranks"].items():
        assert r["status"] == "ok" and r.get("steps_done") == UPSTREAM_CASE.steps, (name, r.get("error"))
        assert r["all_unit_ids"] == [0, 1] and r["outlier_units"] == [1], (
            f"{name}: FixedPool pooled units {r['pooled_units']} of {r['all_unit_ids']}; expected the Mamba "
            "unit (1) outside the pool")
        assert len(r["losses"]) == case_steps and r["finite"], (name, r["losses"])


def test_fixedpool_outcome_rules_without_a_gpu() -> None:
    """check_fixedpool_outcome on recorded outcomes: the fork must complete; emulated 0.18.2 may
    complete or die in a CUDA fault, nothing else."""
    steps = UPSTREAM_CASE.steps
    ok_rank = {"status": "ok", "steps_done": steps, "all_unit_ids": [0, 1], "outlier_units": [1],
               "pooled_units": [0], "losses": [1.0] * (steps * UPSTREAM_CASE.num_microbatches), "finite": True}
    fault = {"status": "exception", "error": "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling"}
    other = {"status": "exception", "error": "ValueError: no buffer found"}

    def rec(rc: Any, verdict: str, rank: dict[str, Any]) -> dict[str, Any]:
        return {"returncode": rc, "verdict": verdict, "crash_lines": [],
                "ranks": {"rank0.json": rank, "rank1.json": rank}}

    for variant in ("fork", "emulate-0.18.2-backup"):
        check_fixedpool_outcome(rec(0, "ok", ok_rank), variant)
        for bad in (rec("timeout", "failed", fault), rec(1, "failed", other),
                    rec(0, "ok", {**ok_rank, "outlier_units": []})):
            with pytest.raises(AssertionError):
                check_fixedpool_outcome(bad, variant)
    check_fixedpool_outcome(rec(1, "failed", fault), "emulate-0.18.2-backup")
    with pytest.raises(AssertionError):
        check_fixedpool_outcome(rec(1, "failed", fault), "fork")


# --------------------------------------------------------------------------------------------
# CPU dry run: the models above build and have the expected unit census
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(HAVE_CUDA, reason="CPU dry run; the GPU tests build these models for real")
@pytest.mark.mamba
@pytest.mark.parametrize(
    "case,expected",
    [
        (HybridCase(), ["MambaLayer", "TransformerLayer", "MoETransformerLayer"] * 2),
        (MEMORY_CASE, ["MambaLayer", "TransformerLayer", "MoETransformerLayer"] * 2),
        (UPSTREAM_CASE, ["TransformerLayer", "MambaLayer"]),
    ],
    ids=["m*e-x2", "memory-case", "upstream-*M"],
)
def test_cpu_dry_run_unit_census(case: HybridCase, expected: list[str]) -> None:
    from megatron.core import parallel_state

    created = False
    if not dist.is_initialized():
        init_one_rank_gloo()
        created = True
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    try:
        tracker = mock.MagicMock()
        tracker.fork.side_effect = lambda *a, **k: contextlib.nullcontext()
        with (
            mock.patch("torch.cuda.current_device", return_value="cpu"),
            mock.patch("megatron.core.ssm.mamba_mixer.get_cuda_rng_tracker", return_value=tracker),
        ):
            model = build_hybrid_model(case, transformer_config(case, use_cpu_initialization=True))
        census = unit_census(model)
        print(case.pattern, json.dumps(census))
        assert [cls for _, cls, _ in census["units"]] == expected
        assert census["non_unit_names"] == [
            "embedding.word_embeddings.weight", "decoder.final_norm.weight", "output_layer.weight"
        ], census["non_unit_names"]
        assert census["non_unit_numel"] == 2 * case.vocab * case.hidden + case.hidden
        # The analytic memory bound must stay finite and positive for the sizes used on GPU.
        assert 0 < activation_bytes_estimate(case) < 4 << 30
        # DDP configs the GPU tests use must be constructible; the max-pool field is the series'.
        cfg = ddp_config(case, maxpool=False, double_buffer=True)
        assert cfg.fsdp_double_buffer and cfg.data_parallel_sharding_strategy == "optim_grads_params"
        assert ddp_config(case, maxpool=True, double_buffer=False).fsdp_double_buffer
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()

