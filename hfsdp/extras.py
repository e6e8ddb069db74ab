"""The optional install extras (``pip install -e '.[te]'``, ``.[te-cu12]``, ``.[ssm]``): one source
for setup.py, the run-time "install ..." errors and their tests.

[Note: optional extras] Transformer Engine (TE), mamba-ssm and causal-conv1d are optional: the
fork trains hybrid models with local specs and mamba_ssm's Triton kernels without any of them.
Each extra pins the versions the project's GPU runs use:

* ``te`` -> ``transformer-engine[pytorch,core-cu13]==2.20.2``, as upstream's own ``te`` extra
  (``core_cu13``), for a torch built for CUDA 13 (``+cu130``); ``te-cu12`` is the same for a
  CUDA 12 torch. The core wheel (``transformer-engine-cu12`` / ``-cu13``) is a binary wheel. The
  torch extension (``transformer-engine-torch``) is an sdist: it first tries a prebuilt wheel
  for this torch from TE's GitHub release, else compiles against the torch it finds at build
  time, so pip must not build it in an isolated environment (``--no-build-isolation``); it then
  needs a C++ compiler, CUDA headers of torch's CUDA major (a toolkit found through
  ``CUDA_HOME`` or ``nvcc``), cuDNN headers (``cudnn.h``) and the torch that will run it. Its
  metadata requires the core wheel of torch's CUDA major, so the wrong ``te-cuNN`` extra shows
  up as two core wheels (:func:`hfsdp.training.requirements.te_variant_problem` says so).
* ``ssm`` -> ``mamba-ssm==2.3.2.post1`` and ``causal-conv1d==1.7.0``. Both are sdists that
  build CUDA extensions against the installed torch (``--no-build-isolation``, nvcc, a C++
  compiler); each first tries a matching prebuilt wheel from its GitHub release. causal-conv1d
  is what Mamba's fused path (``use_mamba_mem_eff_path``, Megatron's default) calls; without it
  pass ``--disable-mamba-mem-eff-path``.

Standard library only: setup.py imports this inside pip's build environment.
"""

from __future__ import annotations

TE_VERSION = "2.20.2"
MAMBA_SSM_VERSION = "2.3.2.post1"
CAUSAL_CONV1D_VERSION = "1.7.0"

EXTRAS: dict[str, list[str]] = {
    "te": [f"transformer-engine[pytorch,core-cu13]=={TE_VERSION}"],
    "te-cu12": [f"transformer-engine[pytorch,core-cu12]=={TE_VERSION}"],
    "ssm": [f"mamba-ssm=={MAMBA_SSM_VERSION}", f"causal-conv1d=={CAUSAL_CONV1D_VERSION}"],
}

# The import name each optional package is checked by, and the extra that installs it
# (Transformer Engine's depends on torch's CUDA major: te_extra).
PACKAGE_EXTRA: dict[str, str] = {
    "transformer_engine": "te",
    "mamba_ssm": "ssm",
    "causal_conv1d": "ssm",
}

DOC = "docs/transformer-engine.md"


def te_extra(torch_cuda: str | None) -> str:
    """The TE extra for a torch built for CUDA ``torch_cuda`` ("12.8" -> ``te-cu12``; else ``te``)."""
    return "te-cu12" if (torch_cuda or "").split(".")[0] == "12" else "te"


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` into the environment of this checkout."""
    assert extra in EXTRAS, f"unknown extra {extra!r}; known: {sorted(EXTRAS)}"
    return f"`pip install --no-build-isolation -e '.[{extra}]'` ({', '.join(EXTRAS[extra])}; {DOC})"
