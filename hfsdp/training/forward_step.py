"""``forward_step`` / loss for GPT, MoE and hybrid language models.

The loss function returns Megatron's 3-tuple ``(loss_sum, num_tokens, {"lm loss": [sum, n]})``:
the schedule divides by the global token count and ``train_step`` reports
``sum(loss) / sum(tokens)`` over the global batch, which is what the functional tests compare.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from hfsdp.training import run_report

_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def _stage_needs_data(vp_stage: int | None) -> bool:
    from megatron.core import mpu

    return mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage) or \
        mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def get_batch(data_iterator: Iterator[dict[str, torch.Tensor]] | None,
              vp_stage: int | None = None, extra_keys: tuple[str, ...] = ()) -> dict[str, torch.Tensor | None]:
    """Next micro-batch on this rank's device, split for TP (broadcast) and CP (sequence);
    ``extra_keys``: more of the batch's tensors to hand on (TP and CP size 1 only)."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    keys = _KEYS + extra_keys
    if not _stage_needs_data(vp_stage):
        return {k: None for k in keys}
    args = get_args()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        assert data_iterator is not None, "TP rank 0 of a data stage has no data iterator"
        raw = next(data_iterator)
        batch = {k: (raw[k].cuda(non_blocking=True) if raw.get(k) is not None else None)
                 for k in keys}
    if tp_size > 1:
        batch = get_batch_on_this_tp_rank(
            batch,
            is_sft=False,
            is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(),
            cp_size=args.context_parallel_size,
            tp_rank=tp_rank,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            mtp_on_this_rank=bool(args.mtp_num_layers),
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            is_pipeline_first_stage=mpu.is_pipeline_first_stage(ignore_virtual=False,
                                                                 vp_stage=vp_stage),
            is_pipeline_last_stage=mpu.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
        )
    if args.context_parallel_size > 1:
        batch.setdefault("cu_seqlens", None)
        batch = get_batch_on_this_cp_rank(batch, False, cp_group=mpu.get_context_parallel_group())
    return batch


def loss_func(loss_mask: torch.Tensor | None, output_tensor: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked token-sum loss, the token count, and the ``lm loss`` report ``[sum, count]``."""
    # Only the last pipeline stage computes the loss, and get_batch gives it the mask.
    assert loss_mask is not None, "loss_func called on a pipeline stage without labels"
    from megatron.core import mpu
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    if args.context_parallel_size > 1:
        # Each CP rank holds a slice of the sequence; the report must cover all of it.
        stats = torch.stack([loss.detach(), num_tokens.float()])
        torch.distributed.all_reduce(stats, group=mpu.get_context_parallel_group())
        report = stats
    else:
        report = torch.stack([loss.detach().clone(), num_tokens.detach().float()])
    if args.check_for_nan_in_loss_and_grad:
        get_rerun_state_machine().validate_result(
            result=loss,
            rejection_func=torch.isnan,
            message="found NaN in local forward loss calculation",
            tolerance=0.0,
            fatal=True,
        )
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]] | None, model: Any,
                 return_schedule_plan: bool = False) -> tuple[torch.Tensor, Any]:
    """One forward pass; returns the per-token loss tensor and the loss callback."""
    from megatron.training import get_timers

    assert not return_schedule_plan, "combined 1F1B schedule plans are not supported here"
    run_report.note_forward_step(model)  # HFSDP_RUN_REPORT only: start of the measured window
    timers = get_timers()
    vp_stage = getattr(model, "vp_stage", None)
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output, partial(loss_func, batch["loss_mask"])
