"""Model FLOPs per token and MFU ([Note: model FLOPs] in hfsdp/bench/flops.py), against hand counts."""

from __future__ import annotations

import argparse

import pytest

from hfsdp.bench import flops


def shape(**fields: object) -> argparse.Namespace:
    """Parsed flags with Megatron's defaults for what the formula reads."""
    base = dict(hidden_size=64, seq_length=32, num_attention_heads=4, kv_channels=None, group_query_attention=False,
                num_query_groups=None, swiglu=False, ffn_hidden_size=256, hybrid_layer_pattern=None, num_layers=2,
                num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None,
                moe_shared_expert_intermediate_size=None, mamba_num_heads=None, mamba_head_dim=16,
                mamba_num_groups=2, mamba_state_dim=8, vocab_size=1000, make_vocab_size_divisible_by=128,
                tensor_model_parallel_size=1)
    base.update(fields)
    return argparse.Namespace(**base)


def test_a_dense_gpt_is_counted_layer_by_layer() -> None:
    h, s, f, v = 64, 32, 256, 1024  # 1000 padded to a multiple of 128
    attention = 2 * h * (3 * h) + 2 * h * h + 4 * s * h
    mlp = 4 * h * f
    m = flops.model_flops(shape())
    assert (m.attention, m.mlp, m.moe, m.mamba, m.output) == (2 * attention, 2 * mlp, 0, 0, 2 * h * v)
    assert m.training == 3 * m.forward == 3 * (2 * attention + 2 * mlp + 2 * h * v)


def test_grouped_queries_gated_mlps_and_tensor_parallel_vocab() -> None:
    h, s, f = 64, 32, 256
    m = flops.model_flops(shape(group_query_attention=True, num_query_groups=2, swiglu=True,
                                tensor_model_parallel_size=2))
    assert m.attention == 2 * (2 * h * (h + 2 * 32) + 2 * h * h + 4 * s * h)  # kv = 2 groups x 16 channels
    assert m.mlp == 2 * 6 * h * f
    assert m.output == 2 * h * 1024  # 1000 padded to a multiple of 128 x 2


def test_moe_counts_the_router_and_the_routed_experts_only() -> None:
    h, e, k, f = 64, 8, 2, 32
    m = flops.model_flops(shape(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=f,
                                hybrid_layer_pattern="*E"))
    assert m.moe == 2 * h * e + k * 4 * h * f
    shared = flops.model_flops(shape(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=f,
                                     moe_shared_expert_intermediate_size=48, hybrid_layer_pattern="*E"))
    assert shared.moe == m.moe + 4 * h * 48


def test_a_mamba_layer_counts_projections_conv_and_the_chunked_scan() -> None:
    h = 64
    d, heads, g, n = 2 * h, 2 * h // 16, 2, 8
    m = flops.model_flops(shape(hybrid_layer_pattern="MM*-/"))
    per_layer = (2 * h * (2 * d + 2 * g * n + heads) + 2 * 4 * (d + 2 * g * n) + 2 * 128 * (g * n + d)
                 + 4 * n * d + 2 * d * h)
    assert m.mamba == 2 * per_layer and m.attention > 0 and m.mlp > 0
    assert flops.layer_symbols(shape(hybrid_layer_pattern="M*/E-")) == "M*"  # the first pipeline part only


@pytest.mark.parametrize(("device", "given", "expected"), [
    ("NVIDIA H100 80GB HBM3", None, 989e12), ("NVIDIA H200", None, 989e12), ("NVIDIA A10", None, None),
    (None, None, None), ("NVIDIA A10", 125.0, 125e12),
])
def test_the_peak_is_known_for_h100_and_h200_or_given(device, given, expected) -> None:
    assert flops.peak_flops(device, given) == expected


def test_mfu_is_per_gpu() -> None:
    assert flops.mfu(4000.0, 4, 1e12, 1e15) == pytest.approx(1.0)
    assert flops.mfu(4000.0, 4, 1e12, None) is None


@pytest.mark.parametrize("device, expected", [("NVIDIA H200", 1979e12), ("NVIDIA H100 80GB HBM3", 1979e12),
                                              ("NVIDIA A100", None)])
def test_the_fp8_peak_is_twice_the_bf16_one_on_hopper(device, expected) -> None:
    assert flops.peak_flops(device, fp8=True) == expected
    if expected is not None:
        assert expected / flops.peak_flops(device) == 1979 / 989
