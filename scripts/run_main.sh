#!/usr/bin/env bash
# The main job (README): train the reference hybrid model (M*E x4, hidden 1024, 16 experts, bf16)
# on Megatron-FSDP with --megatron-fsdp-max-pool-double-buffer and full-iteration CUDA graphs
# (mock data), on all local GPUs, then a short eager comparison (hfsdp/main_job.py).
# On a machine without CUDA GPUs it does everything that needs none (verifies the fork, plans the
# double-buffer memory of the same model, runs the CPU smoke of the data/entry path) and says so.
#   TRAIN_ITERS=N (default 30)   EAGER_ITERS=N (default 10)   NPROC=N (default: all GPUs)
#   extra args are passed to pretrain
set -eo pipefail
cd "$(dirname "$0")/.."
HFSDP_WITH_MAMBA=${HFSDP_WITH_MAMBA:-1} . scripts/setup_env.sh

echo "== run_main: the fork =="
scripts/patchset status
ngpu=$("$HFSDP_PY" -c 'import torch; print(torch.cuda.device_count())')

if [ "${ngpu:-0}" -ge 1 ]; then
  # Max-pool double buffer + full-iteration CUDA graphs when the model can be captured (else eager,
  # saying why), then a short eager run for comparison: hfsdp/main_job.py. Your environment is
  # passed through, with two defaults where you set nothing (TRITON_CACHE_AUTOTUNING=1 and, on one
  # GPU, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; hfsdp/main_job.py run_env). On shared
  # machines where NVLink multicast must stay off, export NCCL_NVLS_ENABLE=0 yourself.
  exec "$HFSDP_PY" -m hfsdp.main_job "$@"
fi

cat <<'MSG'
== run_main: no CUDA GPU on this machine ==
Training with Megatron-FSDP needs NVIDIA GPUs (NCCL all-gather/reduce-scatter, CUDA kernels).
Running what needs no GPU instead:
  1. the memory planner on the same model (FSDP units, double-buffer plan, what 0.18.2 would do),
  2. the CUDA-graph capture check of the model the GPU run would graph,
  3. the CPU smoke: our entry/data path and a 2-rank gloo loop under torchrun.
On a GPU machine this same command trains the model; see README "Set-up: two commands".
MSG
echo "== run_main: memory planner (DP=2) =="
# shellcheck disable=SC2086
"$HFSDP_PY" scripts/fsdp_memory_planner.py --plan-dp-size 2 2> >(grep -v -i -E "warn|^\s*$" >&2)
echo "== run_main: CUDA-graph capture check (Megatron's arguments, no GPU) =="
"$HFSDP_PY" -c 'import sys; from hfsdp.main_job import print_capture_check; print_capture_check(sys.argv[1:])' "$@" 2>/dev/null
echo "== run_main: CPU smoke (2 ranks, gloo) =="
"$HFSDP_PY" -m hfsdp.functional.run_case tests/functional_tests/test_cases/smoke/cpu_gloo_smoke --nproc 2
echo "== run_main: done (no training: no GPU) =="
