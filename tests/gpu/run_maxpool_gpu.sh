#!/usr/bin/env bash
# GPU suite: max-pool double buffering on a TE-free hybrid (Mamba/attention/MoE) model.
# Run from the repo root with the patched tree materialized; NPROC ranks (default 2; 4 is run too),
# one GPU each, or sharing the GPUs there are:
#     . tests/gpu/setup_gpu_env.sh && bash tests/gpu/run_maxpool_gpu.sh
# Writes $OUT/maxpool_gpu.log (full torchrun output) and $OUT/maxpool_gpu.json (losses, pool
# bytes, home misses, peak memory vs bound, gating spy, FixedPool outcome), plus
# $OUT/maxpool_fixedpool_outcome.json from test (g).
set -uo pipefail

# NVLink multicast stays off on shared test machines (README, "Shared machines").
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Deterministic kernels for the bitwise-parity test: cuBLAS workspace, mamba_ssm reductions.
export CUBLAS_WORKSPACE_CONFIG=:4096:8 MAMBA_DETERMINISTIC=1 PYTHONUNBUFFERED=1

OUT=${OUT:-/tmp/maxpool_gpu_out}
mkdir -p "$OUT"
export OUT MAXPOOL_GPU_RESULTS="$OUT/maxpool_gpu.json"
rm -f "$MAXPOOL_GPU_RESULTS" "$OUT/maxpool_fixedpool_outcome.json"

python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through

NPROC=${NPROC:-2}
TEST=tests/unit_tests/double_buffer/test_maxpool_hybrid_gpu.py
start=$(date +%s)
# NPROC ranks on this machine's GPUs: one each, or sharing them (RANKS_PER_GPU, default auto).
python -m hfsdp.launch --nproc "$NPROC" --ranks-per-gpu "${RANKS_PER_GPU:-auto}" -- \
  -m pytest -q -s -rA "$TEST" "$@" 2>&1 | tee "$OUT/maxpool_gpu.log"
rc=${PIPESTATUS[0]}
end=$(date +%s)

python3 - "$MAXPOOL_GPU_RESULTS" "$rc" "$((end - start))" <<'PY'
import json, os, sys
path, rc, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = json.load(open(path)) if os.path.exists(path) else {}
data["_run"] = {"pytest_returncode": rc, "wall_seconds": secs,
                "nvls": os.environ.get("NCCL_NVLS_ENABLE")}
json.dump(data, open(path, "w"), indent=2, sort_keys=True, default=str)
a, d = data.get("a_bitwise", {}), data.get("d_peak_memory", {})
print("summary:", json.dumps({
    "rc": rc, "seconds": secs,
    "bitwise_equal": a.get("equal"),
    "peak_MiB": round(d["peak_bytes"] / 2**20, 1) if d else None,
    "bound_MiB": round(d["bound_bytes"] / 2**20, 1) if d else None,
    "gating_offenders": data.get("e_prefetch_gating", {}).get("offenders"),
    "fixedpool_verdicts": {k: v.get("verdict") for k, v in data.items() if k.startswith("g_fixedpool_outcome")},
}))
sys.exit(0 if set(data) - {"_run"} else 3)  # only the GPU tests record results
PY
recorded=$?
# pytest exits 0 when every GPU test skipped (one rank, no mamba_ssm, no CUDA): that is no pass.
if [ "$rc" -eq 0 ] && [ "$recorded" -ne 0 ]; then
  echo "run_maxpool_gpu: no GPU test ran (each skipped; the reasons are in $OUT/maxpool_gpu.log)" >&2
  exit 1
fi
exit "$rc"
