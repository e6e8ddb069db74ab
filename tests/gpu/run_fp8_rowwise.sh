#!/usr/bin/env bash
# Row-wise FP8 shard re-quantization (HFSDP_FP8_ROWWISE_SHARDS=1, fp8_shard_quantize.py) on one GPU,
# from the repo root, with TE 2.20.2 and causal-conv1d in .gpu-wheels/ (setup_gpu_env.sh installs them):
#   bash tests/gpu/run_fp8_rowwise.sh        (sources tests/gpu/setup_gpu_env.sh unless done)
# 1. functional: the DP=2 MoE cases with FP8 parameters (delayed and tensorwise, eager and graphed
#    max-pool with NCCL user buffers), 2 ranks sharing the GPU, with the switch on, held to their
#    goldens (recorded with TE's own path): the switch must leave the losses bit-identical.
# 2. bench, only if they pass: one invocation on the realistic_1gpu preset, REPEATS interleaved runs
#    (default 3) of the best bf16 configuration, _fp8_tensorwise_pg and _fp8_tensorwise_pg_rowwise
#    (the same with the switch): the switch's effect alone, against its twin in the same invocation.
# STAGES (default "functional bench") picks the parts, each about one command's time limit.
# Results: $OUT/fp8_rowwise_summary.txt, $OUT/functional_summary.txt, $OUT/bench-fp8-rowwise.{json,png,log}.
# The realistic preset also needs Apex's fused_weight_gradient_mlp_cuda to import (docs/benchmark.md).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
[ -n "${HFSDP_GPU_ENV_READY:-}" ] || . tests/gpu/setup_gpu_env.sh \
  || { echo "run_fp8_rowwise: tests/gpu/setup_gpu_env.sh failed" >&2; exit 2; }
stages=${STAGES:-functional bench}
out=${OUT:-/tmp/hfsdp_fp8_rowwise}; mkdir -p "$out"
summary="$out/fp8_rowwise_summary.txt"; : > "$summary"
switch=HFSDP_FP8_ROWWISE_SHARDS=1

if [[ " $stages " == *" functional "* ]]; then
  cases=()
  for recipe in delayed tensorwise; do
    for kind in eager_no_db graph_maxpool_nccl_ub; do
      cases+=("tests/functional_tests/test_cases/moe/moe_mcore_te_fsdp_2gpu_fp8_${recipe}_pg_${kind}")
    done
  done
  python -m hfsdp.functional.batch "${cases[@]}" --ranks-per-gpu 2 --jobs "${JOBS:-2}" \
    --timeout-s "${CASE_TIMEOUT:-400}" --env "$switch" --output-dir "$out/functional" \
    --summary "$out/functional_summary.txt" 2>&1 | tail -20
  rc=${PIPESTATUS[0]}
  cat "$out/functional_summary.txt" >> "$summary"
  if [ "$rc" -ne 0 ]; then
    echo "run_fp8_rowwise: functional cases with $switch failed (rc=$rc); no benchmark" | tee -a "$summary"
    exit "$rc"
  fi
fi

if [[ " $stages " == *" bench "* ]]; then
  best=te_maxpool_ub_graph_bf16rs_fused_pao
  python scripts/benchmark_double_buffer.py --nproc 1 --preset realistic_1gpu --no-plan \
    --configs "$best,${best}_fp8_tensorwise_pg,${best}_fp8_tensorwise_pg_rowwise" --baseline "$best" \
    --repeats "${REPEATS:-3}" --timed-steps "${TIMED_STEPS:-8}" --run-timeout "${RUN_TIMEOUT:-240}" \
    --out-json "$out/bench-fp8-rowwise.json" --out-png "$out/bench-fp8-rowwise.png" \
    2>&1 | tee "$out/bench-fp8-rowwise.log"
  rc=${PIPESTATUS[0]}
  echo "run_fp8_rowwise: benchmark rc=$rc" | tee -a "$summary"
  [ "$rc" -eq 0 ] || exit "$rc"
fi
echo "run_fp8_rowwise: done; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" | tee -a "$summary"
