#!/usr/bin/env bash
# The main job (README): train the reference hybrid model (M*E x4, hidden 1024, 16 experts, bf16)
# on Megatron-FSDP with --megatron-fsdp-max-pool-double-buffer and full-iteration CUDA graphs
# (mock data), on all local GPUs, then a short eager comparison (hfsdp/main_job/).
# On a machine without CUDA GPUs it does everything that needs none (verifies the fork, plans the
# double-buffer memory of the same model, runs the CPU smoke of the data/entry path) and says so.
# The console shows a short report; every run's whole output goes to log files in a new folder
# under out/main_job/ (HFSDP_MAIN_JOB_OUT=DIR puts it elsewhere), whose name the job prints.
#   TRAIN_ITERS=N (default 30)   EAGER_ITERS=N (default 10)   NPROC=N (default: all GPUs)
#   HFSDP_SETUP_DONE=1 with HFSDP_PY=/path/to/python: skip the set-up (scripts/setup_env.sh) and
#   use that interpreter, whose environment is already set up
#   extra args are passed to pretrain
set -eo pipefail
cd "$(dirname "$0")/.."
case "${HFSDP_SETUP_DONE:-0}" in
  1)
    if [ -z "${HFSDP_PY:-}" ]; then
      echo "run_main: error: HFSDP_SETUP_DONE=1 skips the set-up, but HFSDP_PY names no interpreter to use" >&2
      echo "  -> set HFSDP_PY to the interpreter of your set-up environment (e.g. .venv/bin/python), or unset" \
        "HFSDP_SETUP_DONE to let scripts/setup_env.sh make one" >&2
      exit 2
    fi
    if ! "$HFSDP_PY" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      echo "run_main: error: HFSDP_PY=$HFSDP_PY is not a Python >= 3.12 that runs here" >&2
      echo "  -> set HFSDP_PY to the interpreter of your set-up environment (e.g. .venv/bin/python), or unset" \
        "HFSDP_SETUP_DONE to let scripts/setup_env.sh make one" >&2
      exit 2
    fi
    echo "run_main: HFSDP_SETUP_DONE=1: using $HFSDP_PY as it is (no set-up)"
    ;;
  0) HFSDP_WITH_MAMBA=${HFSDP_WITH_MAMBA:-1} . scripts/setup_env.sh ;;
  *)
    echo "run_main: error: HFSDP_SETUP_DONE must be 0 or 1, got '$HFSDP_SETUP_DONE'" >&2
    echo "  -> set HFSDP_SETUP_DONE=1 with HFSDP_PY=/path/to/python to skip the set-up, or unset it" >&2
    exit 2
    ;;
esac

echo "== run_main: the fork =="
"$HFSDP_PY" -c 'import sys; from hfsdp.main_job import print_fork; sys.exit(print_fork())'
ngpu=$("$HFSDP_PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)

if [ "${ngpu:-0}" -ge 1 ]; then
  # Max-pool double buffer + full-iteration CUDA graphs when the model can be captured (else eager,
  # saying why), then a short eager run for comparison: hfsdp/main_job/gpu.py. Your environment is
  # passed through, with two defaults where you set nothing (TRITON_CACHE_AUTOTUNING=1 and, on one
  # GPU, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; hfsdp/main_job/runs.py run_env). On shared
  # machines where NVLink multicast must stay off, export NCCL_NVLS_ENABLE=0 yourself.
  exec "$HFSDP_PY" -m hfsdp.main_job "$@"
fi

# The planner, the CUDA-graph capture check (with your extra args) and the CPU smoke, each summed
# up here, their whole output in the log file the job names (hfsdp/main_job/cpu.py cpu_main).
exec "$HFSDP_PY" -c 'import sys; from hfsdp.main_job import cpu_main; sys.exit(cpu_main(sys.argv[1:]))' "$@"
