"""Model providers for ``megatron.training.pretrain``: GPT, MoE (GPTModel + MoE spec), hybrid.

``get_model`` calls the provider as ``provider(pre_process=, post_process=, config=,
pg_collection=[, vp_stage=])`` and wraps the result (Float16Module, DDP or Megatron-FSDP)
itself, so a provider only builds the bare model.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from functools import partial
from typing import Any

from hfsdp.training import specs


def _transformer_config(args: Namespace, config: Any) -> Any:
    if config is not None:
        return config
    from megatron.training.argument_utils import core_transformer_config_from_args

    return core_transformer_config_from_args(args)


def build_gpt(args: Namespace, config: Any, pre_process: bool, post_process: bool,
              vp_stage: int | None, pg_collection: Any) -> Any:
    """GPTModel for the ``gpt`` and ``moe`` families."""
    from megatron.core.models.gpt import GPTModel

    layer_spec = specs.gpt_layer_spec(args, config, vp_stage=vp_stage)
    return GPTModel(
        transformer_layer_spec=layer_spec,
        rope_scaling=args.use_rope_scaling,
        mtp_block_spec=specs.gpt_mtp_block_spec(args, config, layer_spec, vp_stage=vp_stage),
        **_language_model_kwargs(args, config, pre_process, post_process, vp_stage, pg_collection),
    )


def build_hybrid(args: Namespace, config: Any, pre_process: bool, post_process: bool,
                 vp_stage: int | None, pg_collection: Any) -> Any:
    """HybridModel (Mamba / attention / MLP / MoE layers from ``--hybrid-layer-pattern``)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    return HybridModel(
        hybrid_stack_spec=specs.hybrid_stack_spec(args),
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        **_language_model_kwargs(args, config, pre_process, post_process, vp_stage, pg_collection),
    )


def _language_model_kwargs(args: Namespace, config: Any, pre_process: bool, post_process: bool,
                           vp_stage: int | None, pg_collection: Any) -> dict[str, Any]:
    """Constructor arguments GPTModel and HybridModel share, from Megatron's args."""
    return dict(
        config=config,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def model_provider(family: specs.Family, pre_process: bool = True, post_process: bool = True,
                   vp_stage: int | None = None, config: Any = None,
                   pg_collection: Any = None, args: Namespace | None = None) -> Any:
    """Build the bare model of ``family`` from the global (or given) Megatron args."""
    if args is None:
        from megatron.training import get_args

        args = get_args()
    if pg_collection is None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    specs.use_transformer_engine(args)  # fail early and clearly if TE is asked for but absent
    config = _transformer_config(args, config)
    build = build_hybrid if family == "hybrid" else build_gpt
    return build(args, config, pre_process, post_process, vp_stage, pg_collection)


def make_model_provider(family: specs.Family) -> Callable[..., Any]:
    """``model_provider`` bound to one family, in the shape ``get_model`` calls."""
    return partial(model_provider, family)
