# Copyright (c) 2026, hfsdp authors. All rights reserved.
"""Hybrid (Mamba / attention / MLP / MoE) stack spec built only from Megatron-Core modules.

The spec in ``hybrid_layer_specs.py`` is Transformer-Engine only: its linears fuse the
pre-norm into the projection (``TELayerNormColumnParallelLinear``), attention is
``TEDotProductAttention`` and ``HybridStack`` builds its final norm with ``TENorm``. On a
machine without TE none of that can be constructed. This file gives the same layer roles
with local modules, so ``HybridModel(hybrid_stack_spec=hybrid_local_stack_spec, ...)``
builds and trains without TE:

* the norm that TE fuses into the first projection becomes a separate torch norm
  (``MambaLayer.norm``, ``TransformerLayer.input_layernorm`` / ``pre_mlp_layernorm``);
* linears are ``ColumnParallelLinear`` / ``RowParallelLinear``;
* core attention is ``DotProductAttention``;
* MoE experts are the local ``SequentialMLP`` (no grouped GEMM);
* the final norm is a torch norm (``LocalHybridStack``).

Layer classes are the ones the TE spec uses, because Megatron-FSDP picks its units by
``isinstance``: Mamba -> ``MambaLayer``, attention -> ``TransformerLayer``, MLP ->
``MLPLayer``, MoE -> ``MoETransformerLayer``.

Mamba without the ``causal_conv1d`` package needs ``config.use_mamba_mem_eff_path=False``:
the fused (memory-efficient) path calls ``causal_conv1d_fn`` unconditionally, while the
unfused path falls back to ``nn.Conv1d`` and mamba_ssm's Triton scan. ``LocalHybridStack``
rejects that combination at construction instead of failing in the first forward.

Gated DeltaNet ('G') and DeepSeek sparse attention ('D') layers need fused kernels or TE
and have no local version here; a pattern that uses them fails at construction.
Sequence parallelism is not supported (torch norms do not handle it).
"""

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import LayerNormInterface, WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

__all__ = [
    "LocalHybridStack",
    "hybrid_local_stack_spec",
    "local_norm",
    "mamba_needs_causal_conv1d",
]


def local_norm(
    config: TransformerConfig, hidden_size: int, eps: float | None = None
) -> LayerNormInterface:
    """Torch LayerNorm/RMSNorm (per ``config.normalization``) with the config's epsilon.

    ``MambaLayer`` calls its norm builder positionally without ``eps``; the TE spec's fused
    norm uses ``config.layernorm_epsilon``, so default to it rather than torch's 1e-5.
    """
    return WrappedTorchNorm(
        config=config,
        hidden_size=hidden_size,
        eps=config.layernorm_epsilon if eps is None else eps,
    )


def mamba_needs_causal_conv1d(config: TransformerConfig) -> bool:
    """True if Mamba layers built from ``config`` would call the missing causal_conv1d kernel."""
    from megatron.core.ssm import mamba_mixer

    return bool(config.use_mamba_mem_eff_path) and mamba_mixer.causal_conv1d_fn is None


class _NoLocalImplementation:
    """Spec placeholder for layer symbols that have no TE-free implementation."""

    def __init__(self, *args, name: str | None = None, **kwargs) -> None:
        raise NotImplementedError(
            f"hybrid_local_stack_spec has no local implementation for layer {name!r}; "
            "Gated DeltaNet ('G') and DeepSeek sparse attention ('D') need the TE spec "
            "(megatron.core.models.hybrid.hybrid_layer_specs.hybrid_stack_spec)."
        )


class LocalHybridStack(HybridStack):
    """``HybridStack`` whose final norm is a torch norm instead of ``TENorm``.

    ``HybridStack.__init__`` always builds ``TENorm`` for the final norm, so the base class is
    built with ``post_layer_norm=False`` and the norm is added here afterwards. Registration
    order (layers, then ``final_norm``) matches the base class, so parameter order and
    therefore Megatron-FSDP bucket order are the same as with the TE spec.
    """

    def __init__(self, config: TransformerConfig, submodules: HybridStackSubmodules, **kwargs):
        post_layer_norm = kwargs.pop("post_layer_norm", True)
        super().__init__(config, submodules, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and self.post_layer_norm:
            self.final_norm = local_norm(self.config, self.config.hidden_size)
        has_mamba = any(isinstance(layer, MambaLayer) for layer in self.layers)
        if has_mamba and mamba_needs_causal_conv1d(self.config):
            raise ValueError(
                "Mamba layers with use_mamba_mem_eff_path=True need the causal_conv1d package, "
                "which is not installed; set use_mamba_mem_eff_path=False "
                "(--disable-mamba-mem-eff-path) to use the nn.Conv1d + Triton scan path."
            )


_mamba_layer = ModuleSpec(
    module=MambaLayer,
    submodules=MambaLayerSubmodules(
        norm=local_norm,
        mixer=ModuleSpec(
            module=MambaMixer,
            submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
            ),
        ),
        mamba_bda=get_bias_dropout_add,
    ),
)

_attention_layer = ModuleSpec(
    module=TransformerLayer,
    submodules=TransformerLayerSubmodules(
        input_layernorm=local_norm,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear,
                core_attention=DotProductAttention,
                linear_proj=RowParallelLinear,
            ),
        ),
        self_attn_bda=get_bias_dropout_add,
    ),
)

_mlp_layer = ModuleSpec(
    module=MLPLayer,
    submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=local_norm,
        mlp=partial(
            MLP.as_mlp_submodule,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        ),
        mlp_bda=get_bias_dropout_add,
    ),
)

# num_experts only has to be non-None here; the expert count comes from config.num_moe_experts.
_moe_layer = ModuleSpec(
    module=MoETransformerLayer,
    submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=local_norm,
        mlp=get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False),
        mlp_bda=get_bias_dropout_add,
    ),
)

# MTP norms and projection; the inner layers come from the hybrid pattern (HybridStack built by
# MultiTokenPredictionLayer with post_layer_norm=False, so no TENorm is involved there).
_mtp_block_spec = ModuleSpec(
    module=MultiTokenPredictionBlock,
    submodules=MultiTokenPredictionBlockSubmodules(
        layer_specs=[
            ModuleSpec(
                module=MultiTokenPredictionLayer,
                submodules=MultiTokenPredictionLayerSubmodules(
                    enorm=local_norm,
                    hnorm=local_norm,
                    eh_proj=ColumnParallelLinear,
                    mtp_model_layer=None,
                    layer_norm=local_norm,
                ),
            )
        ]
    ),
)

hybrid_local_stack_spec = ModuleSpec(
    module=LocalHybridStack,
    submodules=HybridStackSubmodules(
        mamba_layer=_mamba_layer,
        gdn_layer=ModuleSpec(module=_NoLocalImplementation),
        attention_layer=_attention_layer,
        dsa_layer=ModuleSpec(module=_NoLocalImplementation),
        mlp_layer=_mlp_layer,
        moe_layer=_moe_layer,
        mtp_block_spec=_mtp_block_spec,
    ),
)
