#!/usr/bin/env bash
# Max-pool lanes (--megatron-fsdp-max-pool-lanes 3) against the 2-lane pool and no double
# buffering, from the repo root (sets up the GPU environment itself):
#   bash tests/gpu/run_lanes.sh [--record] [preset ...]
# 1. functional: the 3-lane cases, eager and graphed, whose lm loss must equal their eager
#    no-double-buffer twin bit for bit at every step (COMPARE_TO); with NPROC >= 2 also the 2-GPU
#    eager case, the one where the pool is allocated (at DP=1 Megatron-FSDP never all-gathers, so
#    the pool is planned but not allocated). The lanes cases have no goldens until a run records
#    them: pass --record the first time (the COMPARE_TO check runs either way);
# 2. only if they pass, one benchmark invocation per preset (default: `default`) through
#    `pretrain`: no_db, maxpool, maxpool_lanes3, no_db_graph, maxpool_graph, maxpool_lanes3_graph,
#    REPEATS (>= 3, default 3) interleaved fresh runs on NPROC GPUs (default 1); its table holds
#    step time, peak memory and pool against plan, then the loss agreement and the pool check
#    (pool = plan, home misses).
# BUDGET_S (seconds) skips what would not finish in time. Results: $OUT/lanes_summary.txt,
# $OUT/functional.tgz, $OUT/bench-<preset>.{json,png,log}, $OUT/bench-<preset>-logs.tgz.
. tests/gpu/setup_gpu_env.sh || { echo "run_lanes: GPU set-up failed" >&2; exit 2; }
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.safety || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
record=()
[ "${1:-}" = "--record" ] && { record=(--record); shift; }
presets=("$@"); [ ${#presets[@]} -eq 0 ] && presets=(default)
nproc=${NPROC:-1}
repeats=${REPEATS:-3}
if [ "$repeats" -lt 3 ]; then
  echo "run_lanes: REPEATS=$repeats; step-time comparisons need at least 3 repeats" >&2
  exit 2
fi
out=${OUT:-/tmp/hfsdp_lanes}; mkdir -p "$out"
summary="$out/lanes_summary.txt"; : > "$summary"
t0=$(date +%s)
left() { echo $(( ${BUDGET_S:-100000} - ($(date +%s) - t0) )); }

cases=(hybrid/hybrid_mcore_local_fsdp_1gpu_eager_maxpool_lanes3 hybrid/hybrid_mcore_local_fsdp_1gpu_graph_maxpool_lanes3)
[ "$nproc" -ge 2 ] && cases+=(hybrid/hybrid_mcore_local_fsdp_2gpu_eager_maxpool_lanes3)
OUT="$out" CASE_TIMEOUT=${CASE_TIMEOUT:-240} bash tests/gpu/run_functional.sh "${record[@]}" "${cases[@]}"
rc=$?
cat "$out/functional_summary.txt" >> "$summary"
if [ "$rc" -ne 0 ]; then
  echo "run_lanes: functional cases failed (rc=$rc); no benchmark" | tee -a "$summary"
  exit "$rc"
fi
# Deterministic Triton (Mamba) kernel choice across the fresh processes of one invocation.
export TRITON_CACHE_AUTOTUNING=1
for preset in "${presets[@]}"; do
  need=${BENCH_NEEDS_S:-630}
  if [ "$(left)" -lt "$need" ]; then
    echo "run_lanes: $preset benchmark skipped ($(left)s left of BUDGET_S, needs ~${need}s)" | tee -a "$summary"
    continue
  fi
  logs=/tmp/hfsdp_lanes_bench_logs_$preset; rm -rf "$logs"
  python scripts/benchmark_double_buffer.py --nproc "$nproc" --preset "$preset" \
    --configs no_db,maxpool,maxpool_lanes3,no_db_graph,maxpool_graph,maxpool_lanes3_graph \
    --repeats "$repeats" --timed-steps "${TIMED_STEPS:-20}" --run-timeout "${RUN_TIMEOUT:-240}" \
    --keep-logs "$logs" --out-json "$out/bench-$preset.json" --out-png "$out/bench-$preset.png" \
    -- --logging-level 20 2>&1 | tee "$out/bench-$preset.log"
  echo "run_lanes: $preset benchmark rc=${PIPESTATUS[0]}" | tee -a "$summary"
  sed -n '/^pool check:/,$p' "$out/bench-$preset.log" | grep -E '^(pool check:|  )' >> "$summary"
  tar czf "$out/bench-$preset-logs.tgz" -C "$logs" . 2>/dev/null
done
echo "run_lanes: done in $(( $(date +%s) - t0 ))s; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" | tee -a "$summary"
