#!/usr/bin/env bash
# Full-iteration CUDA graphs with Megatron-FSDP on one GPU, from the repo root:
#   . tests/gpu/setup_gpu_env.sh && bash tests/gpu/run_cuda_graphs.sh [--record] [preset ...]
# 1. the 1-GPU functional cases: the eager no-double-buffer twin, then graphed no-db and graphed
#    max-pool, whose lm loss must equal the twin's at every step; then the same with evaluation,
#    a checkpoint and a resume (eval_resume: validation losses equal too); goldens compared (or recorded);
# 2. only if they pass, the benchmark through `pretrain` for each preset (default: `default`):
#    eager and graphed, no-db and max-pool, REPEATS interleaved fresh runs (default 3), with the
#    capture memory report in every graphed run's log (--logging-level 20 for all runs alike).
# BUDGET_S (seconds) skips what would not finish in time. Results: $OUT/cuda_graphs_summary.txt,
# $OUT/functional.tgz, $OUT/bench-<preset>.{json,png,log}, $OUT/bench-<preset>-logs.tgz.
# CASES (space-separated), CONFIGS (comma-separated) and NPROC (default 1) choose other cases,
# configurations and GPU counts (tests/gpu/run_lanes.sh does).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
record=()
[ "${1:-}" = "--record" ] && { record=(--record); shift; }
presets=("$@"); [ ${#presets[@]} -eq 0 ] && presets=(default)
out=${OUT:-/tmp/hfsdp_cuda_graphs}; mkdir -p "$out"
summary="$out/cuda_graphs_summary.txt"; : > "$summary"
t0=$(date +%s)
left() { echo $(( ${BUDGET_S:-100000} - ($(date +%s) - t0) )); }

read -r -a cases <<< "${CASES:-hybrid/hybrid_mcore_local_fsdp_1gpu_eager_no_db hybrid/hybrid_mcore_local_fsdp_1gpu_graph_no_db hybrid/hybrid_mcore_local_fsdp_1gpu_graph_maxpool hybrid/hybrid_mcore_local_fsdp_1gpu_eager_no_db_eval_resume hybrid/hybrid_mcore_local_fsdp_1gpu_graph_maxpool_eval_resume}"
OUT="$out" CASE_TIMEOUT=${CASE_TIMEOUT:-240} bash tests/gpu/run_functional.sh "${record[@]}" "${cases[@]}"
rc=$?
cat "$out/functional_summary.txt" >> "$summary"
if [ "$rc" -ne 0 ]; then
  echo "run_cuda_graphs: functional cases failed (rc=$rc); no benchmark" | tee -a "$summary"
  exit "$rc"
fi
# Deterministic Triton (Mamba) kernel choice across the fresh processes of one invocation.
export TRITON_CACHE_AUTOTUNING=1
for preset in "${presets[@]}"; do
  need=${BENCH_NEEDS_S:-420}
  if [ "$(left)" -lt "$need" ]; then
    echo "run_cuda_graphs: $preset benchmark skipped ($(left)s left of BUDGET_S, needs ~${need}s)" | tee -a "$summary"
    continue
  fi
  logs=/tmp/hfsdp_bench_logs_$preset; rm -rf "$logs"
  python scripts/benchmark_double_buffer.py --nproc "${NPROC:-1}" --preset "$preset" \
    --configs "${CONFIGS:-no_db,maxpool,no_db_graph,maxpool_graph}" --repeats "${REPEATS:-3}" \
    --timed-steps "${TIMED_STEPS:-20}" --run-timeout "${RUN_TIMEOUT:-240}" --keep-logs "$logs" \
    --out-json "$out/bench-$preset.json" --out-png "$out/bench-$preset.png" \
    -- --logging-level 20 2>&1 | tee "$out/bench-$preset.log"
  bench_rc=${PIPESTATUS[0]}
  [ "$bench_rc" -ne 0 ] && rc=$bench_rc  # the script's exit status is the worst of its stages
  echo "run_cuda_graphs: $preset benchmark rc=$bench_rc" | tee -a "$summary"
  sed -n '/^pool check:/,/^wrote /p' "$out/bench-$preset.log" | grep -v '^wrote ' >> "$summary"
  grep -h "full-iteration CUDA graph" "$logs"/*.log > "$out/bench-$preset-capture-memory.txt" 2>/dev/null
  tar czf "$out/bench-$preset-logs.tgz" -C "$logs" . 2>/dev/null
done
echo "run_cuda_graphs: done in $(( $(date +%s) - t0 ))s; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" | tee -a "$summary"
exit "$rc"
