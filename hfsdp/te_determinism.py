"""The settings under which two Transformer Engine (TE) runs in separate processes give the same bits.

[Note: deterministic TE runs]
Read off TE 2.20.2 (its PyTorch package and the common library's GEMM and fused-attention
code), Megatron 0.18.2 as materialized here, mamba_ssm 2.3.2.post1 and causal-conv1d 1.7.0.
What GPU runs under them have shown, and what they have not covered yet, is recorded in
docs/transformer-engine.md and docs/results.md, not here. One place for them: the functional cases
take them with ``DETERMINISM: transformer_engine`` in model_config.yaml
(hfsdp/functional/recipe.py) and the benchmark with ``--deterministic`` (hfsdp/bench/run.py).
Each setting says why it is needed; ``NOT_SET`` says what was looked at and deliberately left
alone.

Kernel choice across processes is the one part that differs by use: the functional cases pin
Triton's autotuners to their first valid config (``HFSDP_TRITON_PIN_AUTOTUNE=1``, same choice on
every machine of a kind); the benchmark shares one timed choice between the processes of an
invocation (``TRITON_CACHE_AUTOTUNING=1``), so its kernels stay the fast ones.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PROFILE = "transformer_engine"  # the name recipes give after DETERMINISM:

TritonChoice = Literal["pin", "cache"]


@dataclass(frozen=True)
class Setting:
    """An environment variable or a Megatron flag (``value`` True: a bare flag) and why it is set."""

    name: str
    value: str | bool
    why: str


ENV: tuple[Setting, ...] = (
    Setting("NCCL_ALGO", "Ring",
            "--deterministic-mode asserts that NCCL_ALGO names one algorithm (Tree, Ring, ...); one "
            "fixed algorithm fixes the summation order of every collective."),
    Setting("CUBLAS_WORKSPACE_CONFIG", ":4096:8",
            "torch's own cuBLAS calls (the non-TE matmuls, e.g. the output layer): older torch "
            "raises under torch.use_deterministic_algorithms without it; newer torch gives each "
            "handle and stream its own workspace and no longer asks. TE's GEMMs use cuBLASLt with "
            "workspaces TE allocates, which this does not touch."),
    Setting("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0",
            "Megatron's TEDotProductAttention refuses --deterministic-mode without it; with it (and "
            "torch's deterministic flag, which TE 2.20 also reads) TE keeps only attention backends "
            "whose backward is deterministic and asks cuDNN for its deterministic backward."),
    Setting("CAUSAL_CONV1D_DETERMINISTIC", "1",
            "causal-conv1d 1.7 sums the weight and bias gradients of its backward with atomicAdd "
            "unless deterministic; it reads this variable first, then torch's deterministic flag. "
            "Explicit, so the fused Mamba path (and the non-fused one, which calls causal_conv1d_fn "
            "whenever causal-conv1d is installed) does not hang on that flag."),
    Setting("PYTHONHASHSEED", "0",
            "as in every recipe of this project: no string-hash randomization, so any iteration "
            "over a set of names runs in the same order in every process."),
)
TRITON: dict[TritonChoice, Setting] = {
    "pin": Setting("HFSDP_TRITON_PIN_AUTOTUNE", "1",
                   "Triton autotuners (mamba_ssm's SSD kernels) time their candidates per process and "
                   "may pick other block sizes, i.e. another summation order; pinned, every process "
                   "takes the first valid config (hfsdp/determinism.py)."),
    "cache": Setting("TRITON_CACHE_AUTOTUNING", "1",
                     "the same problem for the benchmark: the first process times the candidates and "
                     "caches its choice, later processes of the invocation reuse it."),
}
FLAGS: tuple[Setting, ...] = (
    Setting("--deterministic-mode", True,
            "calls torch.use_deterministic_algorithms(True) in validate_args, before any kernel runs: "
            "TE's attention, mamba_ssm 2.3's SSD backward (workspace sums instead of atomic adds), "
            "causal-conv1d's backward and the MoE unpermute (index_add_) all take their "
            "deterministic variants from it."),
    Setting("--attention-backend", "fused",
            "Megatron then sets NVTE_FLASH_ATTN=0, NVTE_FUSED_ATTN=1, NVTE_UNFUSED_ATTN=0: every "
            "process runs cuDNN fused attention (the F16/BF16 arbitrary-seqlen sub-backend, whose "
            "deterministic backward TE allows on sm90 without a trainable bias), with engines chosen "
            "by cuDNN's heuristics, not by timing. It is what auto picks where flash-attn is not "
            "installed; pinned, neither an installed flash-attn nor a per-call backend choice can "
            "differ between processes. Never set those three variables yourself: validate_args "
            "rejects values that contradict the flag (te_arg_checks)."),
)
# Flags that Megatron 0.18.2's validate_args refuses together with --deterministic-mode.
REFUSED: tuple[Setting, ...] = (
    Setting("--cross-entropy-loss-fusion", True, "Megatron: \"Cross Entropy Fusion is currently not deterministic.\""),
    Setting("--use-flash-attn", True, "Megatron: \"Flash attention can not be used in deterministic mode.\""),
)
NOT_SET: tuple[Setting, ...] = (
    Setting("grouped GEMM", "no setting",
            "TE's GroupedLinear runs one cuBLASLt GEMM per expert over up to 4 streams, each with its "
            "own workspace; the algorithm comes from cuBLASLt's heuristic for the shapes, workspace "
            "size and SM count, so it is the same in every process on one GPU kind, and no atomics "
            "were found on this path. With drop-and-pad the per-expert shapes are static as well."),
    Setting("NVTE_USE_CUTLASS_GROUPED_GEMM, NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM, "
            "NVTE_NORM_FWD_USE_CUDNN, NVTE_NORM_BWD_USE_CUDNN, NVTE_FUSED_ATTN_USE_FAv2_BWD", "unset",
            "their defaults (off) keep the paths read above; the alternatives were not examined."),
    Setting("--moe-permute-fusion, --moe-router-fusion", "off",
            "Megatron's defaults; TE's fused MoE kernels were not examined."),
    Setting("MAMBA_DETERMINISTIC", "unset",
            "mamba_ssm is imported before validate_args; set, it would shrink its kernels' autotune "
            "lists at import to the cheapest config (another kernel choice than the local-spec "
            "goldens). Its backward reductions follow torch's deterministic flag at run time anyway."),
)


def env(triton: TritonChoice = "pin") -> dict[str, str]:
    """The environment of a deterministic TE run (see the note for ``triton``)."""
    assert triton in TRITON, f"unknown Triton choice {triton!r}; known: {sorted(TRITON)}"
    return {s.name: str(s.value) for s in (*ENV, TRITON[triton])}


def flags() -> dict[str, str | bool]:
    """The Megatron flags, as a model_config.yaml MODEL_ARGS mapping (True: a bare flag)."""
    return {s.name: s.value for s in FLAGS}


def argv() -> list[str]:
    """The Megatron flags as command-line arguments."""
    out: list[str] = []
    for name, value in flags().items():
        out += [name] if value is True else [name, str(value)]
    return out


def refused(flags: Sequence[str]) -> list[str]:
    """The flags of ``flags`` that Megatron refuses under ``--deterministic-mode`` (REFUSED), in order."""
    names = {s.name for s in REFUSED}
    return list(dict.fromkeys(f for f in flags if f in names))


def describe() -> str:
    """Every setting with its reason (the benchmark prints it under ``--deterministic``)."""
    lines = ["Deterministic Transformer Engine runs:"]
    for s in (*ENV, *TRITON.values(), *FLAGS):
        lines.append(f"- {s.name}={s.value}: {s.why}" if s.value is not True else f"- {s.name}: {s.why}")
    lines.append("Deliberately not set:")
    lines += [f"- {s.name} ({s.value}): {s.why}" for s in NOT_SET]
    return "\n".join(lines)
