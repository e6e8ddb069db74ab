#!/usr/bin/env bash
# The main job (README): train the reference hybrid model (M*E x4, hidden 1024, 16 experts, bf16)
# on Megatron-FSDP with --megatron-fsdp-max-pool-double-buffer and mock data, on all local GPUs.
# On a machine without CUDA GPUs it does everything that needs none (verifies the fork, plans the
# double-buffer memory of the same model, runs the CPU smoke of the data/entry path) and says so.
#   TRAIN_ITERS=N (default 30)   NPROC=N (default: all GPUs)   extra args are passed to pretrain
set -eo pipefail
cd "$(dirname "$0")/.."
HFSDP_WITH_MAMBA=${HFSDP_WITH_MAMBA:-1} . scripts/setup_env.sh
# NVLink multicast stays off unless you opt in (it must stay off on shared test machines).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

echo "== run_main: the fork =="
scripts/patchset status
model=$("$HFSDP_PY" -c 'from hfsdp.planner.setup import DEFAULT_MODEL_FLAGS as f; print(" ".join(f))')
ngpu=$("$HFSDP_PY" -c 'import torch; print(torch.cuda.device_count())')

if [ "${ngpu:-0}" -ge 1 ]; then
  nproc=${NPROC:-$ngpu}
  echo "== run_main: training on $nproc GPU(s) with the max-pool double buffer =="
  # shellcheck disable=SC2086
  exec "$HFSDP_PY" -m torch.distributed.run --nproc-per-node "$nproc" pretrain_hybrid.py $model \
    --fsdp-double-buffer --megatron-fsdp-max-pool-double-buffer \
    --global-batch-size $((2 * nproc * 2)) --train-iters "${TRAIN_ITERS:-30}" --lr 3e-4 --min-lr 3e-5 \
    --lr-decay-style cosine --lr-warmup-iters 3 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 \
    --split 99,1,0 --eval-iters 0 --eval-interval 1000000 --log-interval 1 --log-memory-interval 5 \
    --megatron-fsdp-main-params-dtype fp32 --megatron-fsdp-main-grads-dtype fp32 "$@"
fi

cat <<'MSG'
== run_main: no CUDA GPU on this machine ==
Training with Megatron-FSDP needs NVIDIA GPUs (NCCL all-gather/reduce-scatter, CUDA kernels).
Running what needs no GPU instead:
  1. the memory planner on the same model (FSDP units, double-buffer plan, what 0.18.2 would do),
  2. the CPU smoke: our entry/data path and a 2-rank gloo loop under torchrun.
On a GPU machine this same command trains the model; see README "Set-up: two commands".
MSG
echo "== run_main: memory planner (DP=2) =="
# shellcheck disable=SC2086
"$HFSDP_PY" scripts/fsdp_memory_planner.py --plan-dp-size 2 2> >(grep -v -i -E "warn|^\s*$" >&2)
echo "== run_main: CPU smoke (2 ranks, gloo) =="
"$HFSDP_PY" -m hfsdp.functional.run_case tests/functional_tests/test_cases/smoke/cpu_gloo_smoke --nproc 2
echo "== run_main: done (no training: no GPU) =="
