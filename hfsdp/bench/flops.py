"""Model FLOPs per token and MFU of a ``pretrain`` run, from its flags (no GPU).

[Note: model FLOPs]
A training step is counted as three forward passes (forward, and backward's two matrix products
per weight), with no recomputation: the work the model needs, not what a configuration does
(activation recomputation, padding to capacity beyond the router's choice, and the optimizer are
not model FLOPs). A multiply-add is 2 FLOPs. Per token and layer, with hidden size h, sequence s:

* attention (``*``): the Q, K, V and output projections, ``2h(q + 2kv) + 2qh`` with q = heads x
  kv_channels and kv = query groups x kv_channels, and the score and value products over the full
  s x s square, ``4sq`` (a causal mask computes half of it; PaLM's and Megatron's counts use the
  square);
* MLP (``-``): ``2h f (2 if gated) + 2 f h`` for FFN size f;
* MoE (``E``): the router ``2hE`` and the top-k experts a token is routed to, each an MLP of
  ``moe_ffn`` (shared experts too; the padding of drop-and-pad is not model work);
* Mamba (``M``, Mamba-2): in_proj ``2h(2d + 2gN + H)``, the depthwise conv ``2K(d + 2gN)``, the chunked
  scan's products over full Q x Q chunk blocks ``2Q(gN + d) + 4Nd``, out_proj ``2dh``, for inner size
  d, g groups, state N, H heads, conv width K, chunk Q;
* the output layer ``2hV`` for the padded vocabulary V (the embedding is a lookup: 0).

MFU = tokens per second per GPU x training FLOPs per token / the GPU's dense bf16 peak. The peak
of H100 SXM and H200 is 989 TFLOP/s; for other devices it is unknown unless given. A run in FP8
(``--fp8-format``) is also reported against the dense FP8 peak, 1,979 TFLOP/s on both: its GEMMs
may run at that rate, the rest of the step cannot, so the two bracket it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM boards
PEAK_FP8_TFLOPS = {"H100": 1979.0, "H200": 1979.0}  # dense FP8, SXM boards
TRAINING_PASSES = 3  # forward + backward (two products per weight)
MAMBA_EXPAND, MAMBA_CONV, MAMBA_CHUNK = 2, 4, 128  # MambaMixer's defaults


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs per token by part, and the training total."""

    attention: float
    mlp: float
    moe: float
    mamba: float
    output: float

    @property
    def forward(self) -> float:
        return self.attention + self.mlp + self.moe + self.mamba + self.output

    @property
    def training(self) -> float:
        return TRAINING_PASSES * self.forward


def padded_vocab(args: argparse.Namespace) -> int:
    """Megatron's padded vocabulary: a multiple of make_vocab_size_divisible_by x TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(args.vocab_size / multiple) * multiple)


def layer_symbols(args: argparse.Namespace) -> str:
    """The layer pattern: ``--hybrid-layer-pattern`` (pipeline separators and MTP part dropped), or
    a GPT's layers (attention + MLP, or + MoE with experts) as ``*-`` / ``*E`` pairs."""
    pattern = args.hybrid_layer_pattern
    if pattern:
        return "".join(c for c in pattern.split("/")[0] if c in "M*-E")
    return ("*E" if args.num_experts else "*-") * args.num_layers


def _mlp(h: int, ffn: int, gated: bool) -> float:
    return 2 * h * ffn * (2 if gated else 1) + 2 * ffn * h


def model_flops(args: argparse.Namespace) -> ModelFlops:
    """[Note: model FLOPs] for parsed ``pretrain`` flags (Megatron's parser)."""
    h, s = args.hidden_size, args.seq_length
    kv_channels = args.kv_channels or h // args.num_attention_heads
    q = args.num_attention_heads * kv_channels
    kv = (args.num_query_groups if args.group_query_attention else args.num_attention_heads) * kv_channels
    gated = bool(args.swiglu)
    symbols = layer_symbols(args)
    attention = symbols.count("*") * (2 * h * (q + 2 * kv) + 2 * q * h + 4 * s * q)
    mlp = symbols.count("-") * _mlp(h, args.ffn_hidden_size, gated)
    moe = 0.0
    if symbols.count("E"):
        experts, k = args.num_experts, args.moe_router_topk
        per_layer = 2 * h * experts + k * _mlp(h, args.moe_ffn_hidden_size or args.ffn_hidden_size, gated)
        if args.moe_shared_expert_intermediate_size:
            per_layer += _mlp(h, args.moe_shared_expert_intermediate_size, gated)
        moe = symbols.count("E") * per_layer
    mamba = 0.0
    if symbols.count("M"):
        d = args.mamba_num_heads * args.mamba_head_dim if args.mamba_num_heads else MAMBA_EXPAND * h
        heads, g, n = d // args.mamba_head_dim, args.mamba_num_groups, args.mamba_state_dim
        per_layer = (2 * h * (2 * d + 2 * g * n + heads) + 2 * MAMBA_CONV * (d + 2 * g * n)
                     + 2 * MAMBA_CHUNK * (g * n + d) + 4 * n * d + 2 * d * h)
        mamba = symbols.count("M") * per_layer
    return ModelFlops(float(attention), float(mlp), float(moe), float(mamba), float(2 * h * padded_vocab(args)))


def peak_flops(device: str | None, given_tflops: float | None = None, fp8: bool = False) -> float | None:
    """FLOP/s of one GPU at dense bf16 (``fp8``: dense FP8): ``given_tflops`` if given, else by the
    device's name (None: unknown, so no MFU is reported)."""
    if given_tflops is not None:
        return given_tflops * 1e12
    for name, tflops in (PEAK_FP8_TFLOPS if fp8 else PEAK_BF16_TFLOPS).items():
        if device and name in device:
            return tflops * 1e12
    return None


def mfu(tokens_per_s: float, gpus: int, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilization of ``gpus`` GPUs (None without a peak)."""
    if peak is None or gpus < 1:
        return None
    return tokens_per_s / gpus * flops_per_token / peak
