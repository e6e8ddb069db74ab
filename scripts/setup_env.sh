#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the fork into it:
#   Python >= 3.12, torch, then `pip install -e '.[test]'` (which materializes megatron/).
# Source it (`. scripts/setup_env.sh`) or run it; afterwards "$HFSDP_PY" is the interpreter.
#   PYTHON=/path/to/python3.12   pick the interpreter (default: first Python >= 3.12 found)
#   VENV=/path/to/venv           where the venv lives (default: ./.venv)
#   HFSDP_TORCH_SPEC='torch==X'  torch to install when the venv has none (default below)
#   HFSDP_WITH_MAMBA=1           also install mamba_ssm's Triton-only build (as on the GPU machines),
#                                so Mamba layers can be constructed in CPU tests; HFSDP_MAMBA_WHEEL
#                                names a prebuilt wheel, else $HFSDP_WHEEL_DIR/mamba_ssm-*.whl (default
#                                folder: .gpu-wheels/, the GPU set-up's) or a local build.
#                                If mamba_ssm then does not import the way Megatron imports it, this
#                                fails (exit 2): the Mamba tests must run, not skip.
#   HFSDP_WITH_MAMBA=0           (default here; scripts/run_tests.sh defaults to 1) leave mamba_ssm
#                                alone; the tests that need it then skip, naming this opt-out
set -eo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Every knob is checked before anything is installed or made: one sentence (exit 2), nothing changed.
case "${HFSDP_WITH_MAMBA:-0}" in
  0|1) ;;
  *)
    echo "setup_env: HFSDP_WITH_MAMBA must be 0 or 1, got '$HFSDP_WITH_MAMBA'" >&2
    echo "  -> set HFSDP_WITH_MAMBA=1 (install mamba_ssm) or HFSDP_WITH_MAMBA=0 (leave it; the Mamba tests skip)" >&2
    exit 2
    ;;
esac

_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
_find_python() {
  local c
  # A PYTHON that is set is the only one tried: another one found instead would be a silent surprise.
  if [ -n "${PYTHON:-}" ]; then
    command -v "$PYTHON" >/dev/null 2>&1 && _ok "$(command -v "$PYTHON")" && { command -v "$PYTHON"; return 0; }
    return 1
  fi
  # 3.12 first: it is what the GPU machines run and what megatron-core 0.18.2 is tested on.
  for c in python3.12 python3.13 python3; do
    command -v "$c" >/dev/null 2>&1 && _ok "$(command -v "$c")" && { command -v "$c"; return 0; }
  done
  # pyenv installs that are not the active version (the CPU machines ship 3.12 this way); one a line, so
  # that a PYENV_ROOT with a space stays one path.
  while IFS= read -r c; do
    _ok "$c" && { echo "$c"; return 0; }
  done < <(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 2>/dev/null | sort -V -r
           ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[3-9]*/bin/python3 2>/dev/null | sort -V)
  return 1
}

_venv=${VENV:-$_root/.venv}
if [ ! -x "$_venv/bin/python" ] || ! _ok "$_venv/bin/python"; then
  # venv writes bin/, lib/ and pyvenv.cfg into the folder: only a new or empty one, or a venv, is ours to write.
  if [ -e "$_venv" ] || [ -L "$_venv" ]; then
    if [ ! -d "$_venv" ]; then
      echo "setup_env: VENV=$_venv is not a folder" >&2
      echo "  -> set VENV to a new folder (it is made), or unset it for .venv in the checkout" >&2
      exit 2
    fi
    if [ ! -f "$_venv/pyvenv.cfg" ] && [ -n "$(ls -A "$_venv" 2>/dev/null)" ]; then
      echo "setup_env: VENV=$_venv is a folder that is neither empty nor a virtual environment; making one there" \
        "would write into it" >&2
      echo "  -> set VENV to a new or empty folder, or unset it for .venv in the checkout" >&2
      exit 2
    fi
  fi
  _py=$(_find_python) || {
    if [ -n "${PYTHON:-}" ]; then
      echo "setup_env: PYTHON=$PYTHON is not a Python >= 3.12 that runs here (megatron-core 0.18.2 requires it)" >&2
      echo "  -> set PYTHON to one (e.g. /usr/bin/python3.12), or unset it to take the first one found" >&2
    else
      echo "setup_env: no Python >= 3.12 found (megatron-core 0.18.2 requires it)." >&2
      echo "  -> install one (e.g. pyenv install 3.12) or set PYTHON=/path/to/python3.12" >&2
    fi
    exit 2
  }
  echo "setup_env: creating $_venv with $_py ($("$_py" --version 2>&1))"
  "$_py" -m venv "$_venv"
fi
HFSDP_PY="$_venv/bin/python"
export HFSDP_PY
if ! "$HFSDP_PY" -c 'import torch' >/dev/null 2>&1; then
  echo "setup_env: installing ${HFSDP_TORCH_SPEC:=torch==2.13.0} (a CUDA build; it runs on CPU too)"
  "$HFSDP_PY" -m pip install -q --disable-pip-version-check "$HFSDP_TORCH_SPEC"
fi
echo "setup_env: pip install -e '.[test]'"
"$HFSDP_PY" -m pip install -q --disable-pip-version-check -e "$_root[test]"
# Exit status 0 when mamba_ssm imports the way Megatron's Mamba mixer imports it; else 1, and why
# on stderr (hfsdp/training/requirements.py).
_mamba_problem() {
  (cd "$_root" && "$HFSDP_PY" -c 'import sys; from hfsdp.training.requirements import import_problem
sys.exit(import_problem("mamba_ssm"))')
}
# Build (or take) mamba_ssm's Triton-only wheel and install it; status 1 at the first step that fails.
_install_mamba() {
  local whl wdir site
  # A prebuilt wheel in $HFSDP_WHEEL_DIR (default .gpu-wheels/, the GPU set-up's folder) is used; without one (the usual
  # case) the build below makes it.
  whl=${HFSDP_MAMBA_WHEEL:-$(ls "${HFSDP_WHEEL_DIR:-$_root/.gpu-wheels}"/mamba_ssm-*.whl 2>/dev/null | head -1 || true)}
  _pip huggingface_hub transformers setuptools wheel ninja packaging || return 1
  if [ -z "$whl" ]; then
    wdir=$(mktemp -d)
    echo "setup_env: building mamba-ssm (Triton kernels only, no CUDA extensions)"
    MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE "$HFSDP_PY" -m pip wheel -q --no-deps \
      --no-build-isolation "mamba-ssm==2.3.2.post1" -w "$wdir" || return 1
    whl=$(ls "$wdir"/mamba_ssm-*.whl) || return 1
  fi
  echo "setup_env: installing $(basename "$whl")"
  _pip --no-deps "$whl" || return 1
  # mamba_ssm imports its selective-scan CUDA extension eagerly; the Mamba2 Triton path never
  # calls it (same stand-in as the GPU machines' bootstrap).
  site=$("$HFSDP_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  [ -f "$site/selective_scan_cuda.py" ] || echo "# stand-in: mamba_ssm's CUDA-only selective scan (unused by the Triton path)" > "$site/selective_scan_cuda.py"
}
_pip() { "$HFSDP_PY" -m pip install -q --disable-pip-version-check "$@"; }
case "${HFSDP_WITH_MAMBA:-0}" in  # 0 or 1 (checked at the top)
  0) ;;
  1)
    _mamba_problem 2>/dev/null || _install_mamba || echo "setup_env: installing mamba-ssm failed (above)" >&2
    if ! _why=$(_mamba_problem 2>&1); then
      echo "setup_env: HFSDP_WITH_MAMBA=1, and mamba_ssm does not import the way Megatron imports it: $_why" >&2
      echo "  -> fix what failed above, or give a built wheel with HFSDP_MAMBA_WHEEL=/path/to/mamba_ssm-*.whl;" >&2
      echo "     or opt out with HFSDP_WITH_MAMBA=0 (the Mamba tests then skip)" >&2
      exit 2
    fi
    ;;
esac
"$HFSDP_PY" - <<'PY'
import importlib.metadata as md
import torch
print(f"setup_env: megatron-core {md.version('megatron-core')}, torch {torch.__version__}, "
      f"CUDA GPUs: {torch.cuda.device_count()}")
PY
