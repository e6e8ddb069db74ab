# GPU test set-up, sourced from the repo root on a GPU machine (no network needed):
#   . tests/gpu/setup_gpu_env.sh
# The machine brings Python >= 3.12 with a CUDA build of torch. This script:
#   1. sets and asserts the NVLink-multicast guards our GPU test scripts run under
#      (NVLS stays off on shared test machines; the product's launchers never force it);
#   2. installs the wheels found under $HFSDP_GPU_WHEELS (default .gpu-wheels/, git-ignored;
#      sub-folders too: e.g. mamba_ssm, te/, conv1d/, apex/ from build_apex_wheel.sh) into $HFSDP_GPU_SITE
#      (default /tmp/hfsdp-site) without touching the network or the system's packages;
#   3. stands in for mamba_ssm's selective-scan CUDA extension when it is missing (mamba_ssm
#      imports it eagerly; the Mamba2 Triton path used here never calls it);
#   4. puts the checkout (with its materialized megatron/) first on PYTHONPATH and prints versions.
# Prepare on a connected machine: `pip install -e .` (materializes megatron/), then copy the wheels
# the run needs into .gpu-wheels/ and carry megatron/ and .gpu-wheels/ to the GPU machine.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
_hfsdp_site=${HFSDP_GPU_SITE:-/tmp/hfsdp-site}
_hfsdp_wheels=${HFSDP_GPU_WHEELS:-.gpu-wheels}
mkdir -p "$_hfsdp_site"
if [ -d "$_hfsdp_wheels" ]; then
  mapfile -t _hfsdp_whls < <(find "$_hfsdp_wheels" -name '*.whl' | sort)
  if [ ${#_hfsdp_whls[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$_hfsdp_site" "${_hfsdp_whls[@]}" || { echo "setup_gpu_env: wheel install failed" >&2; return 1; }
  fi
fi
export PYTHONPATH="$PWD:$_hfsdp_site${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$_hfsdp_site/mamba_ssm" ] && ! python3 -c 'import selective_scan_cuda' >/dev/null 2>&1; then
  echo "# stand-in for mamba_ssm's CUDA-only selective scan (the Mamba2 Triton path never calls it)" \
    > "$_hfsdp_site/selective_scan_cuda.py"
fi
python -m hfsdp.nvls_guard || return 1  # our GPU tests keep NVLink multicast off
python - <<'PY' || return 1
import sys
import torch
print(f"setup_gpu_env: torch {torch.__version__}, {torch.cuda.device_count()} GPU(s) "
      f"[{', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))}], "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, Python {sys.version.split()[0]}")
for mod in ("mamba_ssm", "transformer_engine", "causal_conv1d", "triton"):
    try:
        m = __import__(mod)
        print(f"setup_gpu_env: {mod} {getattr(m, '__version__', '?')}")
    except Exception as exc:  # optional packages: say which are absent and why
        print(f"setup_gpu_env: {mod} not available ({type(exc).__name__})")
from hfsdp.training.requirements import apex_report, megatron_paths  # Apex by its modules, not its name

print(f"setup_gpu_env: apex: {apex_report() or 'not installed'}")
print("setup_gpu_env: Megatron takes " + "; ".join(f"{k}: {v}" for k, v in megatron_paths().items()))
PY
export HFSDP_GPU_ENV_READY=1  # scripts that source this file skip it when already done
