#!/usr/bin/env bash
# Run (or record) the GPU functional cases, from the repo root (each case says its GPU count, NPROC):
#   . tests/gpu/setup_gpu_env.sh && bash tests/gpu/run_functional.sh [--record|--record-missing] [case ...]
# Default cases: every GPU case under tests/functional_tests/test_cases (not smoke/).
# --record writes every case's golden; --record-missing only those of cases that have none for this
# GPU kind (the others are compared). Either way a golden comes only from a run that passed.
# Everything lands in $OUT/functional.tgz (logs, metrics, goldens) plus $OUT/functional_summary.txt.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.safety || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
mode=(); missing_only=0
case "${1:-}" in
  --record) mode=(--record); shift ;;
  --record-missing) missing_only=1; shift ;;
esac
cases=("$@")
if [ ${#cases[@]} -eq 0 ]; then
  mapfile -t cases < <(cd tests/functional_tests/test_cases && ls -d */*/ | sed 's#/$##' | grep -v '^smoke/')
fi
# Goldens are per GPU kind: golden_values_dev_<platform>.json (PLATFORM=dgx_h200 to force one).
platform=${PLATFORM:-$(python3 -c 'import torch; n = torch.cuda.get_device_name(); print(next((f"dgx_{k.lower()}" for k in ("H100", "H200", "B200", "A100") if k in n), "dgx_" + n.split()[-1].lower()))')}
work=${HFSDP_FUNCTIONAL_OUT:-/tmp/hfsdp_functional}
export HFSDP_FUNCTIONAL_OUT=$work
mkdir -p "$work"
# $OUT may name a subfolder that does not exist yet (a lost run taught us: mkdir it).
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
summary="${OUT:-$work}/functional_summary.txt"
: > "$summary"
t0=$(date +%s)
for c in "${cases[@]}"; do
  start=$(date +%s)
  if [ $(( start - t0 + ${CASE_TIMEOUT:-170} )) -gt "${BUDGET_S:-100000}" ]; then
    echo "skipped (BUDGET_S=${BUDGET_S} reached) [$c]" | tee -a "$summary"; continue
  fi
  case_mode=("${mode[@]}")
  [ "$missing_only" = 1 ] && [ ! -f "tests/functional_tests/test_cases/$c/golden_values_dev_$platform.json" ] \
    && case_mode=(--record)
  python -m hfsdp.functional.run_case "tests/functional_tests/test_cases/$c" "${case_mode[@]}" --timeout-s "${CASE_TIMEOUT:-170}" \
    --platform "$platform" \
    > "$work/$(echo "$c" | tr / _).log" 2>&1
  rc=$?
  line=$(grep -h "HFSDP-FUNCTIONAL RESULT" "$work/$(echo "$c" | tr / _).log" | tail -1)
  echo "rc=$rc $(( $(date +%s) - start ))s ${line:-no result line} [$c]${case_mode[*]:+ (--record)}" | tee -a "$summary"
done
mkdir -p "$work/goldens"
for f in tests/functional_tests/test_cases/*/*/golden_values_*.json; do
  [ -f "$f" ] && { mkdir -p "$work/goldens/$(dirname "$f")"; cp "$f" "$work/goldens/$f"; }
done
# Checkpoints stay behind: one resume case writes ~250 MiB, over $OUT's 16 MiB per-file limit.
[ -n "${OUT:-}" ] && tar czf "$OUT/functional.tgz" --exclude='./*/*/checkpoints' -C "$work" .
grep -q "FAIL\|no result\|skipped" "$summary" && exit 1
exit 0
