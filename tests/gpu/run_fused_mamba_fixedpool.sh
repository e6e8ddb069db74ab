#!/usr/bin/env bash
# Upstream's illegal-memory-access scenario on Mamba's fused path, 0.18.2's allocator vs the fork's,
# from the repo root, with 2 ranks (at data-parallel size 1 Megatron-FSDP never gathers, so the scenario
# cannot occur) on 2 GPUs or sharing 1, with causal-conv1d (.gpu-wheels/conv1d/) and, for the TE-spec and unpatched-0.18.2
# variants, Transformer Engine (.gpu-wheels/te/):
#   bash tests/gpu/run_fused_mamba_fixedpool.sh   (sources tests/gpu/setup_gpu_env.sh unless done)
# The unpatched 0.18.2 tree is extracted from the pinned sdist (patches/base.toml), found as
# scripts/patchset finds it; copy megatron_core-0.18.2.tar.gz into .gpu-wheels/ to carry it
# (MEGATRON_PATCHSET_FIND_LINKS defaults to .gpu-wheels here; nothing is downloaded).
# Writes $OUT/fused_mamba_fixedpool.log (pytest output), $OUT/fused_mamba_<spec>_<variant>.json (one outcome per variant)
# and $OUT/fused_mamba_fixedpool.json (all of them). See the docstring of
# tests/unit_tests/double_buffer/test_fused_mamba_fixedpool_gpu.py for what is asserted.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
[ -n "${HFSDP_GPU_ENV_READY:-}" ] || . tests/gpu/setup_gpu_env.sh \
  || { echo "run_fused_mamba_fixedpool: tests/gpu/setup_gpu_env.sh failed" >&2; exit 2; }
export MEGATRON_PATCHSET_FIND_LINKS=${MEGATRON_PATCHSET_FIND_LINKS:-$PWD/.gpu-wheels}
OUT=${OUT:-/tmp/hfsdp_fused_mamba_fixedpool}
mkdir -p "$OUT"
export OUT MAXPOOL_GPU_RESULTS="$OUT/fused_mamba_fixedpool.json"
rm -f "$MAXPOOL_GPU_RESULTS" "$OUT"/fused_mamba_*.json
start=$(date +%s)
# 2 ranks (data-parallel size 2: with 1 Megatron-FSDP never gathers): on 2 GPUs, or sharing 1.
python -m hfsdp.launch --nproc 2 --ranks-per-gpu "${RANKS_PER_GPU:-auto}" -- -m pytest -q -s -rA \
  tests/unit_tests/double_buffer/test_fused_mamba_fixedpool_gpu.py "$@" 2>&1 | tee "$OUT/fused_mamba_fixedpool.log"
rc=${PIPESTATUS[0]}
python - "$OUT" "$rc" "$(( $(date +%s) - start ))" <<'PY'
import glob, json, os, sys
out, rc, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
verdicts = {}
for path in sorted(glob.glob(os.path.join(out, "fused_mamba_*_*.json"))):
    rec = json.load(open(path))
    verdicts[rec["variant"]] = {"verdict": rec["verdict"], "rc": rec["returncode"], "crash": rec["crash_lines"][-3:]}
print("summary:", json.dumps({"rc": rc, "seconds": secs, "variants": verdicts}, indent=1))
PY
exit "$rc"
