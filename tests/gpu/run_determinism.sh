#!/usr/bin/env bash
# Cross-process determinism of double buffering on a 2-GPU machine, from the repo root:
#   . tests/gpu/setup_gpu_env.sh && bash tests/gpu/run_determinism.sh [repeats]
# Runs the benchmark model in Megatron's deterministic mode (same env as the functional recipes),
# each configuration `repeats` times in fresh processes, and reports per run whether its lm-loss
# sequence is bit-identical to the no-double-buffer reference (results.loss_agreement).
# An A/A split inside no_db means the model itself is not reproducible across processes; a split
# only in fixedpool/maxpool points at the double-buffer path (next step: TORCH_CUDA_SANITIZER=1).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
export NCCL_ALGO=Ring CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONHASHSEED=0
# Same Triton (Mamba) kernel configs in every process: hfsdp/determinism.py.
export HFSDP_TRITON_PIN_AUTOTUNE=1
out=${OUT:-/tmp/hfsdp_determinism}; mkdir -p "$out"
python scripts/benchmark_double_buffer.py --configs "${CONFIGS:-no_db,fixedpool,maxpool}" --repeats "${1:-3}" \
  --warmup-steps 0 --timed-steps 20 --no-plan --no-chart --run-timeout "${RUN_TIMEOUT:-150}" \
  --out-json "$out/determinism.json" -- --deterministic-mode 2>&1 | tee "$out/determinism.log"
