"""Parse pretrain flags with Megatron's real parser and stand up parallel state without a GPU.

Megatron's ``validate_args`` and model constructors read the world size, parallel groups and
(on FSDP) the GPU architecture. On a CPU box we give them: a ``fake`` process group of the
requested world size (collectives are no-ops, no peers needed), ``initialize_model_parallel``
without gloo groups, and an assumed device architecture (``--plan-device-arch``, default 9 =
Hopper). Only shapes and group sizes matter to the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Sequence

DEFAULT_MODEL_FLAGS = (
    # The default benchmark model: hybrid, pattern M*E x4, hidden 1024 (236.5M params).
    "--hybrid-layer-pattern M*EM*EM*EM*E --hidden-size 1024 --num-attention-heads 16 "
    "--ffn-hidden-size 4096 --num-experts 16 --moe-ffn-hidden-size 1024 --moe-router-topk 2 "
    # alltoall dispatch with drop-and-pad: static shapes, so full-iteration CUDA graphs capture it
    "--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.0 "
    "--moe-pad-expert-input-to-capacity "
    "--disable-bias-linear "
    "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 2 "
    "--bf16 --normalization RMSNorm --no-persist-layer-norm --position-embedding-type none "
    "--transformer-impl local --no-masked-softmax-fusion --disable-mamba-mem-eff-path --no-gradient-accumulation-fusion "
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
    "--use-distributed-optimizer --ckpt-format fsdp_dtensor "
    "--tokenizer-type NullTokenizer --vocab-size 50257 --mock-data"
).split()


def add_planner_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("memory planner")
    g.add_argument("--plan-dp-size", type=int, default=2,
                   help="Data-parallel size to plan for (world = dp x tp x pp x cp).")
    g.add_argument("--fsdp-unit-modules", type=str, default=None,
                   help="Comma-separated unit classes (dotted paths or TransformerLayer, "
                        "MoETransformerLayer, MambaLayer); 'megatron-0.18.2' for 0.18.2's "
                        "[TransformerLayer]; 'none' for no units. Default: the fork's "
                        "TransformerLayer,MoETransformerLayer,MambaLayer.")
    g.add_argument("--plan-align-bytes", type=int, default=256,
                   help="Arena offset alignment used by the max-pool plan.")
    g.add_argument("--plan-device-arch", type=int, default=9,
                   help="GPU major arch assumed by validate_args on a CPU box.")
    g.add_argument("--plan-json", type=str, default=None, help="Also write the plan as JSON.")
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and validate like pretrain_gpt.py, with ``--plan-*`` extras; returns args."""
    import megatron.training.arguments as margs

    parser = argparse.ArgumentParser(description="Megatron-FSDP memory planner", allow_abbrev=False)
    parser = margs.add_megatron_arguments(parser)
    parser = add_planner_args(parser)
    args = parser.parse_args(list(argv))
    args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None
    tp = args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    args.rank = 0
    args.world_size = args.plan_dp_size * tp * pp * cp
    saved = margs.get_device_arch_version
    margs.get_device_arch_version = lambda: args.plan_device_arch
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
            margs.validate_args(args, {})
    finally:
        margs.get_device_arch_version = saved
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = padded_vocab_size(args)
    # A token dispatcher owns no parameters, and the alltoall one creates a CUDA stream when it
    # is built: plan with the allgather one, which builds anywhere and gives the same plan.
    args.moe_token_dispatcher_type = "allgather"
    return args


def padded_vocab_size(args: argparse.Namespace) -> int:
    """Vocab padded like Megatron's tokenizer builder (multiple of divisor x TP)."""
    vocab = args.vocab_size
    if vocab is None:
        raise SystemExit("memory planner: pass --vocab-size (e.g. with --tokenizer-type NullTokenizer)")
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-vocab // multiple) * multiple


def init_fake_parallel_state(args: argparse.Namespace) -> None:
    """Fake process group of ``args.world_size`` ranks (this process is rank 0) + mpu groups."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        if dist.get_world_size() != args.world_size:
            raise RuntimeError(
                f"a process group of size {dist.get_world_size()} exists; planner needs "
                f"{args.world_size}")
    else:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        create_gloo_process_groups=False,
    )


def teardown_fake_parallel_state() -> None:
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
