#!/usr/bin/env bash
# Everything at data-parallel size 2 and 4 on the GPUs this machine has, several ranks per GPU where
# there are fewer GPUs than ranks (hfsdp/launch/torchrun.py, docs/several-ranks-per-gpu.md), from the
# repo root with megatron/ materialized:
#   STAGES="exit+functional suite+bench2" bash tests/gpu/run_shared_dp.sh
# STAGES is a list of groups run one after another; the stages of a group ("a+b") run at once, which
# is sound here because nothing of this mode is timed. Stages:
#   exit        the graphed-exit micro-test: CUDA graphs destroyed before the communicators exit in
#               time; kept alive, NCCL's teardown waits on them (tests/gpu/nccl_lifecycle)
#   functional  every 2-rank functional case, held to its real-GPU golden (losses, num-zeros) or its own
#               <platform>_shared golden; --record-missing records the latter where neither exists
#   suite       the max-pool GPU suite at 2 ranks (tests/gpu/run_maxpool_gpu.sh)
#   bench2 bench4   the benchmark at DP=2 / DP=4, deterministic: no_db, maxpool, maxpool_lanes3,
#               no_db_graph, maxpool_graph: losses, pool vs plan, home misses, per-rank peak memory
#               (BENCH_CONFIGS=a,b,... runs those configurations instead)
#   te te4      Transformer Engine at DP=2 / DP=4, deterministic: te_no_db vs te_maxpool_graph (TE site
#               needed)
#   f2          the fused-Mamba FixedPool scenario at 2 ranks (TE and causal-conv1d site needed)
#   main        the main job (python -m hfsdp.main_job): graphed DP=1, then the DP=2 rehearsal
# Transformer Engine and causal-conv1d change the local-spec numerics (TE's FusedAdam, conv1d in the
# non-fused Mamba path), so they are on PYTHONPATH only for te and f2: HFSDP_EXTRA_SITE names their
# folder (unpacked wheels). Results: $OUT/shared_dp.tgz (every stage's log and outputs, no
# checkpoints) and $OUT/shared_dp_summary.txt. STAGE_TIMEOUT (default 560 s) bounds each stage.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
[ -n "${HFSDP_GPU_ENV_READY:-}" ] || . tests/gpu/setup_gpu_env.sh \
  || { echo "run_shared_dp: tests/gpu/setup_gpu_env.sh failed" >&2; exit 2; }
out=${OUT:-/tmp/hfsdp_shared_dp_out}; mkdir -p "$out"
work=${WORK:-/tmp/hfsdp_shared_dp}; mkdir -p "$work"
summary="$out/shared_dp_summary.txt"
platform=$(python -m hfsdp.functional.platform "${PLATFORM:-}") || exit 2  # what run_functional.sh holds cases to
mapfile -t two_rank < <(cd tests/functional_tests/test_cases && grep -L '^NPROC: 1' */*/model_config.yaml \
  | xargs -n1 dirname | grep -v '^smoke/')
bench_configs=${BENCH_CONFIGS:-no_db,maxpool,maxpool_lanes3,no_db_graph,maxpool_graph}
bench() {  # bench DP CONFIGS: the benchmark in this mode (no step times: it reports memory and losses)
  # 6 steps: 3 eager warm-up steps, the capture, 2 replays (graphed configurations); nothing is timed.
  python scripts/benchmark_double_buffer.py --nproc "$1" --ranks-per-gpu "$1" --preset default --configs "$2" \
    --repeats 1 --warmup-steps 5 --timed-steps 1 --no-prime --deterministic --run-timeout "${RUN_TIMEOUT:-400}" \
    --no-chart --keep-logs "$work/$3/logs" --out-json "$work/$3/bench.json" -- --logging-level 20
}
with_extra() {  # run a command with the TE / causal-conv1d site on PYTHONPATH
  [ -d "${HFSDP_EXTRA_SITE:-}" ] || { echo "run_shared_dp: HFSDP_EXTRA_SITE is not a folder" >&2; return 2; }
  PYTHONPATH="$HFSDP_EXTRA_SITE:$PYTHONPATH" "$@"
}
stage() {  # stage NAME: run it with its output in $work/NAME.log
  local name=$1 rc
  mkdir -p "$work/$name"
  local t0=$SECONDS
  case $name in
    exit) OUT="$work/exit" timeout -k 10 "${STAGE_TIMEOUT:-560}" python tests/gpu/nccl_lifecycle/full_iter_cuda_graph_mfsdp.py ;;
    functional) OUT="$work/functional" HFSDP_FUNCTIONAL_OUT="$work/functional/cases" RANKS_PER_GPU=2 \
      JOBS=${JOBS:-3} CASE_TIMEOUT=${CASE_TIMEOUT:-300} \
      timeout -k 10 "${STAGE_TIMEOUT:-560}" bash tests/gpu/run_functional.sh --record-missing "${two_rank[@]}" ;;
    suite) OUT="$work/suite" NPROC=2 timeout -k 10 "${STAGE_TIMEOUT:-560}" bash tests/gpu/run_maxpool_gpu.sh ;;
    bench2) timeout -k 10 "${STAGE_TIMEOUT:-560}" bash -c 'bench 2 "$bench_configs" bench2' ;;
    bench4) timeout -k 10 "${STAGE_TIMEOUT:-560}" bash -c 'bench 4 "$bench_configs" bench4' ;;
    te) timeout -k 10 "${STAGE_TIMEOUT:-560}" bash -c 'with_extra bench 2 te_no_db,te_maxpool_graph te' ;;
    te4) timeout -k 10 "${STAGE_TIMEOUT:-560}" bash -c 'with_extra bench 4 te_no_db,te_maxpool_graph te4' ;;
    f2) OUT="$work/f2" timeout -k 10 "${STAGE_TIMEOUT:-560}" bash -c 'with_extra bash tests/gpu/run_fused_mamba_fixedpool.sh' ;;
    main) TRAIN_ITERS=${TRAIN_ITERS:-12} EAGER_ITERS=${EAGER_ITERS:-6} \
      timeout -k 10 "${STAGE_TIMEOUT:-560}" python -m hfsdp.main_job ;;
    *) echo "run_shared_dp: unknown stage $name" >&2; return 2 ;;
  esac > "$work/$name.log" 2>&1
  rc=$?
  echo "stage $name: rc=$rc $((SECONDS - t0))s" | tee -a "$summary"
  return $rc
}
export -f bench with_extra  # the stages run them through `timeout bash -c`
export work bench_configs
echo "run_shared_dp: $(date -u +%FT%TZ) platform=$platform stages='${STAGES:-}'" >> "$summary"
rc=0
for group in ${STAGES:?give STAGES, e.g. STAGES=\"exit+functional bench2\"}; do
  pids=()
  for name in ${group//+/ }; do
    stage "$name" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
done
# What came out, in a few lines each (the logs hold the rest).
{
  grep -h "exit:" "$work/exit.log" 2>/dev/null
  cat "$work/functional/functional_summary.txt" 2>/dev/null
  grep -h "^summary:" "$work/suite.log" 2>/dev/null
  for b in bench2 bench4 te te4; do
    [ -f "$work/$b.log" ] && { echo "== $b"; sed -n '/^config /,$p' "$work/$b.log" | grep -v "^wrote"; }
  done
  [ -f "$work/f2.log" ] && sed -n '/^summary:/,$p' "$work/f2.log"
  [ -f "$work/main.log" ] && sed -n '/== main_job: result ==/,$p' "$work/main.log"
} >> "$summary"
tar czf "$out/shared_dp.tgz" --exclude='checkpoints' --exclude='*.pt' -C "$work" .
exit $rc
