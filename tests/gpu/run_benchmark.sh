#!/usr/bin/env bash
# Double-buffer benchmark + host/device profiles on a 2-GPU machine, from the repo root:
#   . tests/gpu/setup_gpu_env.sh && bash tests/gpu/run_benchmark.sh [preset] [extra benchmark args]
# 1. the timed benchmark (interleaved fresh runs, medians; JSON + PNG)  -> $OUT/bench-<preset>.*
# 2. if BUDGET_S leaves room, in this order: one torch.profiler run (per-step timeline), one
#    allocator-trace run (what is live at the peak, by allocator) and one cProfile run, each of
#    no_db and maxpool (3 timed steps; they distort step times and are only for attribution)
#    -> $OUT/prof-<preset>.tgz (timelines, op tables, memory and cProfile summaries)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
# Deterministic Triton kernel choice across the fresh processes of one invocation.
export TRITON_CACHE_AUTOTUNING=1
preset=${1:-default}; shift || true
out=${OUT:-/tmp/hfsdp_bench}; mkdir -p "$out"
t0=$(date +%s)
python scripts/benchmark_double_buffer.py --preset "$preset" --run-timeout "${RUN_TIMEOUT:-150}" \
  --out-json "$out/bench-$preset.json" --out-png "$out/bench-$preset.png" "$@" 2>&1 | tee "$out/bench-$preset.log"
rc=${PIPESTATUS[0]}
left=$(( ${BUDGET_S:-100000} - ($(date +%s) - t0) ))
prof=/tmp/hfsdp_prof; rm -rf "$prof"; mkdir -p "$prof"
# PROF_STACKS=1: the timeline pass records Python frames, so *.idle.txt names the code behind
# each GPU-idle gap (adds host overhead to that pass only).
stack=(); [ "${PROF_STACKS:-0}" = 1 ] && stack=(--profile-stack)
if [ "$left" -gt "${PROFILE_NEEDS_S:-150}" ]; then
  python scripts/benchmark_double_buffer.py --preset "$preset" --configs no_db,maxpool --repeats 1 \
    --warmup-steps 3 --timed-steps 3 --no-plan --no-chart --no-prime --run-timeout 120 \
    --profile-dir "$prof" ${stack[@]+"${stack[@]}"} --out-json "$prof/torchprofile-run.json" "$@" > "$prof/torchprofile.log" 2>&1
  for f in "$prof"/*rank0.timeline.txt; do [ -f "$f" ] && echo "$(basename "$f"): $(cat "$f")"; done
  for f in "$prof"/*rank0.idle.txt; do [ -f "$f" ] && { echo "== $(basename "$f")"; head -20 "$f"; }; done
  for f in "$prof"/*rank0.waits.txt; do [ -f "$f" ] && { echo "== $(basename "$f")"; head -16 "$f"; }; done
fi
left=$(( ${BUDGET_S:-100000} - ($(date +%s) - t0) ))
if [ "$left" -gt "${PROFILE_NEEDS_S:-150}" ]; then
  python scripts/benchmark_double_buffer.py --preset "$preset" --configs no_db,maxpool --repeats 1 \
    --warmup-steps 3 --timed-steps 3 --no-plan --no-chart --no-prime --run-timeout 120 \
    --memory-trace-dir "$prof" --out-json "$prof/memtrace-run.json" "$@" > "$prof/memtrace.log" 2>&1
  cat "$prof"/*rank0.memtrace.txt 2>/dev/null
fi
left=$(( ${BUDGET_S:-100000} - ($(date +%s) - t0) ))
if [ "$left" -gt "${PROFILE_NEEDS_S:-150}" ]; then
  python scripts/benchmark_double_buffer.py --preset "$preset" --configs no_db,maxpool --repeats 1 \
    --warmup-steps 3 --timed-steps 3 --no-plan --no-chart --no-prime --run-timeout 120 \
    --pyprofile-dir "$prof" --out-json "$prof/pyprofile-run.json" "$@" > "$prof/pyprofile.log" 2>&1
fi
# Raw traces stay behind (two ranks x two configs pass $OUT's 16 MiB per-file limit); their
# reductions (.timeline.txt, .ops.txt) come back. Keep them with PROF_KEEP_TRACES=1.
excl=(); [ "${PROF_KEEP_TRACES:-0}" = 1 ] || excl=(--exclude='*.json.gz')
tar czf "$out/prof-$preset.tgz" "${excl[@]}" -C "$prof" . || echo "run_benchmark: tar of $prof failed"
echo "run_benchmark: benchmark rc=$rc, $(( $(date +%s) - t0 ))s"
exit "$rc"
