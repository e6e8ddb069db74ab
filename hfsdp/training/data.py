"""GPT-style datasets for our entry points: ``--mock-data`` or indexed (``--data-path`` etc.).

All three families consume the same token stream (tokens, labels, loss_mask, position_ids,
attention_mask), so one provider serves GPT, MoE and hybrid models. Datasets are built through
``BlendedMegatronDatasetBuilder`` with ``GPTDataset`` / ``MockGPTDataset``, as upstream does.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from typing import Any


def gpt_dataset_config(args: Namespace, tokenizer: Any) -> Any:
    """``GPTDatasetConfig`` from parsed Megatron args."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sp_size = args.tensor_model_parallel_size if args.sequence_parallel else 0
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=sp_size,
    )


def _is_built_on_rank() -> bool:
    """Datasets live on TP rank 0 of the first and last pipeline stages (they feed the batch)."""
    from megatron.core import mpu

    stage_needs_data = mpu.is_pipeline_first_stage(ignore_virtual=True) or \
        mpu.is_pipeline_last_stage(ignore_virtual=True)
    return stage_needs_data and mpu.get_tensor_model_parallel_rank() == 0


def build_datasets(
    args: Namespace,
    tokenizer: Any,
    train_val_test_num_samples: list[int],
    is_built_on_rank: Callable[[], bool] = _is_built_on_rank,
) -> tuple[Any, Any, Any]:
    """Build (train, valid, test) datasets; mock data when ``args.mock_data``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = gpt_dataset_config(args, tokenizer)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    if not args.mock_data:
        assert config.blend is not None or config.blend_per_split is not None, (
            "indexed data needs --data-path / --train-data-path ... (or pass --mock-data)"
        )
    return BlendedMegatronDatasetBuilder(
        cls, train_val_test_num_samples, is_built_on_rank, config
    ).build()


def train_valid_test_datasets_provider(
    train_val_test_num_samples: list[int], vp_stage: int | None = None
) -> tuple[Any, Any, Any]:
    """The ``train_valid_test_dataset_provider`` that ``megatron.training.pretrain`` calls."""
    from megatron.training import get_args, get_tokenizer, print_rank_0

    args = get_args()
    print_rank_0(f"> building train/valid/test datasets (mock={args.mock_data}) ...")
    datasets = build_datasets(args, get_tokenizer(), train_val_test_num_samples)
    print_rank_0("> finished creating GPT datasets ...")
    return datasets
