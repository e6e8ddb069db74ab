#!/usr/bin/env bash
# Two Megatron-FSDP models in one process (examples/reference_kl/train.py) on one GPU, from the
# repo root:  bash tests/gpu/run_reference_kl.sh   (sources tests/gpu/setup_gpu_env.sh unless done)
# 1. the hybrid_reference_kl_* cases: DP=1 and DP=2 (2 ranks sharing the GPU), eager and graphed,
#    the reference freed after step 10; a KL weight of 0 is held bit for bit to the no-reference
#    twin (COMPARE_TO). RECORD=1 records the goldens of cases that have none (--record-missing).
# 2. pool = plan for the trained model of each graphed DP=2 case (python -m hfsdp.planner.against_log);
#    the reference has no double buffer, so no pool.
# Results: $OUT/reference_kl_summary.txt, $OUT/functional/.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
[ -n "${HFSDP_GPU_ENV_READY:-}" ] || . tests/gpu/setup_gpu_env.sh \
  || { echo "run_reference_kl: tests/gpu/setup_gpu_env.sh failed" >&2; exit 2; }
out=${OUT:-/tmp/hfsdp_reference_kl}; mkdir -p "$out"
summary="$out/reference_kl_summary.txt"; : > "$summary"
root=tests/functional_tests/test_cases/hybrid
record=(); [ -n "${RECORD:-}" ] && record=(--record-missing)
rc=0
for dp in 1 2; do  # one rank per GPU at DP=1; DP=2 shares the GPU
  mapfile -t cases < <(ls -d "$root"/hybrid_reference_kl_${dp}gpu_*)
  shared=(); [ "$dp" -gt 1 ] && shared=(--ranks-per-gpu "$dp")
  python -m hfsdp.functional.batch "${cases[@]}" "${record[@]}" "${shared[@]}" --jobs "${JOBS:-2}" \
    --timeout-s "${CASE_TIMEOUT:-400}" --output-dir "$out/functional" \
    --summary "$out/functional_summary_dp$dp.txt" 2>&1 | tail -20
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  cat "$out/functional_summary_dp$dp.txt" >> "$summary"
done
logs=("$out"/functional/hybrid/hybrid_reference_kl_2gpu_graph_*/run1.log)
python -m hfsdp.planner.against_log "${logs[@]}" 2>&1 | tee -a "$summary"
plan_rc=${PIPESTATUS[0]}
grep -h "reference model freed" "$out"/functional/hybrid/hybrid_reference_kl_*/run1.log | sort -u | tee -a "$summary"
echo "run_reference_kl: functional rc=$rc, pool = plan rc=$plan_rc; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" | tee -a "$summary"
[ "$rc" -eq 0 ] && [ "$plan_rc" -eq 0 ]
