"""Parse pretrain flags with Megatron's real parser and stand up parallel state without a GPU.

Megatron's ``validate_args`` and model constructors read the world size, parallel groups and
(on FSDP) the GPU architecture. On a CPU box we give them: a ``fake`` process group of the
requested world size (collectives are no-ops, no peers needed), ``initialize_model_parallel``
without gloo groups, and an assumed device architecture (``--plan-device-arch``, default 9 =
Hopper). Only shapes and group sizes matter to the plan.

[Note: planner flags] Flags that give the model's depth (``--num-layers`` or
``--hybrid-layer-pattern``) mean "plan my model": only the given flags are parsed, exactly as
``pretrain_*.py`` would get them, and missing essentials (hidden size, heads, sequence length,
micro-batch size) are named. Without them the flags tweak the default model
(``DEFAULT_MODEL_FLAGS``): each one replaces the default's value (argparse keeps the last), so
``--hidden-size 2048`` alone plans the default model at hidden 2048. Never a mix the user did not
ask for: defaults are not slipped into a model the user defined. Inconsistent flags are a
:class:`~hfsdp.usererror.UserError` naming them: our own shape checks first (``check_model``),
then Megatron's ``validate_args`` and ``TransformerConfig``, whose assertions and
``ValueError``s become one sentence (``HFSDP_DEBUG=1`` shows the trace).
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Sequence

from hfsdp.training.assumed_device import ASSUMED_ARCH, assumed_device
from hfsdp.usererror import UserError, positive, rejection

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
    "--transformer-impl local --no-masked-softmax-fusion --disable-mamba-mem-eff-path "
    "--no-gradient-accumulation-fusion "
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
    "--use-distributed-optimizer --ckpt-format fsdp_dtensor "
    "--tokenizer-type NullTokenizer --vocab-size 50257 --mock-data"
).split()


DEPTH_FLAGS = ("--num-layers", "--hybrid-layer-pattern")
# Largest world the planner builds (fake process group, every Megatron group of it, in one
# process): 16,384 ranks plan in about 14 s, 262,144 in 80 s.
MAX_PLAN_WORLD = 65536
FIX = ("fix the flags (scripts/fsdp_memory_planner.py --help lists the planner's, --help-megatron every one); "
       "docs/memory-planner.md has examples")
_ESSENTIAL = ("hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")


def own_model(user: Sequence[str]) -> bool:
    """Whether the flags define the model themselves (see the note)."""
    return any(a in DEPTH_FLAGS or a.startswith(tuple(f + "=" for f in DEPTH_FLAGS)) for a in user)


def model_argv(user: Sequence[str]) -> list[str]:
    """The flags to parse (see the note): the user's alone, or the default model's then the user's."""
    return list(user) if own_model(user) else [*DEFAULT_MODEL_FLAGS, *user]


def flag_names(argv: Sequence[str]) -> list[str]:
    """The option names in ``argv`` (``--name`` of ``--name value`` and ``--name=value``), in order."""
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def replaced_defaults(user: Sequence[str]) -> list[str]:
    """The default model's flags that ``user`` gives again: their values replace the default's."""
    return sorted(set(flag_names(user)) & set(flag_names(DEFAULT_MODEL_FLAGS)))


def describe_model(args: argparse.Namespace) -> str:
    """The model in a few words: its layers, hidden size and experts (what the flags give)."""
    pattern = args.hybrid_layer_pattern
    parts = [f"hybrid layers {pattern}" if pattern else f"{args.num_layers} layers" if args.num_layers else "",
             f"hidden size {args.hidden_size}" if args.hidden_size else "",
             f"{args.num_experts} experts" if args.num_experts else ""]
    return ", ".join(p for p in parts if p) or "no layers given"


def plan_scale(args: argparse.Namespace) -> str:
    """The data-parallel size planned for, and the ranks in all where model parallelism adds some."""
    dp = args.plan_dp_size
    world = dp * args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    return f"data-parallel size {dp}" + (f" ({world} ranks with model parallelism)" if world > dp else "")


def plan_note(user: Sequence[str], args: argparse.Namespace) -> str:
    """Sentences saying which model is planned, at which scale, and how the flags chose it."""
    if own_model(user):
        return (f"planning the model your flags define ({describe_model(args)}) for {plan_scale(args)}; "
                f"no defaults are added, because your flags set its depth.")
    note = (f"planning the default model ({describe_model(args)}; DEFAULT_MODEL_FLAGS in "
            f"hfsdp/planner/setup.py) for {plan_scale(args)}.")
    if given := replaced_defaults(user):
        one = len(given) == 1
        note += f" Your {', '.join(given)} replace{'s' if one else ''} the default's value{'' if one else 's'}."
    return note + f" To plan a model from your flags alone, give {' or '.join(DEPTH_FLAGS)}."


_AT_LEAST_ONE = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                 "max_position_embeddings", "micro_batch_size", "global_batch_size", "vocab_size",
                 "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_model(args: argparse.Namespace) -> None:
    """Shape checks Megatron does with bare asserts, or not at all (see the note)."""
    if missing := [_flag(d) for d in _ESSENTIAL if getattr(args, d, None) is None]:
        raise UserError(f"the model your flags define lacks {', '.join(missing)}",
                        f"add them (your {' / '.join(DEPTH_FLAGS)} means: plan only the flags given), or drop "
                        f"{' and '.join(DEPTH_FLAGS)} to plan the default model with your other flags")
    for dest in _AT_LEAST_ONE:
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            raise UserError(f"{_flag(dest)} must be >= 1, got {value}", FIX)
    if args.hidden_size and args.num_attention_heads and args.hidden_size % args.num_attention_heads:
        raise UserError(f"--hidden-size {args.hidden_size} is not a multiple of --num-attention-heads "
                        f"{args.num_attention_heads}, so the heads cannot split it", FIX)
    experts, topk = args.num_experts, args.moe_router_topk
    if experts and topk and topk > experts:
        raise UserError(f"--moe-router-topk {topk} is larger than --num-experts {experts}", FIX)
    pattern = args.hybrid_layer_pattern
    if pattern is not None:
        from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

        allowed = Symbols.VALID_LAYERS | {Symbols.PIPE, Symbols.MTP_SEPARATOR}
        if not pattern.strip():
            raise UserError("--hybrid-layer-pattern is empty, so the model has no layers",
                            "give one symbol per layer, e.g. --hybrid-layer-pattern 'M*EM*E' "
                            f"(symbols: {' '.join(sorted(Symbols.VALID_LAYERS))})")
        if bad := sorted(set(pattern) - allowed):
            raise UserError(f"--hybrid-layer-pattern {pattern!r} has {', '.join(map(repr, bad))}, not a layer symbol",
                            f"use {' '.join(sorted(Symbols.VALID_LAYERS))} (and | between pipeline stages)")


def lane_counts(text: str) -> tuple[int, ...]:
    """argparse ``type=`` of ``--plan-lanes``: comma-separated whole numbers >= 2, in order."""
    counts = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 2:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a lane count: give whole numbers >= 2, e.g. 3 or 2,3,4")
        counts.append(int(part))
    return tuple(dict.fromkeys(counts))


def add_planner_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("memory planner")
    g.add_argument("--plan-dp-size", type=positive(), default=2, metavar="N",
                   help="Data-parallel size to plan for (world = dp x tp x pp x cp, at most "
                        f"{MAX_PLAN_WORLD:,} ranks).")
    g.add_argument("--fsdp-unit-modules", type=str, default=None, metavar="LIST",
                   help="Comma-separated unit classes (dotted paths or TransformerLayer, "
                        "MoETransformerLayer, MambaLayer); 'megatron-0.18.2' for 0.18.2's "
                        "[TransformerLayer]; 'none' for no units. Default: the fork's "
                        "TransformerLayer,MoETransformerLayer,MambaLayer.")
    g.add_argument("--plan-align-bytes", type=positive(), default=256, metavar="N",
                   help="Arena offset alignment used by the max-pool plan.")
    g.add_argument("--plan-lanes", type=lane_counts, default=None, metavar="N[,N...]",
                   help="Lane counts of the max-pool double buffer to plan, as "
                        "--megatron-fsdp-max-pool-lanes N would hold them (default: 3, when "
                        "the model has at least 3 FSDP units).")
    g.add_argument("--plan-device-arch", type=positive(), default=ASSUMED_ARCH, metavar="N",
                   help="GPU major arch assumed by validate_args on a CPU box.")
    g.add_argument("--plan-json", type=str, default=None, metavar="FILE", help="Also write the plan as JSON.")
    g.add_argument("--plan-reference", action="store_true",
                   help="Also plan the frozen reference of examples/reference_kl/train.py (its weight shards, no "
                        "pool) and report each model's memory and the sum.")
    return parser


HELP_MEGATRON = "--help-megatron"
USAGE = ("%(prog)s [--plan-dp-size N] [--plan-lanes N[,N...]] [--plan-json FILE] [--plan-reference] "
         "[--fsdp-unit-modules LIST] [--plan-align-bytes N] [--plan-device-arch N] [pretrain flags ...]")
MEGATRON_FLAGS = ("Every flag of pretrain_gpt.py / pretrain_hybrid.py is taken too (the model to plan; without "
                  "--num-layers or --hybrid-layer-pattern they change the default model): "
                  f"`scripts/fsdp_memory_planner.py {HELP_MEGATRON}` lists them, as does "
                  "`python pretrain_gpt.py --help`. The fork's own: `python -m hfsdp.flags`.")


def planner_parser() -> argparse.ArgumentParser:
    """The planner's own options alone: what ``--help`` prints, without Megatron's thousands of flags."""
    parser = argparse.ArgumentParser(prog="fsdp_memory_planner", usage=USAGE, epilog=MEGATRON_FLAGS,
                                     description="Plan Megatron-FSDP double-buffer memory for a model, no GPU "
                                                 "needed (docs/memory-planner.md).", allow_abbrev=False)
    parser.add_argument(HELP_MEGATRON, action="store_true",
                        help="List every Megatron flag the planner also takes (thousands of lines) and exit.")
    return add_planner_args(parser)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and validate like pretrain_gpt.py, with ``--plan-*`` extras; returns args.

    Inconsistent flags raise UserError (see the note).
    """
    return validate(parse_flags(argv))


def parse_flags(argv: Sequence[str]) -> argparse.Namespace:
    """Megatron's parser plus ``--plan-*``, without validation (argparse's own errors exit 2)."""
    return full_parser().parse_args(list(argv))


def full_parser() -> argparse.ArgumentParser:
    """The planner's options, then Megatron's: every flag the planner takes."""
    import megatron.training.arguments as margs

    # Megatron's parser has hundreds of flags: a usage line listing them all would bury the error.
    parser = argparse.ArgumentParser(prog="fsdp_memory_planner", description="Megatron-FSDP memory planner",
                                     usage=USAGE + " (--help: the planner's options)", allow_abbrev=False)
    parser = add_planner_args(parser)  # listed first by --help-megatron
    return margs.add_megatron_arguments(parser)


def check_planner_flags(args: argparse.Namespace) -> None:
    """Refuse the flags that would have training read its flags from elsewhere: the planner plans
    the flags it is given, and would plan something else than training without a word."""
    for dest, where in (("yaml_cfg", "a YAML file"), ("use_checkpoint_args", "a checkpoint")):
        if getattr(args, dest, None):
            raise UserError(f"{_flag(dest)} has training read its flags from {where}, which the planner "
                            "does not read", f"give the model's flags themselves, without {_flag(dest)}")


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Our shape checks, then Megatron's ``validate_args`` and ``TransformerConfig`` (see the note)."""
    import megatron.training.arguments as margs
    from hfsdp.training import specs
    from hfsdp.training.spec_error import SpecError

    check_model(args)
    try:
        specs.resolve_family(args)  # the training entry's own model checks (e.g. MoE layers need experts)
    except SpecError as exc:
        raise exc.user_error(FIX) from exc
    args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None
    tp = args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    args.rank = 0
    args.world_size = args.plan_dp_size * tp * pp * cp
    if args.world_size > MAX_PLAN_WORLD:
        raise UserError(
            f"--plan-dp-size {args.plan_dp_size} makes a world of {args.world_size:,} ranks (dp x tp x pp x cp); "
            f"the planner builds every process group of that world in this process and plans at most "
            f"{MAX_PLAN_WORLD:,} ranks (time and memory grow with the world: 2**31 ranks exhaust 24 GiB)",
            "plan at the data-parallel size you will run; per-rank figures change little past a few thousand")
    try:
        # The GPU validate_args asks about is the assumed one ([Note: validation without a GPU]).
        with assumed_device(args.plan_device_arch), contextlib.redirect_stdout(io.StringIO()):
            margs.validate_args(args, {})  # (it prints every argument)
        from megatron.training.argument_utils import core_transformer_config_from_args

        core_transformer_config_from_args(args)  # TransformerConfig's own checks, before any build
    except (AssertionError, ValueError) as exc:
        raise rejection(exc, "Megatron rejects these flags", FIX) from exc
    if args.padded_vocab_size is None:
        args.padded_vocab_size = padded_vocab_size(args)
    # A token dispatcher owns no parameters, and the alltoall one creates a CUDA stream when it
    # is built: plan with the allgather one, which builds anywhere and gives the same plan.
    args.moe_token_dispatcher_type = "allgather"
    # Gradient-accumulation fusion picks a weight-gradient kernel (APEX's or TE's), not a shape; the
    # local linear layers refuse it where that kernel is not installed, as on a CPU box.
    args.gradient_accumulation_fusion = False
    return args


def padded_vocab_size(args: argparse.Namespace) -> int:
    """Vocab padded like Megatron's tokenizer builder (multiple of divisor x TP)."""
    vocab = args.vocab_size
    if vocab is None:
        raise UserError("the model has no vocabulary size",
                        "pass --vocab-size N (e.g. with --tokenizer-type NullTokenizer)")
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
