"""Optional packages a run's flags need, checked before any CUDA work.

[Note: optional packages] Transformer Engine (TE), mamba_ssm and causal_conv1d are optional
([Note: optional extras] in hfsdp/extras.py). Without them Megatron fails late and obscurely:
TE specs with an ImportError deep in model construction, and Mamba's fused path
(``use_mamba_mem_eff_path``, Megatron's default) in the first forward, where mamba_ssm calls
causal_conv1d's kernel through a ``None`` ("'NoneType' object is not callable"). The entry points
call :func:`check` after Megatron's ``validate_args``: every missing package becomes one
sentence that names the flags needing it, the extra that installs it and the flag that avoids it.

What needs what:

* ``transformer_engine``: ``--transformer-impl transformer_engine`` (Megatron's default), and with
  it ``--moe-grouped-gemm`` (TE's grouped linear); ``--cuda-graph-impl transformer_engine``;
  ``--fp8-format`` / ``--fp4-format``; ``--tp-comm-overlap``. Checked with ``find_spec`` (importing
  TE needs a GPU driver, and the entry point reports a CPU-only machine separately).
* ``mamba_ssm``: Mamba layers (``M`` in ``--hybrid-layer-pattern``).
* ``causal_conv1d``: Mamba layers on the fused path (no ``--disable-mamba-mem-eff-path``).
  Checked by importing it, as Megatron's mamba_mixer does (a wheel built for another torch or
  CUDA is present but not importable).

:func:`te_variant_problem` catches a TE core wheel for the wrong CUDA major (the extension
built against this torch requires its own core, so a second, mismatched core is a sign of the
wrong ``te`` / ``te-cu12`` extra).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass

from hfsdp.extras import PACKAGE_EXTRA, install_hint
from hfsdp.training.specs import SpecError

MAMBA_SYMBOL = "M"  # megatron.core.models.hybrid.hybrid_layer_allocation.Symbols.MAMBA
TE_CORE_DISTS = {12: "transformer-engine-cu12", 13: "transformer-engine-cu13"}


class MissingPackage(SpecError):
    """Flags need an optional package that is not importable: ``cause`` and ``fix`` (a UserError's)."""

    def __init__(self, cause: str, fix: str) -> None:
        self.cause, self.fix = cause, fix
        super().__init__(f"{cause}; {fix}")


@dataclass(frozen=True)
class Need:
    """``package`` (import name) is needed by ``why`` (flags); ``avoid`` says how to do without."""

    package: str
    why: str
    avoid: str


def te_flags(args: Namespace) -> list[str]:
    """The flags in ``args`` that need Transformer Engine, as the user would write them."""
    flags = []
    te_impl = getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"
    if te_impl:
        flags.append("--transformer-impl transformer_engine")
        if getattr(args, "moe_grouped_gemm", False) and getattr(args, "num_experts", None):
            flags.append("--moe-grouped-gemm")
    if getattr(args, "cuda_graph_impl", "none") == "transformer_engine":
        flags.append("--cuda-graph-impl transformer_engine")
    for dest, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format")):
        if getattr(args, dest, None):
            flags.append(f"{flag} {getattr(args, dest)}")
    if getattr(args, "tp_comm_overlap", False):
        flags.append("--tp-comm-overlap")
    return flags


def needs(args: Namespace) -> list[Need]:
    """Every optional package ``args`` needs, in the order they are reported."""
    out = []
    te = te_flags(args)
    if te:
        te_impl = te[0].startswith("--transformer-impl")
        out.append(Need("transformer_engine", " and ".join(te),
                        "pass --transformer-impl local for the local (non-TE) layer specs" if te_impl
                        else f"drop {' and '.join(te)}"))
    if MAMBA_SYMBOL in (getattr(args, "hybrid_layer_pattern", None) or ""):
        out.append(Need("mamba_ssm", "Mamba layers ('M' in --hybrid-layer-pattern)",
                        "use a --hybrid-layer-pattern without 'M'"))
        if getattr(args, "use_mamba_mem_eff_path", True):
            out.append(Need("causal_conv1d",
                            "Mamba's fused path (use_mamba_mem_eff_path, on unless "
                            "--disable-mamba-mem-eff-path; without causal_conv1d its first forward "
                            "fails with \"'NoneType' object is not callable\")",
                            "pass --disable-mamba-mem-eff-path (nn.Conv1d + Triton scan)"))
    return out


def importable(package: str) -> bool:
    """Whether ``package`` is usable as Megatron uses it (see the module docstring)."""
    if package == "causal_conv1d":
        try:
            importlib.import_module("causal_conv1d")
        except (ImportError, OSError):
            return False
        return True
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def missing(args: Namespace, available: Callable[[str], bool] = importable) -> list[Need]:
    """The needs of ``args`` whose package is not available."""
    return [n for n in needs(args) if not available(n.package)]


def missing_error(need: Need) -> MissingPackage:
    """The one sentence for one missing package."""
    extra = PACKAGE_EXTRA[need.package]
    what = {"causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm",
            "transformer_engine": "Transformer Engine"}[need.package]
    verb = "need" if " and " in need.why else "needs"  # several TE flags
    return MissingPackage(
        f"{need.why} {verb} {need.package}, which is not importable in this environment",
        f"install .[{extra}] ({what}): {install_hint(extra)}; or {need.avoid}",
    )


def te_variant_problem(torch_cuda: str | None = None,
                       installed: Callable[[str], str | None] | None = None) -> MissingPackage | None:
    """The error for a TE core wheel that does not match torch's CUDA major, or None."""
    if torch_cuda is None:
        import torch

        torch_cuda = torch.version.cuda
    if installed is None:
        installed = _dist_version
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
        f"`pip uninstall -y {' '.join(TE_CORE_DISTS[m] for m in wrong)}`, then "
        + install_hint("te-cu12" if major == 12 else "te"),
    )


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check(args: Namespace, available: Callable[[str], bool] = importable) -> None:
    """Raise :class:`MissingPackage` naming every missing optional package ``args`` needs."""
    errors = [missing_error(n) for n in missing(args, available)]
    if not errors and any(n.package == "transformer_engine" for n in needs(args)):
        variant = te_variant_problem()
        errors = [variant] if variant is not None else []
    if errors:
        raise MissingPackage("; and ".join(e.cause for e in errors), "; ".join(e.fix for e in errors))
