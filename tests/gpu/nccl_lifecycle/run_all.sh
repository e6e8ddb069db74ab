#!/usr/bin/env bash
# NCCL-lifecycle GPU experiments on 2 x H200 (about 5 min worst case, ~2 min typical).
# Usage from the repo root:  . .devtools/bootstrap.sh && bash tests/gpu/nccl_lifecycle/run_all.sh
# Results: $OUT/{warmup_memory,teardown_exit_time,full_iter_cuda_graph_mfsdp}.json
set -u
: "${OUT:=/tmp/nccl_lifecycle_out}"; export OUT
for v in NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; do
  [ "$(printenv "${v%%=*}")" = "${v#*=}" ] || { echo "refusing: $v not set"; exit 2; }
done
dir=$(dirname "$0")
rc=0
for s in warmup_memory teardown_exit_time full_iter_cuda_graph_mfsdp; do
  timeout 180 python "$dir/$s.py" || { echo "$s: exit $?"; rc=1; }
done
exit $rc
