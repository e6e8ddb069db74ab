#!/usr/bin/env bash
# Transformer Engine on one GPU, from the repo root, with TE 2.20.2 (core wheel + torch extension +
# pydantic) in .gpu-wheels/te/ and causal-conv1d 1.7.0 in .gpu-wheels/conv1d/ (setup_gpu_env.sh
# installs them):
#   bash tests/gpu/run_te.sh [--record-missing] [preset]   (sources tests/gpu/setup_gpu_env.sh unless done)
# (The wheel sets can also be installed one at a time: with HFSDP_GPU_SITE inside the checkout's
# ignored .gpu-wheels/, e.g. .gpu-wheels/site, what an earlier setup installed stays there.)
# 1. Transformer Engine (with its torch extension) and causal-conv1d must import, be the pinned
#    versions, and run a TE LayerNormLinear forward and backward on the GPU; otherwise nothing runs.
# 2. The seven TE functional cases (each twin before the cases compared to it, then checkpoint
#    resume across the max-pool flag): goldens compared.
#    --record-missing records the golden of a case that has none for this GPU kind (only from a
#    run that passed its COMPARE_TO check); cases with goldens are always compared.
# 3. Only if they pass: one benchmark invocation over TE_COMPARISON (hfsdp/bench/configs.py):
#    local and TE specs, eager and graphed, no double buffer and max-pool, REPEATS interleaved
#    fresh runs (default 3), Triton choices shared through TRITON_CACHE_AUTOTUNING=1.
#    BENCH_DETERMINISTIC=1 adds --deterministic (the settings of hfsdp/te_determinism.py).
# STAGES (default "functional bench") picks the parts, so each fits one command's time limit;
# BUDGET_S skips the benchmark when it would not finish. Results: $OUT/te_summary.txt,
# $OUT/functional.tgz (logs, metrics, goldens), $OUT/bench-te-<preset>.{json,png,log},
# $OUT/bench-te-<preset>-logs.tgz.
# Note: with causal-conv1d installed, Megatron's non-fused Mamba path calls causal_conv1d_fn too,
# so the local-spec goldens (recorded without it) are not comparable in this environment.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
[ -n "${HFSDP_GPU_ENV_READY:-}" ] || . tests/gpu/setup_gpu_env.sh \
  || { echo "run_te: tests/gpu/setup_gpu_env.sh failed" >&2; exit 2; }
record=()
[ "${1:-}" = "--record-missing" ] && { record=(--record-missing); shift; }
preset=${1:-default}
stages=${STAGES:-functional bench}
out=${OUT:-/tmp/hfsdp_te}; mkdir -p "$out"
summary="$out/te_summary.txt"; : > "$summary"
t0=$(date +%s)
left() { echo $(( ${BUDGET_S:-100000} - ($(date +%s) - t0) )); }

python - <<'PY' 2>&1 | tee -a "$summary"
import sys

import torch

from hfsdp import extras
from hfsdp.training.requirements import importable

missing = [p for p in ("transformer_engine", "mamba_ssm", "causal_conv1d") if not importable(p)]
if missing:
    sys.exit(f"run_te: not importable: {', '.join(missing)}; carry .gpu-wheels/te and .gpu-wheels/conv1d "
             "and source tests/gpu/setup_gpu_env.sh")
import causal_conv1d
import transformer_engine
import transformer_engine.pytorch as te

versions = {"transformer_engine": transformer_engine.__version__, "causal_conv1d": causal_conv1d.__version__}
wanted = {"transformer_engine": extras.TE_VERSION, "causal_conv1d": extras.CAUSAL_CONV1D_VERSION}
if any(not versions[k].startswith(v) for k, v in wanted.items()):
    sys.exit(f"run_te: versions {versions}, pinned {wanted}")
layer = te.LayerNormLinear(256, 256, params_dtype=torch.bfloat16).cuda()
x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
layer(x).float().sum().backward()
torch.cuda.synchronize()
assert x.grad is not None and torch.isfinite(x.grad.float()).all(), "TE LayerNormLinear backward"
print(f"run_te: {versions}, torch {torch.__version__}, {torch.cuda.get_device_name()}: TE LayerNormLinear ok")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "run_te: Transformer Engine check failed; nothing run" | tee -a "$summary"; exit 2; }

if [[ " $stages " == *" functional "* ]]; then
  OUT="$out" CASE_TIMEOUT=${CASE_TIMEOUT:-300} bash tests/gpu/run_functional.sh "${record[@]}" \
    hybrid/hybrid_mcore_te_fsdp_1gpu_eager_no_db hybrid/hybrid_mcore_te_fsdp_1gpu_graph_maxpool \
    hybrid/hybrid_mcore_te_fsdp_1gpu_fused_mamba_eager_no_db hybrid/hybrid_mcore_te_fsdp_1gpu_fused_mamba_maxpool \
    moe/moe_mcore_te_fsdp_1gpu_grouped_gemm_eager_no_db moe/moe_mcore_te_fsdp_1gpu_grouped_gemm_maxpool \
    hybrid/hybrid_mcore_te_fsdp_1gpu_resume_no_db_to_maxpool \
    hybrid/hybrid_mcore_te_fsdp_1gpu_eager_no_db_eval_resume hybrid/hybrid_mcore_te_fsdp_1gpu_graph_maxpool_eval_resume
  rc=$?
  cat "$out/functional_summary.txt" >> "$summary"
  if [ "$rc" -ne 0 ]; then
    echo "run_te: TE functional cases failed (rc=$rc); no benchmark" | tee -a "$summary"
    exit "$rc"
  fi
fi

if [[ " $stages " == *" bench "* ]]; then
  need=${BENCH_NEEDS_S:-900}
  if [ "$(left)" -lt "$need" ]; then
    echo "run_te: benchmark skipped ($(left)s left of BUDGET_S, needs ~${need}s)" | tee -a "$summary"
    exit 1
  fi
  export TRITON_CACHE_AUTOTUNING=1  # one timed Triton choice shared by the invocation's processes
  configs=$(python -c 'from hfsdp.bench.configs import TE_COMPARISON; print(",".join(TE_COMPARISON))')
  logs=/tmp/hfsdp_bench_logs_te_$preset; rm -rf "$logs"
  det=(); [ "${BENCH_DETERMINISTIC:-0}" = 1 ] && det=(--deterministic)
  python scripts/benchmark_double_buffer.py --nproc 1 --preset "$preset" --configs "${CONFIGS:-$configs}" \
    --repeats "${REPEATS:-3}" --timed-steps "${TIMED_STEPS:-20}" --run-timeout "${RUN_TIMEOUT:-240}" \
    --keep-logs "$logs" "${det[@]}" --out-json "$out/bench-te-$preset.json" --out-png "$out/bench-te-$preset.png" \
    -- --logging-level 20 2>&1 | tee "$out/bench-te-$preset.log"
  rc=${PIPESTATUS[0]}
  echo "run_te: $preset benchmark rc=$rc" | tee -a "$summary"
  tar czf "$out/bench-te-$preset-logs.tgz" -C "$logs" . 2>/dev/null
  [ "$rc" -eq 0 ] || exit "$rc"
fi
echo "run_te: done in $(( $(date +%s) - t0 ))s; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" | tee -a "$summary"
