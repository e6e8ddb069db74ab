#!/usr/bin/env bash
# NCCL-lifecycle GPU experiments on 2 x H200 (~7.5 min worst case: per-script limits below).
# Usage from the repo root:  . tests/gpu/setup_gpu_env.sh && bash tests/gpu/nccl_lifecycle/run_all.sh
# Results: $OUT/{warmup_memory,teardown_exit_time,full_iter_cuda_graph_mfsdp}.json
# CPU pre-flight (no GPU):  python tests/gpu/nccl_lifecycle/check_cpu.py
set -u
: "${OUT:=/tmp/nccl_lifecycle_out}"; export OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -m hfsdp.nvls_guard || exit 2  # NVLink multicast must be off before any GPU work
dir=$(dirname "$0")
rc=0
summary=()
# Outer limits cover each script's child timeouts (4 x 45 s, 2 x 60 s, 80 s + 60 s) plus parent overhead.
declare -A limit=([warmup_memory]=200 [teardown_exit_time]=140 [full_iter_cuda_graph_mfsdp]=170)
for s in warmup_memory teardown_exit_time full_iter_cuda_graph_mfsdp; do
  t0=$SECONDS
  timeout "${limit[$s]}" python "$dir/$s.py"; src=$?
  [ $src -eq 0 ] || rc=1
  summary+=("$(python - "$OUT/$s.json" "$s" "$src" "$((SECONDS - t0))" <<'PY'
import json, sys
path, name, src, secs = sys.argv[1:]
try:
    data = json.load(open(path))
except Exception as exc:
    print(f"{name}: exit={src} {secs}s no JSON ({type(exc).__name__})"); sys.exit()
jobs = [data["job"]] if "job" in data else [r["job"] for r in data.values() if isinstance(r, dict) and "job" in r]
ok = sum(1 for j in jobs if j.get("rc") == 0)
extra = ""
if name == "full_iter_cuda_graph_mfsdp":
    r0 = (data.get("ranks") or [None])[0] or {}
    extra = (f" capture_ok={r0.get('capture_ok')} replay_matches_eager={r0.get('replay_matches_eager')}"
             f" warnings={len(r0.get('warnings', []))} phase={r0.get('failed_phase')}")
elif name == "teardown_exit_time":
    extra = " " + " ".join(f"{k}:exit_s={v.get('exit_after_training_s')}" for k, v in data.items())
elif name == "warmup_memory":
    extra = " " + " ".join(f"{k}:step_ok={((v.get('ranks') or [None])[0] or {}).get('step_ok')}" for k, v in data.items())
print(f"{name}: exit={src} {secs}s jobs_rc0={ok}/{len(jobs)}{extra}")
PY
)")
done
echo "== summary =="
printf '%s\n' "${summary[@]}"
exit $rc
