#!/usr/bin/env bash
# The test command (README; .ci/run calls it): set up the environment from scratch if needed,
# then check the patch series, lint (ruff), type-check hfsdp/ and the overlay (mypy) and run the
# CPU unit tests.
# GPU tests skip here; run them with tests/gpu/*.sh on GPU machines.
# mamba_ssm is required (setup_env fails without it) unless HFSDP_WITH_MAMBA=0 opts out; pytest
# sees the choice: without the opt-out a Mamba test fails where mamba_ssm does not import.
set -eo pipefail
cd "$(dirname "$0")/.."
export HFSDP_WITH_MAMBA=${HFSDP_WITH_MAMBA:-1}
. scripts/setup_env.sh
echo "run_tests: patch series"
scripts/patchset lint --chains  # rewrite chains too: each patch is a final-state slice
scripts/patchset check
scripts/patchset status
echo "run_tests: ruff (rules in pyproject.toml)"
"$HFSDP_PY" -m ruff check .
echo "run_tests: mypy hfsdp + the overlay"
# The overlay is checked as the materialized megatron/ modules it becomes: their import names, and
# the code the tests below import (`patchset status` above says whether it matches patches/overlay/).
# shellcheck disable=SC2046  # one path a line, none with spaces (patchset lint)
"$HFSDP_PY" -m mypy hfsdp $(scripts/patchset overlay)
# As root, the tests marked `unprivileged` (a read-only folder root could write anyway) skip, and
# run again afterwards as root without its capabilities (setpriv; the venv may sit in root's home).
unprivileged=0
if [ "$(id -u)" = 0 ] && setpriv --bounding-set -all --inh-caps -all --ambient-caps -all -- true 2>/dev/null; then
  unprivileged=1
  export HFSDP_UNPRIVILEGED_PASS=1
fi
echo "run_tests: pytest tests/unit_tests"
set +e
"$HFSDP_PY" -m pytest tests/unit_tests -p no:cacheprovider "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "run_tests: pytest collected no tests" >&2; exit 1; }
if [ "$unprivileged" = 1 ]; then
  echo "run_tests: pytest -m unprivileged, without root's capabilities"
  set +e
  HFSDP_UNPRIVILEGED_PASS=0 setpriv --bounding-set -all --inh-caps -all --ambient-caps -all -- \
    "$HFSDP_PY" -m pytest tests/unit_tests -m unprivileged -p no:cacheprovider "$@"
  urc=$?
  set -e
  [ "$urc" -eq 5 ] && { echo "run_tests: the unprivileged pass collected no tests" >&2; urc=1; }
  [ "$rc" -eq 0 ] && rc=$urc
fi
exit "$rc"
