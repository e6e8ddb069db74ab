#!/usr/bin/env bash
# Multi-GPU validation of graphed max-pool training, from the repo root on a machine with >= 2 GPUs:
#   . tests/gpu/setup_gpu_env.sh && bash tests/gpu/run_multi_gpu.sh [NPROC]
# NPROC (default: all GPUs, at least 2) is the data-parallel size of the benchmark. In order, each
# step only if BUDGET_S leaves room for it:
#   1. the 2-GPU functional cases, goldens compared, never re-recorded (RECORD_NEW=1 records the
#      graphed DP=2 cases that have no golden yet: hybrid_mcore_local_fsdp_2gpu_*);
#   2. the max-pool GPU suite (tests/gpu/run_maxpool_gpu.sh, 2 GPUs);
#   3. the benchmark through pretrain at DP=NPROC: eager and graphed, no-db and max-pool, and
#      graphed max-pool with NCCL user buffers, 3 interleaved repeats;
#   4. one profiled eager max-pool + NCCL user-buffer run: which NCCL kernels ran (ncclSymk* are
#      the symmetric-memory kernels), from the bench worker's kernel table.
# NVLink multicast stays off: this script sets and asserts the guards for every step.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nproc=${1:-$ngpu}
if [ "$ngpu" -lt 2 ] || [ "$nproc" -lt 2 ]; then
  echo "run_multi_gpu: needs at least 2 GPUs (found $ngpu, asked for $nproc)" >&2; exit 2
fi
out=${OUT:-/tmp/hfsdp_multi_gpu}; mkdir -p "$out"
summary="$out/multi_gpu_summary.txt"; : > "$summary"
t0=$(date +%s)
left() { echo $(( ${BUDGET_S:-100000} - ($(date +%s) - t0) )); }
step() { echo "run_multi_gpu: $*" | tee -a "$summary"; }

# 1. Functional cases: existing goldens are compared; new DP=2 graph cases recorded only on request.
mapfile -t all < <(cd tests/functional_tests/test_cases && grep -l '^NPROC: 2' */*/model_config.yaml | xargs -n1 dirname)
mapfile -t fresh < <(for c in "${all[@]}"; do ls tests/functional_tests/test_cases/"$c"/golden_values_*.json >/dev/null 2>&1 || echo "$c"; done)
mapfile -t known < <(for c in "${all[@]}"; do ls tests/functional_tests/test_cases/"$c"/golden_values_*.json >/dev/null 2>&1 && echo "$c"; done)
OUT="$out/f" bash tests/gpu/run_functional.sh "${known[@]}"; step "functional (compare) rc=$? (${#known[@]} cases)"
if [ "${RECORD_NEW:-0}" = 1 ] && [ ${#fresh[@]} -gt 0 ]; then
  # The eager twin first: every graphed case compares against its metrics.
  mapfile -t fresh < <(printf '%s\n' "${fresh[@]}" | grep eager; printf '%s\n' "${fresh[@]}" | grep -v eager)
  OUT="$out/f-new" bash tests/gpu/run_functional.sh --record "${fresh[@]}"; step "functional (record new) rc=$?"
fi
# 2. Max-pool GPU suite.
if [ "$(left)" -gt "${SUITE_NEEDS_S:-300}" ]; then
  OUT="$out/suite" NPROC=2 bash tests/gpu/run_maxpool_gpu.sh > "$out/maxpool_gpu.log" 2>&1; step "maxpool suite rc=$?"
else
  step "maxpool suite skipped ($(left)s left)"
fi
# 3. Benchmark at DP=NPROC.
if [ "$(left)" -gt "${BENCH_NEEDS_S:-600}" ]; then
  TRITON_CACHE_AUTOTUNING=1 python scripts/benchmark_double_buffer.py --nproc "$nproc" --preset default \
    --configs no_db,maxpool,no_db_graph,maxpool_graph,maxpool_ub_graph --repeats 3 --timed-steps 15 \
    --run-timeout "${RUN_TIMEOUT:-240}" --keep-logs /tmp/hfsdp_multi_gpu_logs \
    --out-json "$out/bench-dp$nproc.json" --out-png "$out/bench-dp$nproc.png" -- --logging-level 20 \
    > "$out/bench-dp$nproc.log" 2>&1
  step "benchmark DP=$nproc rc=$?"
else
  step "benchmark skipped ($(left)s left)"
fi
# 4. Which NCCL kernels the user-buffer run used (eager: the profiler does not see inside a graph).
if [ "$(left)" -gt "${PROFILE_NEEDS_S:-150}" ]; then
  python scripts/benchmark_double_buffer.py --nproc "$nproc" --preset default --configs maxpool_ub \
    --repeats 1 --warmup-steps 3 --timed-steps 3 --no-plan --no-chart --no-prime \
    --profile-dir /tmp/hfsdp_multi_gpu_prof --out-json "$out/nccl-kernels.json" > "$out/nccl-kernels.log" 2>&1
  step "NCCL kernel profile rc=$?"
fi
tar czf "$out/logs.tgz" -C /tmp hfsdp_multi_gpu_logs 2>/dev/null
step "done in $(( $(date +%s) - t0 ))s; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
