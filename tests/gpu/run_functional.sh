#!/usr/bin/env bash
# Run (or record) the GPU functional cases, from the repo root:
#   . tests/gpu/setup_gpu_env.sh && bash tests/gpu/run_functional.sh [--record|--record-missing] [case ...]
# Default cases: every GPU case under tests/functional_tests/test_cases (not smoke/); each case says
# its rank count (NPROC). Through hfsdp.functional.batch (twins first, goldens chosen per case):
#   RANKS_PER_GPU=N  N ranks share each GPU (default 1): 2-GPU cases on one GPU, held to the real
#                    goldens' losses and num-zeros, or to their own <platform>_shared goldens
#   NPROC=N          ranks per case instead of each case's NPROC (then no golden is compared)
#   JOBS=N           cases at a time: with one rank per GPU each gets GPUs of its own (two 2-GPU
#                    cases side by side on a 4-GPU machine)   CASE_TIMEOUT=S (default 170) per run
#   BUDGET_S=S       end the batch after S seconds (SIGINT: running cases end, none start) and still
#                    pack what it wrote
#   PLATFORM=dgx_h100 to hold the cases to another GPU kind's goldens (default: this GPU's; a tree
#                    built from another base than the default adds _mcore<version>)
# --record writes every case's golden for this environment; --record-missing only those of cases that
# have none for it. Either way a golden comes only from a run that passed.
# Everything lands in $OUT/functional.tgz (logs, metrics, goldens) plus $OUT/functional_summary.txt.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python -m hfsdp.nvls_guard || exit 2  # our GPU tests keep NVLink multicast off; the product's launchers pass env through
mode=()
case "${1:-}" in
  --record|--record-missing) mode=("$1"); shift ;;
esac
cases=("$@")
if [ ${#cases[@]} -eq 0 ]; then
  mapfile -t cases < <(cd tests/functional_tests/test_cases && ls -d */*/ | sed 's#/$##' | grep -v '^smoke/')
fi
paths=(); for c in "${cases[@]}"; do paths+=("tests/functional_tests/test_cases/$c"); done
# Each case probes its run's environment and is held to the golden recorded in an equal one
# (golden_values_<label>_<platform>.json; [Note: choosing a golden] in hfsdp/functional/selection.py).
platform=(); [ -n "${PLATFORM:-}" ] && platform=(--platform "$PLATFORM")
work=${HFSDP_FUNCTIONAL_OUT:-/tmp/hfsdp_functional}
mkdir -p "$work"
# $OUT may name a subfolder that does not exist yet (a lost run taught us: mkdir it).
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
summary="${OUT:-$work}/functional_summary.txt"
budget=(); [ -n "${BUDGET_S:-}" ] && budget=(timeout -s INT "$BUDGET_S")
"${budget[@]}" python -m hfsdp.functional.batch "${paths[@]}" "${mode[@]}" "${platform[@]}" \
  --ranks-per-gpu "${RANKS_PER_GPU:-1}" --jobs "${JOBS:-1}" ${NPROC:+--nproc "$NPROC"} \
  --timeout-s "${CASE_TIMEOUT:-170}" --output-dir "$work" --summary "$summary"
rc=$?
mkdir -p "$work/goldens"
for f in tests/functional_tests/test_cases/*/*/golden_values_*.json; do
  [ -f "$f" ] && { mkdir -p "$work/goldens/$(dirname "$f")"; cp "$f" "$work/goldens/$f"; }
done
# Checkpoints stay behind: one resume case writes ~250 MiB, over $OUT's 16 MiB per-file limit.
[ -n "${OUT:-}" ] && tar czf "$OUT/functional.tgz" --exclude='./*/*/checkpoints' -C "$work" .
exit $rc
