#!/usr/bin/env bash
# Max-pool lanes (--megatron-fsdp-max-pool-lanes 3) against the 2-lane pool and no double
# buffering, from the repo root (sets up the GPU environment itself):
#   bash tests/gpu/run_lanes.sh [--record] [preset ...]
# Runs tests/gpu/run_cuda_graphs.sh with the lanes cases and configurations:
# 1. functional: the 3-lane cases, eager and graphed, whose lm loss must equal their eager
#    no-double-buffer twin bit for bit at every step (COMPARE_TO); with NPROC >= 2 also the 2-GPU
#    eager case, the one where the pool is allocated (at DP=1 Megatron-FSDP never all-gathers, so
#    the pool is planned but not allocated). The lanes cases have no goldens until a run records
#    them: pass --record the first time (the COMPARE_TO check runs either way);
# 2. only if they pass, one benchmark invocation per preset (default: `default`) through
#    `pretrain`: no_db, maxpool, maxpool_lanes3, no_db_graph, maxpool_graph, maxpool_lanes3_graph,
#    REPEATS (>= 3, default 3) interleaved fresh runs on NPROC GPUs (default 1); its table holds
#    step time, peak memory and pool against plan, then the loss agreement and the pool check
#    (pool = plan, home misses), which also goes to the summary.
# Results under $OUT (default /tmp/hfsdp_lanes): cuda_graphs_summary.txt, functional.tgz,
# bench-<preset>.{json,png,log}, bench-<preset>-logs.tgz. BUDGET_S as in run_cuda_graphs.sh.
[ -n "${HFSDP_GPU_ENV_READY:-}" ] || . tests/gpu/setup_gpu_env.sh \
  || { echo "run_lanes: GPU set-up failed" >&2; exit 2; }
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
export NPROC=${NPROC:-1} REPEATS=${REPEATS:-3} OUT=${OUT:-/tmp/hfsdp_lanes}
if [ "$REPEATS" -lt 3 ]; then
  echo "run_lanes: REPEATS=$REPEATS; step-time comparisons need at least 3 repeats" >&2
  exit 2
fi
# Each lanes case after its COMPARE_TO twin, so the twin's metrics come from this run.
CASES="hybrid/hybrid_mcore_local_fsdp_1gpu_eager_no_db hybrid/hybrid_mcore_local_fsdp_1gpu_eager_maxpool_lanes3"
CASES="$CASES hybrid/hybrid_mcore_local_fsdp_1gpu_graph_maxpool_lanes3"
[ "$NPROC" -ge 2 ] && CASES="$CASES hybrid/hybrid_mcore_local_fsdp_2gpu_eager_no_db hybrid/hybrid_mcore_local_fsdp_2gpu_eager_maxpool_lanes3"
export CASES CONFIGS=no_db,maxpool,maxpool_lanes3,no_db_graph,maxpool_graph,maxpool_lanes3_graph
export BENCH_NEEDS_S=${BENCH_NEEDS_S:-630}  # six configurations instead of four
exec bash tests/gpu/run_cuda_graphs.sh "$@"
