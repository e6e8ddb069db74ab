"""Optional packages a run's flags need, checked before any CUDA work.

[Note: optional packages] Transformer Engine (TE), mamba_ssm and causal_conv1d are optional
([Note: optional extras] in hfsdp/extras.py). Without them Megatron fails late and obscurely:
TE specs with an ImportError deep in model construction, rope fusion with a ValueError when the
config is built, and Mamba's fused path (``use_mamba_mem_eff_path``, Megatron's default) in the
first forward, where mamba_ssm calls causal_conv1d's kernel through a ``None`` ("'NoneType'
object is not callable"). The entry point calls :func:`check` on the flags as given (before
Megatron's ``validate_args``, which already touches CUDA for ``--moe-grouped-gemm``) and again
on the validated args: each missing package becomes a cause naming the flags that need it and a
way out naming the extra that installs it and the flag that avoids it.

What needs what (0.18.2):

* ``transformer_engine`` (and its torch extension ``transformer_engine_torch``):
  ``--transformer-impl transformer_engine`` (Megatron's default, and with it
  ``--moe-grouped-gemm``: TE's grouped linear); ``--cuda-graph-impl transformer_engine``;
  ``--fp8-format`` / ``--fp4-format``; ``--tp-comm-overlap``; ``--moe-permute-fusion`` and
  ``--moe-router-fusion`` (TE's fused MoE kernels); rope fusion, which is on by default with
  ``--position-embedding-type rope`` (TE's fused rotary kernel). Checked without importing TE
  (that loads CUDA libraries, and the entry point reports a CPU-only machine itself): the
  package with ``find_spec``, its torch extension where TE's own loader looks for it.
* ``mamba_ssm``: Mamba layers (``M`` in ``--hybrid-layer-pattern``). Checked by importing what
  Megatron's mamba_mixer imports (``mamba_ssm.ops.triton.ssd_combined`` and ``layernorm_gated``):
  a mamba_ssm built without its CUDA extension is present but not importable.
* ``causal_conv1d``: Mamba layers on the fused path (no ``--disable-mamba-mem-eff-path``).
  Checked by importing what mamba_mixer and mamba_ssm's fused kernel import (a wheel built for
  another torch or CUDA is present but not importable).
* ``fused_weight_gradient_mlp_cuda`` (NVIDIA Apex): ``--gradient-accumulation-fusion``, on by
  default. Every model has local linear layers (the output layer at least), and Megatron's refuse
  the flag without that module, when the model is built, after the process groups are up.

:func:`te_variant_problem` catches a TE core wheel for the wrong CUDA major (the extension built
against this torch requires the core of torch's CUDA major, so a second, mismatched core is the
sign of the wrong ``te`` / ``te-cu12`` extra).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hfsdp.extras import PACKAGE_EXTRA, install_hint, te_extra
from hfsdp.training.spec_error import SpecError

MAMBA_SYMBOL = "M"  # megatron.core.models.hybrid.hybrid_layer_allocation.Symbols.MAMBA
TE_CORE_DISTS = {12: "transformer-engine-cu12", 13: "transformer-engine-cu13"}
# What each package must import as, the way Megatron (and mamba_ssm's fused kernel) import it.
IMPORTS = {
    "mamba_ssm": ("mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.layernorm_gated"),
    "causal_conv1d": ("causal_conv1d", "causal_conv1d.causal_conv1d_varlen",
                      "causal_conv1d.cpp_functions"),
    "fused_weight_gradient_mlp_cuda": ("fused_weight_gradient_mlp_cuda",),
}
TE_MODULES = ("transformer_engine", "transformer_engine_torch")  # the package and its torch extension
LABEL = {"transformer_engine": "Transformer Engine", "mamba_ssm": "mamba-ssm",
         "causal_conv1d": "causal-conv1d", "fused_weight_gradient_mlp_cuda": "NVIDIA Apex's wgrad kernel"}


class MissingPackage(SpecError):
    """Flags need an optional package that is not usable: ``cause`` and ``fix`` (a UserError's)."""

    cause: str
    fix: str

    def __init__(self, cause: str, fix: str) -> None:
        self.cause, self.fix = cause, fix
        super().__init__(f"{cause}; {fix}")


@dataclass(frozen=True)
class Need:
    """``package`` (import name) is needed by ``why`` (flags); ``avoid`` says how to do without."""

    package: str
    why: str
    avoid: str


def te_flags(args: Namespace) -> list[tuple[str, str]]:
    """(flag as the user would write it, how to do without it) for every flag needing TE."""
    flags: list[tuple[str, str]] = []
    if args.transformer_impl == "transformer_engine":
        flags.append(("--transformer-impl transformer_engine",
                      "pass --transformer-impl local (the local, non-TE layer specs)"))
        if args.moe_grouped_gemm and args.num_experts:
            flags.append(("--moe-grouped-gemm", "drop --moe-grouped-gemm"))
    if args.cuda_graph_impl == "transformer_engine":
        flags.append(("--cuda-graph-impl transformer_engine",
                      "pass --cuda-graph-impl full_iteration (or none)"))
    for dest, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format")):
        if getattr(args, dest, None):
            flags.append((f"{flag} {getattr(args, dest)}", f"drop {flag}"))
    for dest, flag in (("tp_comm_overlap", "--tp-comm-overlap"),
                       ("moe_permute_fusion", "--moe-permute-fusion"),
                       ("moe_router_fusion", "--moe-router-fusion")):
        if getattr(args, dest, False):
            flags.append((flag, f"drop {flag}"))
    if args.position_embedding_type == "rope" and args.apply_rope_fusion:
        flags.append(("--position-embedding-type rope (rope fusion is on unless --no-rope-fusion)",
                      "pass --no-rope-fusion"))
    return flags


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def needs(args: Namespace) -> list[Need]:
    """Every optional package ``args`` needs, in the order they are reported."""
    out = []
    if te := te_flags(args):
        out.append(Need("transformer_engine", _and([f for f, _ in te]), _and([a for _, a in te])))
    if MAMBA_SYMBOL in (args.hybrid_layer_pattern or ""):
        out.append(Need("mamba_ssm", "Mamba layers ('M' in --hybrid-layer-pattern)",
                        "use a --hybrid-layer-pattern without 'M'"))
        if args.use_mamba_mem_eff_path:
            out.append(Need("causal_conv1d",
                            "Mamba's fused path (use_mamba_mem_eff_path, on unless "
                            "--disable-mamba-mem-eff-path)",
                            "pass --disable-mamba-mem-eff-path (nn.Conv1d and mamba_ssm's Triton scan)"))
    if getattr(args, "gradient_accumulation_fusion", False):
        out.append(Need("fused_weight_gradient_mlp_cuda",
                        "--gradient-accumulation-fusion (Megatron's default: the local linear layers)",
                        "pass --no-gradient-accumulation-fusion"))
    return out


def importable(package: str) -> bool:
    """Whether ``package`` is usable the way Megatron uses it (see the module docstring)."""
    return import_problem(package) is None


def import_problem(package: str) -> str | None:
    """Why ``package`` is not usable the way Megatron uses it (the first import that fails), or None."""
    if package == "transformer_engine":
        try:
            found = _te_torch_extension_present()
        except (ImportError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if found else f"{' or its torch extension '.join(TE_MODULES)} not found"
    for module in IMPORTS[package]:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a build for another torch/CUDA/Triton fails in many ways, not only ImportError
            return f"import {module}: {type(exc).__name__}: {exc}"
    return None


def _te_torch_extension_present() -> bool:
    """TE and its torch extension, found where TE's own loader looks (``load_framework_extension``
    in ``transformer_engine/common``): a top-level ``transformer_engine_torch`` module, or its
    shared object inside the package or in its ``wheel_lib/`` folder, where TE 2.x wheels put it
    (there it is importable only once ``transformer_engine.pytorch`` has loaded it)."""
    te_pkg, ext = TE_MODULES
    spec = importlib.util.find_spec(te_pkg)
    if spec is None:
        return False
    if importlib.util.find_spec(ext) is not None:
        return True
    for location in spec.submodule_search_locations or ():
        package = Path(location)
        if any(any(folder.glob(f"{ext}*.so")) for folder in (package, package / "wheel_lib")):
            return True
    return False


def missing(args: Namespace, available: Callable[[str], bool] | None = None) -> list[Need]:
    """The needs of ``args`` whose package is not available (default: :func:`importable`)."""
    available = available or importable  # looked up per call, so a test can stand in for it
    return [n for n in needs(args) if not available(n.package)]


def torch_cuda_version() -> str | None:
    """The CUDA version torch was built for (None for a CPU build)."""
    import torch

    return torch.version.cuda


def missing_error(need: Need, torch_cuda: str | None = None) -> MissingPackage:
    """The cause and way out for one missing package."""
    verb = "need" if " and " in need.why else "needs"
    cause = f"{need.why} {verb} {LABEL[need.package]} ({need.package}), which is not importable here"
    if need.package not in PACKAGE_EXTRA and need.package != "transformer_engine":  # Apex: not on PyPI
        return MissingPackage(cause, f"{need.avoid}; or install NVIDIA Apex built with it ({APEX_WHEEL_SCRIPT} "
                                     "builds a wheel; PyPI's `apex` is another project)")
    extra = te_extra(torch_cuda) if need.package == "transformer_engine" else PACKAGE_EXTRA[need.package]
    return MissingPackage(cause, f"install the `{extra}` extra, {install_hint(extra)}; or {need.avoid}")


def te_variant_problem(torch_cuda: str | None,
                       installed: Callable[[str], str | None] | None = None) -> MissingPackage | None:
    """The error for a TE core wheel that does not match torch's CUDA major, or None."""
    installed = installed or _dist_version
    cores = {major: v for major, dist in TE_CORE_DISTS.items() if (v := installed(dist)) is not None}
    if not torch_cuda or not cores:
        return None  # a CPU torch, or TE built from source without a core wheel: nothing to compare
    major = int(torch_cuda.split(".")[0])
    wrong = sorted(m for m in cores if m != major)
    if not wrong:
        return None
    names = ", ".join(f"{TE_CORE_DISTS[m]} {cores[m]}" for m in wrong)
    return MissingPackage(
        f"{names} is installed, but torch is built for CUDA {torch_cuda}: Transformer Engine's core "
        "library must match torch's CUDA major",
        f"`pip uninstall -y {' '.join(TE_CORE_DISTS[m] for m in wrong)}`, then install the "
        f"`{te_extra(torch_cuda)}` extra, {install_hint(te_extra(torch_cuda))}",
    )


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# Installed optional packages change what a local-spec run executes, not only TE-spec runs: with
# TE (or Apex) importable Megatron's optimizer and multi-tensor kernels are theirs, not torch's.
RECORDED_DISTS = ("transformer-engine", "apex", "mamba-ssm", "causal-conv1d")

# [Note: NVIDIA Apex] Apex is not on PyPI: the ``apex`` distribution there is an unrelated web
# toolkit, and NVIDIA Apex's wheel is named ``apex`` too. So Apex is recognised by the modules
# Megatron 0.18.2 imports from it, never by the distribution's name: ``amp_C`` and
# ``apex.multi_tensor_apply`` (multi-tensor kernels), ``apex.optimizers`` (FusedAdam, FusedSGD) and
# ``fused_weight_gradient_mlp_cuda`` (gradient-accumulation fusion of the local linear layers).
# Megatron takes each from Transformer Engine first, then Apex, then torch (:func:`megatron_paths`).
APEX_MODULES = ("amp_C", "apex.multi_tensor_apply", "apex.optimizers", "fused_weight_gradient_mlp_cuda")
TE_OPTIMIZERS = "transformer_engine.pytorch.optimizers"  # TE's FusedAdam and multi-tensor kernels
APEX_WHEEL_SCRIPT = "tests/gpu/build_apex_wheel.sh"


def module_importable(module: str) -> bool:
    """Whether ``import module`` succeeds here (an extension built for another torch fails in many ways)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def apex_problem(importable_module: Callable[[str], bool] | None = None,
                 installed: Callable[[str], str | None] | None = None) -> str | None:
    """One sentence with the way out when a distribution named apex is installed but Megatron cannot
    use it as NVIDIA Apex (``amp_C`` not importable); None otherwise ([Note: NVIDIA Apex])."""
    importable_module = importable_module or module_importable
    version = (installed or _dist_version)("apex")
    if importable_module("amp_C"):
        return None
    if importable_module("apex.optimizers"):  # NVIDIA Apex's Python-only build
        name = f"NVIDIA Apex {version}" if version else "NVIDIA Apex"
        return (f"{name} is installed without its CUDA extensions (amp_C is not importable), yet Megatron "
                "takes its FusedAdam, which needs them -> install Apex's wheel built with them "
                f"({APEX_WHEEL_SCRIPT} builds one), or `pip uninstall apex`")
    if version is None:
        return None
    return (f"a distribution named apex ({version}) is installed but amp_C is not importable, so it is not "
            "NVIDIA Apex (PyPI's apex is an unrelated web toolkit) and Megatron does not use it -> "
            f"`pip uninstall apex`, then install NVIDIA Apex's wheel ({APEX_WHEEL_SCRIPT} builds one), "
            "or leave Apex out: Megatron then takes Transformer Engine's or torch's kernels")


def apex_report(importable_module: Callable[[str], bool] | None = None,
                installed: Callable[[str], str | None] | None = None) -> str | None:
    """NVIDIA Apex in one line: its version and the modules Megatron can import from it; else
    :func:`apex_problem`'s sentence; None with neither Apex nor a distribution named apex."""
    importable_module = importable_module or module_importable
    installed = installed or _dist_version
    if (problem := apex_problem(importable_module, installed)) is not None or not importable_module("amp_C"):
        return problem
    present = [m for m in APEX_MODULES if importable_module(m)]
    absent = [m for m in APEX_MODULES if m not in present]
    return (f"NVIDIA Apex {installed('apex') or '(no distribution metadata)'}: {', '.join(present)}"
            + (f"; not importable: {', '.join(absent)}" if absent else ""))


def megatron_paths(importable_module: Callable[[str], bool] | None = None) -> dict[str, str]:
    """Which optimizer, multi-tensor kernels, Mamba convolution and gradient-accumulation fusion
    megatron-core takes, given what imports here: Transformer Engine first, then NVIDIA Apex, then torch (read off
    ``megatron/core/optimizer/`` and ``tensor_parallel/layers.py`` of the pinned release)."""
    importable_module = importable_module or module_importable
    te = importable_module(TE_OPTIMIZERS)
    if te:
        optimizer = "Transformer Engine's FusedAdam/FusedSGD"
    elif importable_module("apex.optimizers"):
        optimizer = "Apex's FusedAdam/FusedSGD"
    else:
        optimizer = "torch's AdamW/SGD (Adam in the distributed optimizer)"
    if te:
        multi_tensor = "Transformer Engine's multi_tensor_applier"
    elif importable_module("amp_C") and importable_module("apex.multi_tensor_apply"):
        multi_tensor = "Apex's amp_C with apex.multi_tensor_apply"
    else:
        multi_tensor = "Megatron's torch fallbacks (local_multi_tensor_applier)"
    # Into Megatron-FSDP's main grads, TE's general_gemm writes when TE imports, else Apex's kernel
    # (tensor-parallel-fsdp-wgrad-fusion-apex.patch); the layers still refuse the flag without Apex's module.
    if not importable_module("fused_weight_gradient_mlp_cuda"):
        fusion = "none, so they refuse --gradient-accumulation-fusion (pass --no-gradient-accumulation-fusion)"
    elif te:
        fusion = "Apex's fused_weight_gradient_mlp_cuda (Megatron-FSDP's weights: Transformer Engine's general_gemm)"
    else:
        fusion = "Apex's fused_weight_gradient_mlp_cuda"
    # models/backends.py takes Megatron's FusedLayerNorm for local LayerNorm layers once `import apex` works.
    if not importable_module("apex"):
        norm = "torch's"
    elif not importable_module("apex.normalization.fused_layer_norm"):
        norm = "Megatron's FusedLayerNorm, which refuses to build (this apex has no apex.normalization)"
    elif not importable_module("fused_layer_norm_cuda"):
        norm = "Apex's FusedLayerNorm, whose kernel (fused_layer_norm_cuda) is not importable: the first forward fails"
    else:
        norm = "Apex's FusedLayerNorm"
    # mamba_mixer.py calls causal_conv1d_fn on the non-fused path too whenever causal_conv1d imports.
    if importable_module("causal_conv1d"):
        conv = "causal-conv1d's causal_conv1d_fn"
    else:
        conv = "torch's nn.Conv1d (the fused path needs causal-conv1d)"
    return {"optimizer": optimizer, "multi_tensor": multi_tensor, "mamba_conv": conv,
            "gradient_accumulation_fusion": f"local layers: {fusion}; Transformer Engine layers: their own",
            "layer_norm": f"local LayerNorm layers: {norm}; RMSNorm, Transformer Engine and the hybrid local specs' "
                          "layers: not Apex's"}


def installed_versions() -> dict[str, str | None]:
    """Version of each optional distribution in ``RECORDED_DISTS`` (None: not installed); Apex as
    :func:`apex_report` says it, since its distribution name alone does not tell NVIDIA Apex."""
    versions = {dist: _dist_version(dist) for dist in RECORDED_DISTS}
    versions["apex"] = apex_report()
    return versions


def check(args: Namespace, available: Callable[[str], bool] | None = None,
          torch_cuda: Callable[[], str | None] = torch_cuda_version) -> None:
    """Raise :class:`MissingPackage` naming every missing optional package ``args`` needs."""
    lacking = missing(args, available)
    if not lacking and not any(n.package == "transformer_engine" for n in needs(args)):
        return
    cuda = torch_cuda()
    errors = [missing_error(n, cuda) for n in lacking]
    if not errors and (variant := te_variant_problem(cuda)) is not None:
        errors = [variant]
    if errors:
        raise MissingPackage("; and ".join(e.cause for e in errors), "; ".join(e.fix for e in errors))
