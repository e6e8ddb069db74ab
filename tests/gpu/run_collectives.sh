#!/usr/bin/env bash
# NCCL message-size sweep (hfsdp/bench/collectives.py) on every GPU of this machine, from the repo root:
#   . tests/gpu/setup_gpu_env.sh && bash tests/gpu/run_collectives.sh [extra sweep args]
# Eager, then graphed (the timing that matches a full-iteration graph step), each over plain, registered and
# symmetrically registered buffers: $OUT/collectives-{eager,graph}.{json,log}.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
out=${OUT:-/tmp/hfsdp_collectives}; mkdir -p "$out"
rc=0
for mode in eager graph; do
  flag=(); [ "$mode" = graph ] && flag=(--graph)
  python -m hfsdp.bench.collectives ${flag[@]+"${flag[@]}"} --out-json "$out/collectives-$mode.json" "$@" \
    2>&1 | tee "$out/collectives-$mode.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
exit "$rc"
