#!/usr/bin/env bash
# FP8 parameters (--fp8-param-gather) under Megatron-FSDP on one GPU, from the repo root, with
# TE 2.20.2 and causal-conv1d in .gpu-wheels/ (setup_gpu_env.sh installs them):
#   bash tests/gpu/run_fp8_params.sh        (sources tests/gpu/setup_gpu_env.sh unless done)
# 1. the DP=2 MoE cases with FP8 parameters (delayed and tensorwise; eager without a double buffer,
#    graphed max-pool with NCCL user buffers), 2 ranks sharing the GPU, held to their goldens; the
#    shards are re-quantized row-wise (fp8_shard_quantize.py), the goldens were recorded with TE's path;
# 2. pool = plan: the planner on each max-pool case's flags (python -m hfsdp.planner.against_log),
#    with TE importable so that it plans the FP8 parameters as the run laid them out.
# Results: $OUT/fp8_params_summary.txt, $OUT/functional_summary.txt, $OUT/functional/.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
[ -n "${HFSDP_GPU_ENV_READY:-}" ] || . tests/gpu/setup_gpu_env.sh \
  || { echo "run_fp8_params: tests/gpu/setup_gpu_env.sh failed" >&2; exit 2; }
out=${OUT:-/tmp/hfsdp_fp8_params}; mkdir -p "$out"
summary="$out/fp8_params_summary.txt"; : > "$summary"
root=tests/functional_tests/test_cases/moe
cases=()
for recipe in delayed tensorwise; do
  for kind in eager_no_db graph_maxpool_nccl_ub; do
    cases+=("$root/moe_mcore_te_fsdp_2gpu_fp8_${recipe}_pg_${kind}")
  done
done
python -m hfsdp.functional.batch "${cases[@]}" --ranks-per-gpu 2 --jobs "${JOBS:-2}" \
  --timeout-s "${CASE_TIMEOUT:-400}" --output-dir "$out/functional" \
  --summary "$out/functional_summary.txt" 2>&1 | tail -20
rc=${PIPESTATUS[0]}
cat "$out/functional_summary.txt" >> "$summary"
logs=()
for recipe in delayed tensorwise; do
  logs+=("$out/functional/moe/moe_mcore_te_fsdp_2gpu_fp8_${recipe}_pg_graph_maxpool_nccl_ub/run1.log")
done
python -m hfsdp.planner.against_log "${logs[@]}" 2>&1 | tee -a "$summary"
plan_rc=${PIPESTATUS[0]}
echo "run_fp8_params: functional rc=$rc, pool = plan rc=$plan_rc; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" | tee -a "$summary"
[ "$rc" -eq 0 ] && [ "$plan_rc" -eq 0 ]
