#!/usr/bin/env bash
# Build an NVIDIA Apex wheel for the GPU machines (sm_90: H100, H200) with only what megatron-core 0.18.2
# imports from Apex ([Note: NVIDIA Apex] in hfsdp/training/requirements.py):
#   amp_C                           multi-tensor kernels: Megatron's grad scaling and norms, and the step of
#                                   apex.optimizers.FusedAdam / FusedSGD (through apex.multi_tensor_apply)
#   fused_weight_gradient_mlp_cuda  --gradient-accumulation-fusion in the local (non-TE) linear layers
# and Apex's Python package. Apex's own setup.py builds them, with its documented switch for its CUDA
# extensions (APEX_CUDA_EXT=1, its compile flags unchanged) and parallel build (APEX_PARALLEL_BUILD,
# NVCC_APPEND_FLAGS), for TORCH_CUDA_ARCH_LIST=9.0; its other CUDA extensions are left out of the build.
#
#   bash tests/gpu/build_apex_wheel.sh [--src TARBALL|DIR] [--out DIR] [--jobs N] [--layer-norm] [--dry-run]
#
#   --src DIR|TARBALL  Apex at the pinned commit: a git checkout, or GitHub's archive of the commit (or
#                      `git archive` output: its header names the commit). Without --src, GitHub's archive is
#                      downloaded (network). Offline, fetch it on a connected machine first:
#                        curl -L -o apex.tar.gz https://codeload.github.com/NVIDIA/apex/tar.gz/<APEX_COMMIT>
#   --out DIR          where the wheel goes (default .gpu-wheels/apex/: tests/gpu/setup_gpu_env.sh installs it,
#                      like the Transformer Engine and causal-conv1d wheels)
#   --jobs N           extensions compiled at once (APEX_PARALLEL_BUILD, default 2); MAX_JOBS (ninja, default
#                      half the cores) and NVCC_APPEND_FLAGS (default --threads 2) are kept when set
#   --layer-norm       also fused_layer_norm_cuda: once `import apex` works, Megatron's local specs build Apex's
#                      FusedLayerNorm for LayerNorm (not RMSNorm) layers, whose first forward needs it
#   --dry-run          check the arguments and the source's commit, print the build's settings, build nothing
# Environment: APEX_COMMIT (40 hex digits, default the pin below); PYTHON (default python3): a Python with
# the CUDA build of torch the wheel is for, setuptools and packaging; nvcc of torch's CUDA version
# (CUDA_HOME or PATH), which Apex's setup.py checks.
# ninja on PATH makes the build parallel (torch's extension builder falls back to a serial one without it).
# Measured: 62 s, a 7.5 MB wheel (2026-11-28; 32 cores, nvcc 13.0, torch 2.11.0+cu130, Python 3.12.3,
# setuptools 84.2.1, ninja 1.13.2; --jobs 2, MAX_JOBS=16). The script prints both at the end.
set -euo pipefail
# NVIDIA/apex master, 2026-07-08 ("Remove deprecated apex module: gpu_direct_storage (#2017)").
APEX_PIN=6424da3b4faa6c8f062da4a48c424fff3f02d42d
APEX_COMMIT=${APEX_COMMIT:-$APEX_PIN}
EXTENSIONS="amp_C fused_weight_gradient_mlp_cuda"
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# Like every tests/gpu script: NVLink multicast off, checked (a build runs no GPU work; the rule has no exceptions).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
(cd "$_root" && "${PYTHON:-python3}" -m hfsdp.nvls_guard) || exit 2
_usage="bash tests/gpu/build_apex_wheel.sh [--src TARBALL|DIR] [--out DIR] [--jobs N] [--layer-norm] [--dry-run]"
_fail() {  # one sentence and the way out, exit 2
  echo "build_apex_wheel: $1" >&2
  echo "  -> $2" >&2
  exit 2
}

src="" out="$_root/.gpu-wheels/apex" jobs=2 dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --src|--out|--jobs)
      [ $# -ge 2 ] && [ -n "$2" ] || _fail "$1 needs a value" "$_usage"
      case "$1" in --src) src=$2 ;; --out) out=$2 ;; --jobs) jobs=$2 ;; esac
      shift 2 ;;
    --dry-run) dry=1; shift ;;
    --layer-norm) EXTENSIONS="$EXTENSIONS fused_layer_norm_cuda"; shift ;;
    -h|--help) sed -n '2,29p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) _fail "unknown argument '$1'" "$_usage" ;;
  esac
done
[[ "$APEX_COMMIT" =~ ^[0-9a-f]{40}$ ]] \
  || _fail "APEX_COMMIT must be a commit's 40 lower-case hex digits, got '$APEX_COMMIT'" \
           "unset it for the pin ($APEX_PIN), or give a whole commit id of NVIDIA/apex"
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || _fail "--jobs must be a positive whole number, got '$jobs'" "$_usage"
if [ -n "$src" ] && [ ! -e "$src" ]; then
  _fail "--src $src does not exist" "give Apex's source at $APEX_COMMIT: a checkout, or its archive (see --help)"
fi
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || _fail "PYTHON=$PY is not a command here" "set PYTHON to the Python the wheel is for"

_work=$(mktemp -d)
trap 'rm -rf "$_work"' EXIT
# The commit the source is at: a checkout's HEAD, or the commit id git archive writes into a tarball's header.
_commit_of() {
  if [ -d "$1" ]; then
    git -C "$1" rev-parse HEAD 2>/dev/null || echo "unknown (not a git checkout)"
  else
    "$PY" - "$1" <<'PY' || echo "unknown (not a tarball)"
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    print(tar.pax_headers.get("comment") or "unknown (no commit in its header)")
PY
  fi
}
if [ -z "$src" ]; then
  url="https://codeload.github.com/NVIDIA/apex/tar.gz/$APEX_COMMIT"
  if [ "$dry" = 1 ]; then
    src="$url (downloaded)"
  else
    echo "build_apex_wheel: downloading $url"
    curl -fsSL -o "$_work/apex.tar.gz" "$url" \
      || _fail "could not download $url" "fetch it on a connected machine and pass --src apex.tar.gz"
    src="$_work/apex.tar.gz"
  fi
fi
if [ -e "$src" ]; then
  got=$(_commit_of "$src")
  [ "$got" = "$APEX_COMMIT" ] \
    || _fail "--src $src is at $got, not at APEX_COMMIT $APEX_COMMIT" \
             "give Apex's source at $APEX_COMMIT (a checkout, or its archive: --help), or set APEX_COMMIT to its commit"
fi

export TORCH_CUDA_ARCH_LIST=9.0 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD=$jobs
export MAX_JOBS=${MAX_JOBS:-$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))}
export NVCC_APPEND_FLAGS=${NVCC_APPEND_FLAGS:---threads 2}
export HFSDP_APEX_EXTENSIONS=$EXTENSIONS
unset APEX_CPP_EXT APEX_ALL_CONTRIB_EXT  # apex_C and the contrib extensions: Megatron imports none of them
echo "build_apex_wheel: Apex $APEX_COMMIT from $src"
echo "build_apex_wheel: extensions $EXTENSIONS; TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST APEX_CUDA_EXT=1" \
  "APEX_PARALLEL_BUILD=$APEX_PARALLEL_BUILD MAX_JOBS=$MAX_JOBS NVCC_APPEND_FLAGS='$NVCC_APPEND_FLAGS'"
echo "build_apex_wheel: wheel into $out"
if [ "$dry" = 1 ]; then
  echo "build_apex_wheel: dry run, nothing built"
  exit 0
fi

"$PY" -c 'import torch, setuptools, packaging; assert torch.version.cuda' >/dev/null 2>&1 \
  || _fail "$PY lacks a CUDA build of torch, setuptools or packaging" \
           "run it with PYTHON set to the Python of the GPU machines (torch for CUDA, setuptools, packaging)"
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
  _fail "nvcc is not found (PATH, CUDA_HOME)" "install the CUDA toolkit of torch's CUDA version, or set CUDA_HOME"
fi
if [ -d "$src" ]; then
  cp -a "$src" "$_work/apex"
else
  mkdir "$_work/apex"
  tar -xzf "$src" -C "$_work/apex" --strip-components=1
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$(date +%s)
cd "$_work/apex"
# Apex's setup.py, run unchanged but for its list of extensions: only those named above are built.
"$PY" - "$out" <<'PY'
import os
import runpy
import sys

import setuptools

keep = os.environ["HFSDP_APEX_EXTENSIONS"].split()
real_setup = setuptools.setup


def setup(**kwargs):
    built = [ext for ext in kwargs.get("ext_modules", []) if ext.name in keep]
    if missing := sorted(set(keep) - {ext.name for ext in built}):
        sys.exit(f"build_apex_wheel: Apex's setup.py defines no extension {', '.join(missing)} at this commit\n"
                 "  -> pin a commit that has them (APEX_COMMIT), or check its extension list")
    return real_setup(**{**kwargs, "ext_modules": built})


setuptools.setup = setup
sys.argv = ["setup.py", "bdist_wheel", "--dist-dir", sys.argv[1]]
runpy.run_path("setup.py", run_name="__main__")
PY
whl=$(ls -t "$out"/apex-*.whl | head -1)
"$PY" - "$whl" "$EXTENSIONS" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
missing = [e for e in sys.argv[2].split() if not any(n.startswith(e) and n.endswith(".so") for n in names)]
missing += [m for m in ("apex/optimizers/fused_adam.py", "apex/multi_tensor_apply/__init__.py") if m not in names]
if missing:
    sys.exit(f"build_apex_wheel: {sys.argv[1]} lacks {', '.join(missing)}\n  -> see the build's log above")
PY
echo "build_apex_wheel: built $whl ($(du -h "$whl" | cut -f1), $(( $(date +%s) - start )) s)"
