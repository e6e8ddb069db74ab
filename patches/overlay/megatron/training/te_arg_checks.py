# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Argument checks for Transformer Engine combinations that cannot run as asked.

[Note: TE combinations]
Each check below is a combination whose failure (or silent change) can be read off Megatron's
and TE's code, turned into one error at argument validation that names the way out. Without
the checks the first three fail after the process groups are up, while the model is built:

* ``--deterministic-mode`` with TE attention: Megatron's ``TEDotProductAttention.__init__``
  raises unless ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` is in the environment (TE's attention
  is deterministic under ``torch.use_deterministic_algorithms``, which ``--deterministic-mode``
  sets; the variable is Megatron's requirement). Only models with attention layers: dense and
  MoE GPT, or a hybrid pattern with ``*``. On 0.19.2 this check never fires: validate_args
  sets the variable to 0 under ``--deterministic-mode`` (and asserts on another value) first.
* ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` / ``NVTE_UNFUSED_ATTN`` in the environment that
  disagree with ``--attention-backend`` (default ``auto``): ``LanguageModule`` sets the three
  itself from the flag and asserts that a value already set agrees.
* ``--moe-grouped-gemm`` with ``--transformer-impl local``: grouped-GEMM experts exist only as
  TE's ``TEGroupedMLP``; the local spec provider builds ``SequentialMLP`` whatever the flag says
  (``LocalSpecProvider.grouped_mlp_modules`` ignores it, ``hybrid_local_stack_spec`` pins
  ``moe_grouped_gemm=False``), so the flag would silently do nothing.
* FP8 with Mamba layers whose input projection is not a multiple of 16 wide
  (``2 * d_inner + 2 * groups * state + heads``): ``MambaMixer.__init__`` asserts it while the
  model is built. The check names the nearest ``--mamba-num-heads`` that satisfies it.
* ``--fp8-recipe mxfp8`` on a GPU below compute capability 10 (Hopper): TE's FP8 autocast
  checks MXFP8 support when it is entered, so the first forward step raises. MXFP8 is
  Blackwell's recipe; on Hopper the recipes are delayed, tensorwise and blockwise.
* ``--optimizer-cuda-graph`` with ``--use-precision-aware-optimizer`` (no CPU offload), where TE's
  capturable FusedAdam refuses to be built (its rules as of the pinned TE 2.20.2): Megatron asks
  it for master weights (no FP8, delayed scaling, or non-fp32 main parameters), which it stores
  with parameter remainders when they are fp32 and refuses in any other dtype; or the two Adam
  moments are not both fp32 or both bf16.

What each FP8 recipe does with each feature of the fork, case or refusal, is one table,
generated into docs/transformer-engine.md from ``hfsdp/functional/fp8_matrix.py``. Not checked,
because they run (the benchmark's realistic preset): TE with full-iteration CUDA graphs on Mamba's
fused path, and TE's ``--gradient-accumulation-fusion`` under max-pool.
"""

import os
from collections.abc import Mapping
from typing import Any

MXFP8_MIN_ARCH = 10  # TE's check_mxfp8_support: compute capability 10.0 or higher
ATTENTION_SYMBOL = "*"  # megatron.core.models.hybrid.hybrid_layer_allocation.Symbols.ATTENTION
MAMBA_SYMBOL = "M"  # ... Symbols.MAMBA
MAMBA_EXPAND = 2  # MambaMixer's default expand, which the hybrid specs keep
FP8_WIDTH = 16  # MambaMixer: the FP8 input projection's output width must be a multiple of this
ATTN_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
# The values LanguageModule._set_attention_backend gives ATTN_ENV for each --attention-backend,
# in the order a matching backend is suggested.
BACKEND_ENV: dict[str, dict[str, str]] = {
    name: dict(zip(ATTN_ENV, values, strict=True))
    for name, values in (
        ("auto", ("1", "1", "1")),
        ("fused", ("0", "1", "0")),
        ("flash", ("1", "0", "0")),
        ("unfused", ("0", "0", "1")),
        ("local", ("0", "0", "0")),  # last: it also needs --spec local
    )
}


def mamba_in_proj_width(hidden_size: int, head_dim: int, groups: int, state: int, heads: int | None) -> int:
    """The width of a Mamba layer's input projection output, as ``MambaMixer`` computes it."""
    if heads is None:
        heads = MAMBA_EXPAND * hidden_size // head_dim
    d_inner = heads * head_dim
    return 2 * d_inner + 2 * groups * state + heads


def _mamba_fp8_problem(args: Any) -> str | None:
    if not args.fp8 or MAMBA_SYMBOL not in (args.hybrid_layer_pattern or ""):
        return None
    dims = (args.hidden_size, args.mamba_head_dim, args.mamba_num_groups, args.mamba_state_dim)
    width = mamba_in_proj_width(*dims, args.mamba_num_heads)
    if width % FP8_WIDTH == 0:
        return None
    heads = args.mamba_num_heads or MAMBA_EXPAND * args.hidden_size // args.mamba_head_dim
    fit = next((n for n in range(heads + 1, heads + 8 * FP8_WIDTH + 1)
                if mamba_in_proj_width(*dims, n) % FP8_WIDTH == 0), None)
    way = (f"Pass --mamba-num-heads {fit} (or change --mamba-head-dim, --mamba-num-groups or "
           "--mamba-state-dim)" if fit else "Change --mamba-head-dim, --mamba-num-groups or --mamba-state-dim")
    return (
        f"FP8 (--fp8-format) with Mamba layers needs their input projection to be a multiple of "
        f"{FP8_WIDTH} wide, and this one is {width} (2 x d_inner + 2 x groups x state + heads, with "
        f"{heads} heads of {args.mamba_head_dim}): MambaMixer refuses to be built otherwise. {way}, "
        "or train the hybrid model in bf16."
    )


def _has_te_attention(args: Any) -> bool:
    if args.transformer_impl != "transformer_engine":
        return False
    pattern = args.hybrid_layer_pattern
    return pattern is None or ATTENTION_SYMBOL in pattern


def _nondeterministic_algos_allowed(environ: Mapping[str, str]) -> bool:
    """Megatron's reading: ``int(os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")) != 0``."""
    value = environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    try:
        return int(value) != 0
    except ValueError:
        return True


def _backend_name(args: Any) -> str:
    return str(args.attention_backend.name)  # an AttnBackend: the parser converts --attention-backend


def _attention_env_problem(args: Any, env: Mapping[str, str]) -> str | None:
    backend = _backend_name(args)
    expected = BACKEND_ENV.get(backend)
    if expected is None:
        return None
    given = {k: env[k] for k in ATTN_ENV if k in env}
    wrong = {k: v for k, v in given.items() if v != expected[k]}
    if not wrong:
        return None
    matching = [b for b, values in BACKEND_ENV.items() if all(values[k] == v for k, v in given.items())]
    way = (f"or pass --attention-backend {matching[0]}, which they describe" if matching
           else "no --attention-backend matches them all")
    return (
        f"{', '.join(f'{k}={v}' for k, v in given.items())} in the environment "
        f"contradict{'s' if len(given) == 1 else ''} --attention-backend {backend}: Megatron sets "
        f"{', '.join(ATTN_ENV)} itself from --attention-backend and refuses to build the model "
        f"when a value already set disagrees. Unset {' and '.join(wrong)} and choose the backend "
        f"with --attention-backend ({way})."
    )


def _device_arch() -> int:
    """The GPU's compute capability major (the training entry answers it without a GPU)."""
    import torch

    return int(torch.cuda.get_device_capability()[0])


def te_arg_problems(args: Any, environ: Mapping[str, str] | None = None,
                    device_arch: int | None = None) -> list[str]:
    """Every TE combination in ``args`` that cannot run as asked, each a sentence naming the fix.

    ``device_arch``: the GPU's compute capability major; asked of torch only when a check needs it.
    """
    env = os.environ if environ is None else environ
    problems = []
    if (
        args.deterministic_mode
        and _has_te_attention(args)
        and _nondeterministic_algos_allowed(env)
    ):
        value = env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
        problems.append(
            "--deterministic-mode with Transformer Engine attention needs "
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 in the environment (it is "
            f"{'unset' if value is None else repr(value)}): TEDotProductAttention refuses to be "
            "built otherwise. Export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0."
        )
    attention_env = _attention_env_problem(args, env)
    if attention_env is not None:
        problems.append(attention_env)
    if (
        args.moe_grouped_gemm
        and args.num_experts
        and args.transformer_impl == "local"
    ):
        problems.append(
            "--moe-grouped-gemm has no effect with --transformer-impl local: grouped-GEMM experts "
            "(TEGroupedMLP) exist only in the Transformer Engine specs, and the local specs build "
            "SequentialMLP experts. Drop --moe-grouped-gemm, or use --transformer-impl "
            "transformer_engine."
        )
    mamba_fp8 = _mamba_fp8_problem(args)
    if mamba_fp8 is not None:
        problems.append(mamba_fp8)
    if args.fp8 and args.fp8_recipe == "mxfp8":
        arch = _device_arch() if device_arch is None else device_arch
        if arch < MXFP8_MIN_ARCH:
            problems.append(
                f"--fp8-recipe mxfp8 needs a GPU of compute capability {MXFP8_MIN_ARCH} or more "
                f"(Blackwell), this one has {arch}: Transformer Engine refuses MXFP8 when the first "
                "forward step enters its FP8 autocast. Use --fp8-recipe delayed, tensorwise or "
                "blockwise."
            )
    optimizer_graph = _optimizer_graph_problem(args)
    if optimizer_graph is not None:
        problems.append(optimizer_graph)
    return problems


def _optimizer_graph_problem(args: Any) -> str | None:
    """Why TE's capturable FusedAdam cannot be built from ``args`` (TE 2.20.2's checks in its __init__), or None.

    Megatron builds it with ``capturable=--optimizer-cuda-graph``; with the precision-aware optimizer it also passes the
    moment dtypes, ``store_param_remainders=True`` and, where OptimizerConfig's
    ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` holds, master weights of ``--main-params-dtype``."""
    if not (getattr(args, "optimizer_cuda_graph", False) and args.use_precision_aware_optimizer):
        return None
    if getattr(args, "optimizer_cpu_offload", False):
        return None  # HybridDeviceOptimizer, not TE's FusedAdam
    way_out = "Drop --optimizer-cuda-graph (the optimizer step then runs eagerly after the graph)."
    fp32_main = str(args.main_params_dtype) in ("fp32", "torch.float32")
    if not fp32_main or args.fp8_recipe in (None, "delayed"):  # TE keeps master weights
        why = ("stores fp32 ones with parameter remainders" if fp32_main
               else f"takes only fp32 ones (--main-params-dtype is {args.main_params_dtype})")
        return ("--optimizer-cuda-graph with --use-precision-aware-optimizer and TE-kept master weights (no FP8, "
                "--fp8-recipe delayed, or --main-params-dtype other than fp32): Megatron builds Transformer "
                f"Engine's FusedAdam capturable with master weights, and a capturable FusedAdam {why}, so TE "
                f"refuses it while the optimizer is built. {way_out}")
    moments = {str(args.exp_avg_dtype), str(args.exp_avg_sq_dtype)}
    if len(moments) != 1 or moments.pop() not in ("fp32", "torch.float32", "bf16", "torch.bfloat16"):
        return ("--optimizer-cuda-graph with --use-precision-aware-optimizer needs --exp-avg-dtype and "
                "--exp-avg-sq-dtype both fp32 or both bf16 (they are "
                f"{args.exp_avg_dtype} and {args.exp_avg_sq_dtype}): Transformer Engine's capturable FusedAdam "
                f"refuses other moments while the optimizer is built. {way_out}")
    return None


def validate_te_args(args: Any) -> None:
    """Raise ValueError listing every problem :func:`te_arg_problems` finds in ``args``."""
    problems = te_arg_problems(args)
    if problems:
        raise ValueError(
            "Transformer Engine arguments that cannot run on this tree:\n  - "
            + "\n  - ".join(problems)
        )
