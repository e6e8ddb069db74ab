"""Model family and layer-spec selection from parsed Megatron args.

Families: ``gpt`` (dense GPTModel), ``moe`` (GPTModel whose MLPs are MoE layers, chosen by
``--num-experts``) and ``hybrid`` (HybridModel, chosen by ``--hybrid-layer-pattern``).
Specs: Transformer Engine (``--transformer-impl transformer_engine``, Megatron's default) or
local (``--transformer-impl local``). Asking for TE without TE installed is a clear error here
([Note: optional packages] in requirements.py), instead of a deep ImportError or a silent
fallback inside Megatron.
"""

from __future__ import annotations

import importlib
from argparse import Namespace
from typing import Any, Literal

from hfsdp.training import requirements
from hfsdp.training.spec_error import SpecError

Family = Literal["gpt", "moe", "hybrid"]
FAMILIES: tuple[str, ...] = ("gpt", "moe", "hybrid")

# Where the two hybrid stack specs live (the local one is added by our patch series).
HYBRID_TE_SPEC = ("megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec")
HYBRID_LOCAL_SPEC = (
    "megatron.core.models.hybrid.hybrid_local_layer_specs",
    "hybrid_local_stack_spec",
)


def resolve_family(args: Namespace, forced: str | None = None) -> Family:
    """Pick the model family from args; ``forced`` (e.g. from ``pretrain_hybrid.py``) wins.

    A forced family must be consistent with the args (hybrid needs a layer pattern).
    """
    pattern = args.hybrid_layer_pattern
    if forced is not None:
        if forced not in FAMILIES:
            raise SpecError(f"unknown model family {forced!r}; expected one of {FAMILIES}")
        if forced == "hybrid" and not pattern:
            raise SpecError(
                "the hybrid family needs --hybrid-layer-pattern (e.g. 'M*-E', see "
                "megatron.core.models.hybrid.hybrid_layer_allocation.Symbols)"
            )
        if forced != "hybrid" and pattern:
            raise SpecError(f"--hybrid-layer-pattern given but the family is forced to {forced!r}")
        if pattern:
            check_hybrid_pattern(args)
        return forced  # type: ignore[return-value]
    if pattern:
        check_hybrid_pattern(args)
        return "hybrid"
    if args.num_experts:
        return "moe"
    return "gpt"


def check_hybrid_pattern(args: Namespace) -> None:
    """Layers of the pattern that the other flags cannot build, which Megatron finds only deep in
    a layer's constructor: MoE layers (``E``) without ``--num-experts``; Gated DeltaNet (``G``) and
    DeepSeek sparse attention (``D``) with the local specs, which have none. The training entry
    and the memory planner both ask this (through :func:`resolve_family`)."""
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

    pattern = args.hybrid_layer_pattern or ""
    te_only = sorted({Symbols.GDN, Symbols.DS_ATTENTION} & set(pattern))
    if te_only and args.transformer_impl == "local":
        raise SpecError(f"--hybrid-layer-pattern {pattern!r} has {' and '.join(te_only)} layers (Gated DeltaNet, "
                        "DeepSeek sparse attention), which --transformer-impl local has no layers for; use "
                        f"--transformer-impl transformer_engine, or drop {' and '.join(te_only)} from the pattern")
    if Symbols.MOE in pattern and not args.num_experts:
        raise SpecError(f"--hybrid-layer-pattern {pattern!r} has MoE layers ({Symbols.MOE}) but no --num-experts "
                        f"says how many experts each holds; add --num-experts N, or drop {Symbols.MOE} from the "
                        "pattern")


def use_transformer_engine(args: Namespace) -> bool:
    """Whether args ask for TE specs; raises :class:`SpecError` if TE is asked for but missing."""
    impl = args.transformer_impl
    if impl == "transformer_engine":
        if not requirements.importable("transformer_engine"):
            need = next(n for n in requirements.needs(args) if n.package == "transformer_engine")
            raise requirements.missing_error(need, requirements.torch_cuda_version())
        return True
    if impl == "local":
        return False
    raise SpecError(f"--transformer-impl {impl!r} is not supported by this entry point "
                    "(use 'local' or 'transformer_engine')")


def _import_attr(module: str, attr: str) -> Any:
    return getattr(importlib.import_module(module), attr)


def custom_spec(args: Namespace) -> Any | None:
    """Spec named by upstream's ``--spec <module> <function-or-attr>``, if given."""
    spec_arg = args.spec
    if not spec_arg:
        return None
    if len(spec_arg) != 2:
        raise SpecError(f"--spec expects '<module> <name>', got {spec_arg!r}")
    obj = _import_attr(spec_arg[0], spec_arg[1])
    return obj() if callable(obj) else obj


def gpt_layer_spec(args: Namespace, config: Any, vp_stage: int | None = None) -> Any:
    """Layer (dense) or block (MoE) spec for GPTModel."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    override = custom_spec(args)
    if override is not None:
        return override
    te = use_transformer_engine(args)
    if args.num_experts:
        # The block spec honours --moe-layer-freq (dense/MoE interleaving) and PP slicing.
        return specs.get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )
    common = dict(
        num_experts=None,
        moe_grouped_gemm=False,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
        qk_l2_norm=args.qk_l2_norm,
    )
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(**common)
    return specs.get_gpt_layer_local_spec(normalization=args.normalization, **common)


def gpt_mtp_block_spec(args: Namespace, config: Any, layer_spec: Any,
                       vp_stage: int | None = None) -> Any | None:
    """Multi-token-prediction block spec when ``--mtp-num-layers`` is set."""
    if not args.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(
        config, layer_spec, use_transformer_engine=use_transformer_engine(args), vp_stage=vp_stage
    )


def hybrid_stack_spec(args: Namespace) -> Any:
    """HybridStack spec: upstream's TE spec, or our local (non-TE) spec added by the patch series."""
    override = custom_spec(args)
    if override is not None:
        return override
    if use_transformer_engine(args):
        return _import_attr(*HYBRID_TE_SPEC)
    module, attr = HYBRID_LOCAL_SPEC
    try:
        return _import_attr(module, attr)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise SpecError(
            f"--transformer-impl local for the hybrid family needs {module}.{attr}, which is "
            "added by this fork's patch series; the imported megatron tree does not have it. "
            "Re-materialize the fork (scripts/patchset materialize) or use Transformer Engine."
        ) from exc
