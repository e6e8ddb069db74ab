"""Benchmark configurations and model presets."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

from hfsdp.flagsets import GRAPH_FLAGS, LANES_FLAG, MAXPOOL_FLAG
from hfsdp.planner.setup import DEFAULT_MODEL_FLAGS
from hfsdp.usererror import UserError

# no_db_d1's --suggested-communication-unit-size (elements); see CONFIGS.
D1_UNIT_SIZE = 2_000_000


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    name: str
    flags: tuple[str, ...]
    description: str
    plan: str | None  # which planner figure is its pool: "fixed_pool", "maxpool", "lanes" or None
    spec: str = "local"  # layer specs: "local" or "te" (Transformer Engine); see BASELINES
    env: tuple[tuple[str, str], ...] = ()  # environment of its runs (the product's diagnostic switches)

    @property
    def graphed(self) -> bool:
        """Runs under a full-iteration CUDA graph (timed through pretrain only)."""
        return "--cuda-graph-impl" in self.flags

    @property
    def user_buffers(self) -> bool:
        """Registers its buffers with NCCL (``--use-nccl-ub``)."""
        return "--use-nccl-ub" in self.flags

    @property
    def lanes(self) -> int:
        """Max-pool lanes it runs with (the flag's value; 2, the default, without it)."""
        return int(self.flags[self.flags.index(LANES_FLAG) + 1]) if LANES_FLAG in self.flags else 2


# The product's diagnostic switches back to the step path before first writes, model-weight writes in
# the optimizer step, multi-tensor main-to-model copies and batched gradient writes
# (megatron_fsdp/single_rank_grads.py, foreach_copy.py, optimizer/adam_model_writes.py; the product
# never imports this module).
ZERO_GRAD_FILL_ENV = "HFSDP_ZERO_GRAD_FILL"
PER_PARAM_COPIES_ENV = "HFSDP_PER_PARAM_COPIES"
PER_PARAM_GRAD_WRITES_ENV = "HFSDP_PER_PARAM_GRAD_WRITES"
SEPARATE_MODEL_COPIES_ENV = "HFSDP_SEPARATE_MODEL_COPIES"
SEPARATE_CLIP_SCALE_ENV = "HFSDP_SEPARATE_CLIP_SCALE"
TE_ADAM_KERNEL_ENV = "HFSDP_TE_ADAM_KERNEL"
TRITON_L2NORM_ENV = "HFSDP_TRITON_L2NORM"  # optimizer/triton_l2norm.py: on by default, off for a comparison
HOST_READS_ENV = "HFSDP_HOST_READS_EVERY_STEP"  # step_host_reads.py: upstream's per-step host reads
# Megatron's default rerun mode, given explicitly so that a graphed run keeps it.
VALIDATE_FLAGS = ("--rerun-mode", "validate_results")
# Transformer Engine layer specs (replaces the presets' --transformer-impl local; argparse keeps
# the last value). The hybrid TE spec builds TE attention, TE layer-norm linears and TE grouped
# GEMM experts (TEGroupedMLP) whatever --moe-grouped-gemm says.
TE_FLAGS = ("--transformer-impl", "transformer_engine")
# Each spec's eager no-double-buffer configuration: its runs' lm loss is what the spec's other
# configurations must match bit for bit (TE and local kernels differ, so they never match each other).
BASELINES = {"local": "no_db", "te": "te_no_db"}
BF16_RS_FLAG = "--grad-reduce-in-bf16"
FUSION_FLAGS = ("--moe-permute-fusion", "--moe-router-fusion", "--cross-entropy-loss-fusion",
                "--cross-entropy-fusion-impl", "native")
PAO_FLAG = "--use-precision-aware-optimizer"
FP8_FLAG = "--fp8-format"
# Hopper's FP8 recipes ([FP8 recipes] in docs/transformer-engine.md): format and recipe flags.
FP8_RECIPES = {
    "delayed": (FP8_FLAG, "hybrid", "--fp8-recipe", "delayed"),
    "tensorwise": (FP8_FLAG, "hybrid", "--fp8-recipe", "tensorwise"),
    "blockwise": (FP8_FLAG, "e4m3", "--fp8-recipe", "blockwise"),
}
# Adam's moments stored in bf16 (the precision-aware optimizer's --exp-avg-dtype, --exp-avg-sq-dtype):
# 8 bytes of state fewer per parameter, but TE's Adam kernel is slower with them (results.md).
BF16_MOMENTS_FLAGS = ("--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")
# Flags that change a run's numbers, not only its speed and memory: see loss_baseline.
NUMERICS_FLAGS = frozenset({BF16_RS_FLAG, *FUSION_FLAGS, PAO_FLAG, FP8_FLAG, "--fp8-param-gather",
                            *BF16_MOMENTS_FLAGS[::2]})
# The realistic preset's best flags: TE specs, graphed max-pool, NCCL user buffers, bf16 reduce-scatter.
TE_MAXPOOL_UB_GRAPH_BF16RS = (*TE_FLAGS, "--fsdp-double-buffer", MAXPOOL_FLAG, "--use-nccl-ub", *GRAPH_FLAGS,
                              BF16_RS_FLAG)


CONFIGS = {
    "no_db": BenchConfig("no_db", (), "no double buffer (StorageResize allocator)", None),
    "fixedpool": BenchConfig("fixedpool", ("--fsdp-double-buffer",),
                             "0.18.2 FixedPool double buffer", "fixed_pool"),
    "maxpool": BenchConfig("maxpool", ("--fsdp-double-buffer", MAXPOOL_FLAG),
                           "max-pool double buffer", "maxpool"),
    # Diagnostic: plain FSDP buffers, but all-gather prefetch stops after the next unit and the
    # reduce-scatter queue holds about one unit: close to the schedule a 2-group double buffer
    # imposes, without any pool. AG prefetch = size // 2 elements: 1M is above every MoE unit's
    # small non-expert bucket and below every full unit, so forward prefetch fetches exactly the
    # next unit. Backward walks buckets downward and meets the MoE unit's large expert bucket
    # first, so there that unit's small non-expert bucket is gathered at its own hook.
    "no_db_d1": BenchConfig("no_db_d1", ("--suggested-communication-unit-size", str(D1_UNIT_SIZE)),
                            "no double buffer, prefetch depth 1 unit (diagnostic)", None),
    "maxpool_ub": BenchConfig("maxpool_ub", ("--fsdp-double-buffer", MAXPOOL_FLAG, "--use-nccl-ub"),
                              "max-pool + NCCL user buffers (NVLS off)", "maxpool"),
    "maxpool_ub_graph": BenchConfig(
        "maxpool_ub_graph", ("--fsdp-double-buffer", MAXPOOL_FLAG, "--use-nccl-ub", *GRAPH_FLAGS),
        "max-pool + NCCL user buffers, full-iteration CUDA graph", "maxpool"),
    "no_db_graph": BenchConfig("no_db_graph", GRAPH_FLAGS,
                               "no double buffer, full-iteration CUDA graph", None),
    "maxpool_graph": BenchConfig("maxpool_graph", ("--fsdp-double-buffer", MAXPOOL_FLAG, *GRAPH_FLAGS),
                                 "max-pool double buffer, full-iteration CUDA graph", "maxpool"),
    # Three round-robin lanes: unit i in lane i % 3, three units live (prefetch two ahead).
    "maxpool_lanes3": BenchConfig("maxpool_lanes3", ("--fsdp-double-buffer", MAXPOOL_FLAG, LANES_FLAG, "3"),
                                  "max-pool double buffer, 3 lanes", "lanes"),
    "maxpool_lanes3_graph": BenchConfig(
        "maxpool_lanes3_graph", ("--fsdp-double-buffer", MAXPOOL_FLAG, LANES_FLAG, "3", *GRAPH_FLAGS),
        "max-pool double buffer, 3 lanes, full-iteration CUDA graph", "lanes"),
    "te_no_db": BenchConfig("te_no_db", TE_FLAGS, "Transformer Engine specs, no double buffer", None, "te"),
    "te_maxpool": BenchConfig("te_maxpool", (*TE_FLAGS, "--fsdp-double-buffer", MAXPOOL_FLAG),
                              "Transformer Engine specs, max-pool double buffer", "maxpool", "te"),
    "te_no_db_graph": BenchConfig("te_no_db_graph", (*TE_FLAGS, *GRAPH_FLAGS),
                                  "Transformer Engine specs, no double buffer, full-iteration CUDA graph",
                                  None, "te"),
    "te_maxpool_graph": BenchConfig(
        "te_maxpool_graph", (*TE_FLAGS, "--fsdp-double-buffer", MAXPOOL_FLAG, *GRAPH_FLAGS),
        "Transformer Engine specs, max-pool double buffer, full-iteration CUDA graph", "maxpool", "te"),
    "te_maxpool_ub_graph": BenchConfig(
        "te_maxpool_ub_graph", (*TE_FLAGS, "--fsdp-double-buffer", MAXPOOL_FLAG, "--use-nccl-ub", *GRAPH_FLAGS),
        "Transformer Engine specs, max-pool + NCCL user buffers, full-iteration CUDA graph", "maxpool", "te"),
    # Gradients reduce-scattered in bf16 (Megatron's --grad-reduce-in-bf16, which also leaves the
    # gradient buffers in the model's bf16, as the planner knows): half the bytes, and with registered
    # buffers NCCL's symmetric reduce-scatter kernels, which reduce in fp32. Not bit-identical to
    # te_no_db (fp32 buffers and reduction).
    "te_no_db_bf16rs": BenchConfig(
        "te_no_db_bf16rs", (*TE_FLAGS, BF16_RS_FLAG),
        "Transformer Engine specs, no double buffer, bf16 gradient reduce-scatter", None, "te"),
    "te_maxpool_graph_bf16rs": BenchConfig(
        "te_maxpool_graph_bf16rs", (*TE_FLAGS, "--fsdp-double-buffer", MAXPOOL_FLAG, *GRAPH_FLAGS, BF16_RS_FLAG),
        "Transformer Engine specs, max-pool, full-iteration CUDA graph, bf16 gradient reduce-scatter",
        "maxpool", "te"),
    "te_maxpool_ub_graph_bf16rs": BenchConfig(
        "te_maxpool_ub_graph_bf16rs", TE_MAXPOOL_UB_GRAPH_BF16RS,
        "Transformer Engine specs, max-pool + NCCL user buffers, full-iteration CUDA graph, bf16 "
        "gradient reduce-scatter", "maxpool", "te"),
    # The kernel fusions Megatron leaves off by default: Transformer Engine's MoE permute and router
    # (top-k, aux-loss) kernels, and Megatron's native fused cross entropy (its TE one is refused).
    # Eager with them, so that a base that cannot capture graphs is compared with its best flags too.
    "te_no_db_fused": BenchConfig(
        "te_no_db_fused", (*TE_FLAGS, *FUSION_FLAGS),
        "Transformer Engine specs, no double buffer, MoE permute/router and cross-entropy fusions", None, "te"),
    # Graphed max-pool + UB + bf16 reduce-scatter with the same fusions.
    "te_maxpool_ub_graph_bf16rs_fused": BenchConfig(
        "te_maxpool_ub_graph_bf16rs_fused", (*TE_MAXPOOL_UB_GRAPH_BF16RS, *FUSION_FLAGS),
        "Transformer Engine specs, max-pool + NCCL user buffers, full-iteration CUDA graph, bf16 gradient "
        "reduce-scatter, MoE permute/router and cross-entropy fusions", "maxpool", "te"),
    # The same with Megatron's --use-precision-aware-optimizer: Megatron-FSDP hands the reduced gradients to
    # Transformer Engine's FusedAdam as decoupled_grad in their own dtype (bf16 here) instead of casting each
    # shard to its fp32 main weights' dtype every step. Megatron-FSDP keeps its fp32 main weights; FusedAdam
    # writes the bf16 model weights in its update (megatron/core/optimizer/adam_model_writes.py).
    "te_maxpool_ub_graph_bf16rs_fused_pao": BenchConfig(
        "te_maxpool_ub_graph_bf16rs_fused_pao", (*TE_MAXPOOL_UB_GRAPH_BF16RS, *FUSION_FLAGS, PAO_FLAG),
        "Transformer Engine specs, max-pool + NCCL user buffers, full-iteration CUDA graph, bf16 gradient "
        "reduce-scatter, the fusions, precision-aware optimizer", "maxpool", "te"),
    # The same with the step path before first writes, multi-tensor copies, batched gradient writes
    # and model-weight writes in the optimizer step, each switched back alone ([Note: one-rank
    # gradient groups], 4 and 5; foreach_copy.py; [Note: Adam writes the model weights]): _fill fills
    # the gradient buffers every step, _pgw writes each autograd gradient into its main grad at once,
    # _smc copies the main weights to the model weights after the step, _ppc does so one parameter at
    # a time; _prev does all four. _sclip scales the gradients by the clip coefficient in a pass of
    # their own; _teadam also steps every tensor with TE's kernel ([Note: Triton Adam]); _tenorm takes the
    # gradient norm from TE's op, not the Triton kernels ([Note: Triton l2norm]).
    # _hre reads the step's statistics on the host every step, as upstream ([Note: host reads in a step]).
    **{f"te_maxpool_ub_graph_bf16rs_fused_pao_{suffix}": BenchConfig(
        f"te_maxpool_ub_graph_bf16rs_fused_pao_{suffix}", (*TE_MAXPOOL_UB_GRAPH_BF16RS, *FUSION_FLAGS, PAO_FLAG),
        f"te_maxpool_ub_graph_bf16rs_fused_pao {what}", "maxpool", "te", env)
       for suffix, what, env in (
           ("fill", "with the per-step zero fill of the gradient buffers", ((ZERO_GRAD_FILL_ENV, "1"),)),
           ("smc", "with the main-to-model copy after the optimizer step", ((SEPARATE_MODEL_COPIES_ENV, "1"),)),
           ("ppc", "with per-parameter main-to-model copies after the optimizer step",
            ((SEPARATE_MODEL_COPIES_ENV, "1"), (PER_PARAM_COPIES_ENV, "1"))),
           ("pgw", "with per-parameter gradient writes", ((PER_PARAM_GRAD_WRITES_ENV, "1"),)),
           ("sclip", "with the gradient clip in a separate pass", ((SEPARATE_CLIP_SCALE_ENV, "1"),)),
           ("teadam", "with TE's Adam kernel for every tensor and the gradient clip in a separate pass",
            ((TE_ADAM_KERNEL_ENV, "1"), (SEPARATE_CLIP_SCALE_ENV, "1"))),
           ("tenorm", "with the gradient norm from TE's multi_tensor_l2norm", ((TRITON_L2NORM_ENV, "0"),)),
           ("hre", "with upstream's host reads of the step's statistics every step", ((HOST_READS_ENV, "1"),)),
           ("prev", "with the zero fill, per-parameter copies after the step and per-parameter gradient writes",
            ((ZERO_GRAD_FILL_ENV, "1"), (SEPARATE_MODEL_COPIES_ENV, "1"), (PER_PARAM_COPIES_ENV, "1"),
             (PER_PARAM_GRAD_WRITES_ENV, "1"))))},
    # The same with Adam's moments in bf16: the optimizer step is memory-bound, so fewer bytes are the lever.
    "te_maxpool_ub_graph_bf16rs_fused_pao_bf16m": BenchConfig(
        "te_maxpool_ub_graph_bf16rs_fused_pao_bf16m",
        (*TE_MAXPOOL_UB_GRAPH_BF16RS, *FUSION_FLAGS, PAO_FLAG, *BF16_MOMENTS_FLAGS),
        "te_maxpool_ub_graph_bf16rs_fused_pao with Adam's moments in bf16", "maxpool", "te"),
    # The same in FP8, one configuration per Hopper recipe (GEMMs in FP8, parameters and optimizer as
    # before), and each with FP8 parameters (--fp8-param-gather: FP8 all-gathers and pool; blockwise ones are
    # re-quantized one pooled unit at a time, patch mfsdp-blockwise-fp8-requantize-per-unit).
    **{f"te_maxpool_ub_graph_bf16rs_fused_pao_fp8_{recipe}": BenchConfig(
        f"te_maxpool_ub_graph_bf16rs_fused_pao_fp8_{recipe}",
        (*TE_MAXPOOL_UB_GRAPH_BF16RS, *FUSION_FLAGS, PAO_FLAG, *flags),
        f"te_maxpool_ub_graph_bf16rs_fused_pao in FP8, {recipe} scaling", "maxpool", "te")
       for recipe, flags in FP8_RECIPES.items()},
    **{f"te_maxpool_ub_graph_bf16rs_fused_pao_fp8_{recipe}_pg": BenchConfig(
        f"te_maxpool_ub_graph_bf16rs_fused_pao_fp8_{recipe}_pg",
        (*TE_MAXPOOL_UB_GRAPH_BF16RS, *FUSION_FLAGS, PAO_FLAG, *FP8_RECIPES[recipe], "--fp8-param-gather"),
        f"te_maxpool_ub_graph_bf16rs_fused_pao in FP8, {recipe} scaling, FP8 parameters", "maxpool", "te")
       for recipe in FP8_RECIPES},
    # The same with three lanes: one more unit live, so all-gathers may run two units ahead.
    "te_maxpool_ub_lanes3_graph_bf16rs": BenchConfig(
        "te_maxpool_ub_lanes3_graph_bf16rs", (*TE_MAXPOOL_UB_GRAPH_BF16RS, LANES_FLAG, "3"),
        "Transformer Engine specs, max-pool with 3 lanes + NCCL user buffers, full-iteration CUDA graph, bf16 "
        "gradient reduce-scatter", "lanes", "te"),
    # The same with plain (not symmetric) registration: NCCL's ring kernels read and write the
    # registered buffers in place. On 4 x H200 (NCCL 2.28, NVLS off) the symmetric bf16
    # reduce-scatter kernels take 1.37-1.50x the ring's time from 64 MiB up (docs/results.md,
    # the message-size sweep), while the registered ring matches the plain one.
    "te_maxpool_ub_nosymm_graph_bf16rs": BenchConfig(
        "te_maxpool_ub_nosymm_graph_bf16rs", (*TE_MAXPOOL_UB_GRAPH_BF16RS, "--disable-symmetric-registration"),
        "Transformer Engine specs, max-pool + NCCL user buffers registered plainly (not symmetric), "
        "full-iteration CUDA graph, bf16 gradient reduce-scatter", "maxpool", "te"),
    # Diagnostic: Megatron's default --rerun-mode, kept explicitly, under the graph. Graphed runs
    # otherwise run it disabled (megatron/training/cuda_graph_rerun.py); this times the per-step
    # all-reduce and host sync that the change removes.
    "no_db_graph_validate": BenchConfig(
        "no_db_graph_validate", (*GRAPH_FLAGS, *VALIDATE_FLAGS),
        "no double buffer, full-iteration CUDA graph, --rerun-mode validate_results", None),
    "te_no_db_graph_validate": BenchConfig(
        "te_no_db_graph_validate", (*TE_FLAGS, *GRAPH_FLAGS, *VALIDATE_FLAGS),
        "Transformer Engine specs, no double buffer, full-iteration CUDA graph, "
        "--rerun-mode validate_results", None, "te"),
}


# Configuration flags that change the planned pool (the planner reads them with the model's):
# --grad-reduce-in-bf16 makes the gradient buffers, and so the grad pool, bf16.
PLAN_FLAGS = (BF16_RS_FLAG,)


def plan_flags(name: str) -> tuple[str, ...]:
    """The flags of configuration ``name`` that its planned pool depends on (PLAN_FLAGS)."""
    return tuple(f for f in CONFIGS[name].flags if f in PLAN_FLAGS)


def startup_class(name: str) -> tuple[str, bool]:
    """What a configuration's first process on a machine pays once, and later processes of the
    same class find cached: the layer spec's kernels (Triton, inductor, TE) and, with
    ``--use-nccl-ub``, Megatron's NCCL allocator extension. Graphed and eager runs of one spec
    share their kernels."""
    config = CONFIGS[name]
    return config.spec, config.user_buffers


def priming_configs(names: Sequence[str]) -> list[str]:
    """The first of ``names`` in each start-up class, in order: the runs that prime ([Note:
    priming] in hfsdp/bench/run.py)."""
    seen: set[tuple[str, bool]] = set()
    out = []
    for name in names:
        if (cls := startup_class(name)) not in seen:
            seen.add(cls)
            out.append(name)
    return out


# maxpool_ub is opt-in (--configs ...,maxpool_ub): --use-nccl-ub JIT-builds megatron's NCCL
# allocator extension (load_inline, needs nvcc, nccl.h and libnccl.so), unproven on the GPU box.
DEFAULT_CONFIGS = ("no_db", "maxpool", "no_db_graph", "maxpool_graph")
# TE vs local, eager vs graphed, no-db vs max-pool in one invocation (needs Transformer Engine).
TE_COMPARISON = (*DEFAULT_CONFIGS, "te_no_db", "te_maxpool", "te_no_db_graph", "te_maxpool_graph")

# "Fills most of an H200": 5.9B-param hybrid (24 layers, hidden 4096, 16 experts), seq 4096, at
# DP=2 (its peak memory is in docs/results.md).
FILL_GPU_OVERRIDES = (
    "--hybrid-layer-pattern", "M*E" * 8, "--hidden-size", "4096", "--num-attention-heads", "32",
    "--ffn-hidden-size", "16384", "--moe-ffn-hidden-size", "4096", "--num-experts", "16",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
)
# "Fills most of one 80 GB GPU": 2.0B-param hybrid (18 layers, hidden 3072, 16 experts), seq
# 4096, at DP=1 (one H100); the single-GPU CUDA-graph benchmark's large preset.
FILL80_OVERRIDES = (
    "--hybrid-layer-pattern", "M*E" * 6, "--hidden-size", "3072", "--num-attention-heads", "24",
    "--ffn-hidden-size", "12288", "--moe-ffn-hidden-size", "2048", "--num-experts", "16",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
)
# "Fills most of one 80 GB GPU with experts": the default hybrid four times deeper (M*E x 16, 48
# layers) with 80 experts per MoE layer, 2.94B params, at the default's hidden size, sequence and
# micro-batch. Parameters, gradients and optimizer state (18 bytes a parameter, 52.9 GB) rather
# than sequence-length activations fill the GPU, so compute per step stays small and many small
# expert kernels dominate: the regime of fine-grained MoE at small per-GPU batch, built so that
# the host rather than the GPU limits an eager step (its step times and memory, eager and
# graphed, are in docs/results.md). fill80 is the compute-bound counterpart.
FILL80_EXPERTS_OVERRIDES = ("--hybrid-layer-pattern", "M*E" * 16, "--num-experts", "80")
# "What users train": the fill model (5.9B params, 24 layers M*E x 8, hidden 4096, seq 4096, 16
# experts top-2, bf16) with Mamba's fused path (causal-conv1d), for the te_* configurations only;
# experts are spread over up to REALISTIC_EP ranks (parallel_flags). It keeps Megatron's default
# --gradient-accumulation-fusion, as NVIDIA's containers run it: TE's layers write their weight
# gradients into the fp32 main grads, and the output layer (a local ColumnParallelLinear) through
# Apex's fused_weight_gradient_mlp_cuda, which it therefore needs.
REALISTIC_OVERRIDES = FILL_GPU_OVERRIDES
REALISTIC_EP = 4
# The realistic model cut to one GPU at DP=1: 12 layers (M*E x 4), global batch 2 (two
# micro-batches of 1), everything else the realistic preset's.
REALISTIC_1GPU_OVERRIDES = (*(f if f != "M*E" * 8 else "M*E" * 4 for f in REALISTIC_OVERRIDES),
                            "--global-batch-size", "2")
REALISTIC_PRESETS = ("realistic", "realistic_1gpu")
PRESETS = {"default": (), "fill": FILL_GPU_OVERRIDES, "fill80": FILL80_OVERRIDES,
           "fill80_experts": FILL80_EXPERTS_OVERRIDES, "realistic": REALISTIC_OVERRIDES,
           "realistic_1gpu": REALISTIC_1GPU_OVERRIDES}
# Flags of the default model a preset removes (a switch cannot be overridden by a value).
PRESET_DROPS = {p: ("--disable-mamba-mem-eff-path", "--no-gradient-accumulation-fusion") for p in REALISTIC_PRESETS}
# Presets built for one layer spec: the configurations of any other spec are refused.
PRESET_SPECS = {p: "te" for p in REALISTIC_PRESETS}
# Python modules a preset needs on the machine that runs it (checked before the first run).
PRESET_NEEDS = {p: ("transformer_engine", "causal_conv1d", "fused_weight_gradient_mlp_cuda") for p in REALISTIC_PRESETS}


def override_flags(base: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """``base`` with every ``--flag [value]`` in ``overrides`` replacing the same flag in base;
    ``--flag=value`` is written ``--flag value`` (one spelling, so that it replaces and is read)."""

    def split(flags: Sequence[str]) -> list[list[str]]:
        groups: list[list[str]] = []
        for tok in flags:
            if tok.startswith("--") and "=" in tok:
                groups.append(tok.split("=", 1))
            elif tok.startswith("--") or not groups:
                groups.append([tok])
            else:
                groups[-1].append(tok)
        return groups

    over = split(overrides)
    names = {g[0] for g in over}
    return [t for g in split(base) if g[0] not in names for t in g] + [t for g in over for t in g]


def model_flags(preset: str, extra: Sequence[str] = ()) -> list[str]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    base = [f for f in DEFAULT_MODEL_FLAGS if f not in PRESET_DROPS.get(preset, ())]
    return override_flags(override_flags(base, PRESETS[preset]), extra)


def with_data(flags: Sequence[str], prefix: str) -> list[str]:
    """``flags`` training on the indexed dataset ``prefix`` instead of mock data (refused, before
    any run, when ``prefix.bin`` or ``prefix.idx`` is not a file)."""
    if missing := [prefix + s for s in (".bin", ".idx") if not os.path.isfile(prefix + s)]:
        raise UserError(f"--data-path {prefix}: {', '.join(missing)} "
                        f"{'is not a file' if len(missing) == 1 else 'are not files'}",
                        "give the prefix of an indexed dataset (python -m hfsdp.bench.markov_data "
                        "--out PREFIX writes one)")
    return override_flags([f for f in flags if f != "--mock-data"], ["--data-path", prefix])


def parallel_flags(preset: str, nproc: int) -> list[str]:
    """The parallel layout a preset sets for ``nproc`` ranks: the realistic preset's experts over
    gcd(nproc, REALISTIC_EP) ranks (expert parallelism must divide the world), none elsewhere."""
    if preset in REALISTIC_PRESETS and (ep := math.gcd(nproc, REALISTIC_EP)) > 1:
        return ["--expert-model-parallel-size", str(ep)]
    return []


def preset_refusal(preset: str, names: Sequence[str]) -> str | None:
    """None when every configuration of ``names`` suits ``preset``, else why not (one sentence)."""
    spec = PRESET_SPECS.get(preset)
    other = [n for n in names if spec is not None and CONFIGS[n].spec != spec]
    if other:
        return (f"the {preset} preset is built for {spec} layer specs, and {', '.join(other)} "
                f"use{'s' if len(other) == 1 else ''} {CONFIGS[other[0]].spec} ones")
    return None


def availability(name: str) -> str | None:
    """None when config ``name`` can run here, else the reason it is skipped.

    The fork's own patches (max-pool flags, the NVLS-respecting NCCL allocator) are always in
    this tree, so nothing here probes for them: a missing patch must fail the run, not skip it.
    """
    if name not in CONFIGS:
        return f"unknown configuration {name!r}"
    # NCCL user-buffer configs run under whatever NCCL_NVLS_ENABLE the caller's environment (or
    # --env) sets: NVLink multicast is the cluster's choice, the fork's allocator keeps it.
    return None


def loss_baseline(name: str) -> str:
    """The configuration whose lm loss ``name``'s must equal bit for bit: its eager twin.

    Double buffering, graphs and user buffers must not change a bit; NUMERICS_FLAGS may. So the
    twin is the spec's baseline (BASELINES) with ``name``'s NUMERICS_FLAGS added: te_no_db for
    te_maxpool_graph, te_no_db_bf16rs for te_maxpool_ub_graph_bf16rs. Where no configuration is
    that twin, ``name`` itself: its repeats are held to each other (the most common sequence)."""
    config = CONFIGS[name]
    base = CONFIGS[BASELINES[config.spec]]
    wanted = set(base.flags) | (set(config.flags) & NUMERICS_FLAGS)
    return next((c.name for c in CONFIGS.values() if c.spec == config.spec and set(c.flags) == wanted), name)


def loss_groups(names: Sequence[str]) -> dict[str, list[str]]:
    """Baseline -> the configurations among ``names`` whose losses are held to it (loss_baseline)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(loss_baseline(name), []).append(name)
    return groups
