"""validate_args rejects Transformer Engine combinations 0.18.2 cannot run as asked, naming the fix
(megatron/training/te_arg_checks.py, patch training-te-arg-checks).

Runs Megatron's real parser and ``validate_args`` (CPU, world of 1) on the materialized fork.
"""

from __future__ import annotations

import sys

import pytest
import torch

import megatron.training.arguments as arguments
from megatron.training.te_arg_checks import ATTN_ENV, te_arg_problems

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --bf16 --lr 1e-4 --train-iters 2 "
    "--ckpt-format fsdp_dtensor --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
    "--use-distributed-optimizer"
).split()
TE = ["--transformer-impl", "transformer_engine"]
LOCAL = ["--transformer-impl", "local"]
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64".split()
DET = ["--deterministic-mode"]
NONDET_ENV = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"


@pytest.fixture
def validate(monkeypatch):
    """validate_args on ``flags`` with ``env`` set; returns the args or raises its ValueError."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("NCCL_ALGO", "Ring")  # --deterministic-mode asserts it
    for key in ("CUDA_DEVICE_MAX_CONNECTIONS", NONDET_ENV, *ATTN_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # --moe-grouped-gemm
    deterministic = torch.are_deterministic_algorithms_enabled()  # --deterministic-mode sets it

    def run(flags, env=None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(sys, "argv", ["pretrain", *BASE, *flags])
        args = arguments.parse_args()
        arguments.validate_args(args, {})
        return args

    yield run
    torch.use_deterministic_algorithms(deterministic)


def rejected(validate, flags, env=None) -> str:
    with pytest.raises(ValueError) as err:
        validate(flags, env)
    msg = str(err.value)
    assert msg.startswith("Transformer Engine arguments that cannot run on this tree"), msg
    return msg


@pytest.mark.parametrize("value, shown", [(None, "unset"), ("1", "'1'"), ("yes", "'yes'")])
def test_deterministic_te_attention_needs_the_nondeterministic_switch_off(validate, value, shown):
    env = {} if value is None else {NONDET_ENV: value}
    msg = rejected(validate, TE + DET, env)
    assert f"NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 in the environment (it is {shown})" in msg, msg
    assert "Export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in msg, msg


@pytest.mark.parametrize("flags, env", [
    (TE + DET, {NONDET_ENV: "0"}),
    (LOCAL + DET, {}),  # local attention: Megatron's own DotProductAttention
    (TE + DET + ["--hybrid-layer-pattern", "M-"], {}),  # no attention layer
    (TE, {}),  # not deterministic
])
def test_deterministic_mode_accepted_without_te_attention_or_with_the_switch(validate, flags, env):
    assert validate(flags, env).deterministic_mode == ("--deterministic-mode" in flags)


def test_hybrid_pattern_with_attention_counts(validate):
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in rejected(validate, TE + DET + ["--hybrid-layer-pattern", "M*"])


@pytest.mark.parametrize("flags, env, names, suggested", [
    ([], {"NVTE_FUSED_ATTN": "0"}, "NVTE_FUSED_ATTN=0", "flash"),
    ([], {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
     "NVTE_FLASH_ATTN=0, NVTE_FUSED_ATTN=1, NVTE_UNFUSED_ATTN=0", "fused"),
    (["--attention-backend", "fused"], {"NVTE_FLASH_ATTN": "1"}, "NVTE_FLASH_ATTN=1", "auto"),
])
def test_attention_switches_in_the_environment_must_match_the_backend(validate, flags, env, names,
                                                                       suggested):
    msg = rejected(validate, TE + flags, env)
    backend = flags[1] if flags else "auto"
    assert f"{names} in the environment contradict" in msg and f"--attention-backend {backend}" in msg, msg
    assert f"or pass --attention-backend {suggested}, which they describe" in msg, msg


@pytest.mark.parametrize("flags, env", [
    (["--attention-backend", "fused"], {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1"}),
    ([], {"NVTE_FLASH_ATTN": "1"}),
    (["--attention-backend", "fused"], {}),
])
def test_attention_switches_that_agree_are_accepted(validate, flags, env):
    validate(TE + flags, env)


def test_no_backend_matches_contradictory_switches(validate):
    msg = rejected(validate, TE, {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "1"})
    assert "no --attention-backend matches them all" in msg, msg


def test_grouped_gemm_with_local_specs_is_rejected(validate):
    msg = rejected(validate, LOCAL + MOE + ["--moe-grouped-gemm"])
    assert "--moe-grouped-gemm has no effect with --transformer-impl local" in msg, msg
    assert "Drop --moe-grouped-gemm, or use --transformer-impl transformer_engine" in msg, msg


@pytest.mark.parametrize("flags", [TE + MOE + ["--moe-grouped-gemm"], LOCAL + ["--moe-grouped-gemm"], LOCAL + MOE])
def test_grouped_gemm_accepted_with_te_or_without_experts(validate, flags):
    validate(flags)


@pytest.fixture
def parsed(megatron_args):
    return lambda flags: megatron_args([*BASE, *flags])


FP8 = "--fp8-format e4m3 --fp8-param-gather --fsdp-double-buffer --megatron-fsdp-max-pool-double-buffer".split()
MAX_POOL = ["--fsdp-double-buffer", "--megatron-fsdp-max-pool-double-buffer"]


@pytest.mark.parametrize("double_buffer", [
    MAX_POOL,
    MAX_POOL + ["--megatron-fsdp-max-pool-lanes", "3"],
    ["--fsdp-double-buffer"],  # 0.18.2's FixedPool
    ["--use-nccl-ub"],  # implies a double buffer
    MAX_POOL + ["--use-nccl-ub"],
])
def test_any_double_buffer_takes_blockwise_fp8_params(parsed, double_buffer):
    """Re-quantized one pooled unit at a time (patch mfsdp-blockwise-fp8-requantize-per-unit)."""
    flags = TE + "--fp8-format e4m3 --fp8-param-gather --fp8-recipe blockwise".split() + double_buffer
    assert te_arg_problems(parsed(flags), environ={}) == []


@pytest.mark.parametrize("drop, add", [
    ([], ["--fp8-recipe", "tensorwise"]),
    ([], ["--fp8-recipe", "delayed"]),
    (["--fp8-param-gather"], ["--fp8-recipe", "blockwise"]),
    (MAX_POOL, ["--fp8-recipe", "blockwise"]),  # no double buffer: buckets allocated as needed
])
def test_other_fp8_combinations_are_not_rejected(parsed, drop, add):
    flags = [f for f in TE + FP8 if f not in drop] + add
    assert te_arg_problems(parsed(flags), environ={}) == []


@pytest.mark.parametrize("arch, refused", [(9, True), (8, True), (10, False), (12, False)])
def test_mxfp8_needs_blackwell(parsed, arch, refused):
    args = parsed(TE + "--fp8-format e4m3 --fp8-recipe mxfp8".split())
    problems = te_arg_problems(args, environ={}, device_arch=arch)
    assert bool(problems) == refused, problems
    if refused:
        assert f"needs a GPU of compute capability 10 or more (Blackwell), this one has {arch}" in problems[0]
        assert "Use --fp8-recipe delayed, tensorwise or blockwise." in problems[0], problems


def test_mxfp8_on_hopper_is_refused_by_validate_args(validate):
    """The whole path: validate_args asks the (assumed Hopper) GPU for its compute capability."""
    msg = rejected(validate, TE + "--fp8-format e4m3 --fp8-recipe mxfp8".split())
    assert "--fp8-recipe mxfp8 needs a GPU of compute capability 10" in msg, msg


def test_every_problem_is_reported_at_once(parsed):
    args = parsed(LOCAL + MOE + DET + FP8 + ["--moe-grouped-gemm", "--fp8-recipe", "mxfp8"])
    args.transformer_impl = "transformer_engine"  # TE attention and local grouped GEMM cannot coexist
    assert len(te_arg_problems(args, environ={"NVTE_UNFUSED_ATTN": "0"}, device_arch=9)) == 3
    args.transformer_impl = "local"
    assert len(te_arg_problems(args, environ={"NVTE_UNFUSED_ATTN": "0"}, device_arch=9)) == 3


HYBRID = ["--hybrid-layer-pattern", "M*", "--num-layers", "2"]


@pytest.mark.parametrize("hidden, heads, refused", [
    (64, None, True),  # 2 heads of 64: 2 * 128 + 2 * 8 * 128 + 2 = 2306
    (64, 16, False),  # 16 heads: 2 * 1024 + 2048 + 16 = 4112 = 16 x 257
    (4096, None, False),  # the realistic preset: 128 heads, 18,560 wide
])
def test_fp8_mamba_projection_width(parsed, hidden, heads, refused):
    flags = TE + HYBRID + ["--hidden-size", str(hidden), "--fp8-format", "e4m3"]
    if heads is not None:
        flags += ["--mamba-num-heads", str(heads)]
    problems = te_arg_problems(parsed(flags), environ={})
    assert bool(problems) == refused, problems
    if refused:
        assert "this one is 2306" in problems[0] and "Pass --mamba-num-heads 16" in problems[0], problems[0]


def test_fp8_mamba_width_is_megatrons(parsed):
    """The width the check computes is the one MambaMixer asserts on (its own arithmetic, read back)."""
    import inspect

    from megatron.core.ssm import mamba_mixer

    source = inspect.getsource(mamba_mixer.MambaMixer.__init__)
    assert "(2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads) % 16 == 0" in source
    assert "self.d_inner = int(self.expand * self.d_model)" in source
    assert inspect.signature(mamba_mixer.MambaMixer.__init__).parameters["expand"].default == 2
    assert not te_arg_problems(parsed(TE + HYBRID + ["--hidden-size", "64"]), environ={})  # bf16: no check


PAO = ["--use-precision-aware-optimizer"]
OPT_GRAPH = ["--optimizer-cuda-graph"]
BF16_MOMENTS = ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
TENSORWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]


@pytest.mark.parametrize("flags, refused", [
    (PAO + OPT_GRAPH, "stores fp32 ones with parameter remainders"),  # TE keeps fp32 master weights
    (PAO + OPT_GRAPH + ["--fp8-format", "e4m3", "--fp8-recipe", "delayed"], "remainders"),  # TE keeps them too
    (PAO + OPT_GRAPH + ["--main-params-dtype", "fp16"], "takes only fp32 ones"),  # fp16 master weights
    (PAO + OPT_GRAPH + TENSORWISE + ["--main-params-dtype", "fp16"], "takes only fp32 ones"),
    (PAO + OPT_GRAPH + TENSORWISE, None),  # Megatron keeps the master weights
    (PAO + OPT_GRAPH + TENSORWISE + BF16_MOMENTS, None),
    (PAO + OPT_GRAPH + TENSORWISE + ["--exp-avg-dtype", "bf16"], "both fp32 or both bf16"),
    (PAO + OPT_GRAPH + TENSORWISE + ["--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype", "fp16"], "both fp32 or both"),
    (PAO + OPT_GRAPH + ["--optimizer-cpu-offload"], None),  # HybridDeviceOptimizer
    (OPT_GRAPH, None),
    (PAO, None),
])
def test_optimizer_graph_with_the_precision_aware_optimizer(parsed, flags, refused):
    problems = te_arg_problems(parsed(TE + flags), environ={})
    assert len(problems) == (refused is not None), problems
    if refused:
        assert refused in problems[0] and "Drop --optimizer-cuda-graph" in problems[0], problems[0]


def test_optimizer_graph_with_the_precision_aware_optimizer_is_refused_by_validate_args(validate):
    msg = rejected(validate, TE + PAO + OPT_GRAPH)
    assert "--optimizer-cuda-graph with --use-precision-aware-optimizer" in msg, msg


def test_megatron_builds_te_adam_as_the_check_reads_it():
    """The kwargs the check is about, read from Megatron's own source: capturable from --optimizer-cuda-graph,
    and with the precision-aware optimizer the moment dtypes, master weights and parameter remainders."""
    import inspect

    from megatron.core import optimizer

    source = inspect.getsource(optimizer._get_megatron_optimizer_based_on_param_groups)
    for kwarg in ('"capturable": config.optimizer_cuda_graph', '"exp_avg_dtype": config.exp_avg_dtype',
                  '"exp_avg_sq_dtype": config.exp_avg_sq_dtype', '"master_weights": True',
                  '"master_weight_dtype": config.main_params_dtype',
                  '{"store_param_remainders": config.store_param_remainders}',
                  "if config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:"):
        assert kwarg in source, kwarg


@pytest.mark.parametrize("main_dtype, recipe, offload", [
    (torch.float32, None, False), (torch.float32, "delayed", False), (torch.float32, "tensorwise", False),
    (torch.float32, "blockwise", False), (torch.float16, None, False), (torch.float16, "tensorwise", False),
    (torch.float32, None, True),
])
def test_the_refusal_is_megatrons_master_weight_condition(monkeypatch, main_dtype, recipe, offload):
    """With fp32 or bf16 moments the check refuses where Megatron's OptimizerConfig has TE's FusedAdam keep master
    weights (use_precision_aware_optimizer_no_fp8_or_ds_fp8, read back from Megatron's own config)."""
    import types

    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.training.te_arg_checks import _optimizer_graph_problem

    class FusedAdam:  # the signature OptimizerConfig checks for; no TE needed on a CPU machine
        def __init__(self, master_weight_dtype=None, exp_avg_dtype=None, exp_avg_sq_dtype=None,
                     use_decoupled_grad=False):
            pass

    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    optimizers.FusedAdam = FusedAdam  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.optimizers", optimizers)
    config = OptimizerConfig(use_precision_aware_optimizer=True, use_distributed_optimizer=True, bf16=True,
                             main_params_dtype=main_dtype, fp8_recipe=recipe, optimizer_cpu_offload=offload)
    args = types.SimpleNamespace(optimizer_cuda_graph=True, use_precision_aware_optimizer=True,
                                 optimizer_cpu_offload=offload, main_params_dtype=main_dtype, fp8_recipe=recipe,
                                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)
    master_weights = config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 and not offload
    assert (_optimizer_graph_problem(args) is not None) == master_weights
