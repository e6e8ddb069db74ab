"""On a GPU with Transformer Engine and Triton: the Triton gradient norm ([Note: Triton l2norm]) gives the bits of
TE's multi_tensor_l2norm, and sets its noop flag where TE sets it; Megatron's get_grad_norm_fp32 gives the same
bits with the switch on and off."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron.core.optimizer import triton_l2norm as tn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None or tn.triton is None,
    reason="needs a GPU, Transformer Engine and Triton")]

MEGATRON_CHUNK = 2048 * 32


def buffer(n: int, dtype: torch.dtype, seed: int, spread: float = 2.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    magnitude = torch.exp(torch.randn(n, device="cuda", generator=g) * spread) * 1e-3
    return (torch.randn(n, device="cuda", generator=g) * magnitude).to(dtype)


def views(flat: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [flat[start:start + n] for start, n in spans]


def packed(sizes: list[int], pad: int = 64) -> list[tuple[int, int]]:
    """Consecutive spans, each start rounded up to ``pad`` elements, as gradient buckets lay them out."""
    spans, start = [], 0
    for n in sizes:
        spans.append((start, n))
        start = -(-(start + n) // pad) * pad
    return spans


# Shapes of a hybrid model's gradients: projections, norms, biases, an embedding (elements).
MODEL = [50304 * 1024, 1024, 3 * 1024 * 1024, 1024 * 1024, 1024, 4 * 1024 * 1024, 4 * 1024 * 1024, 1024, 2 * 1024,
         8 * 1024 * 512, 64, 8, 1024 * 4 + 3] * 3
SPANS = {
    "model": packed(MODEL),
    "starts": [(0, 70_000), (70_001, 65_537), (135_540, 131_074), (266_620, 9), (266_630, 200_002)],  # 2, 4, 8 bytes
    "many": packed([3000 + 911 * t for t in range(140)]),  # past 110 tensors and 320 chunks
}


def te(tensors: list[torch.Tensor], chunk_size: int) -> tuple[torch.Tensor, int]:
    import transformer_engine_torch as tex

    noop = torch.zeros(1, dtype=torch.int, device="cuda")
    ret, _ = tex.multi_tensor_l2norm(chunk_size, noop, [tensors], False)
    return ret, int(noop.item())


def triton(tensors: list[torch.Tensor], chunk_size: int) -> tuple[torch.Tensor, int]:
    noop = torch.zeros(1, dtype=torch.int, device="cuda")
    assert tn.refusal(chunk_size, noop, [tensors], (False,)) is None
    ret = tn.norm(tensors, chunk_size, noop)
    return ret, int(noop.item())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.view(torch.int32) == b.view(torch.int32)).all()) or bool(a.isnan().all() and b.isnan().all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("layout", sorted(SPANS))
@pytest.mark.parametrize("chunk_size", [MEGATRON_CHUNK, 2048])
def test_triton_norm_gives_te_bits(dtype, layout, chunk_size):
    spans = SPANS[layout]
    end = max(start + n for start, n in spans)
    for seed in range(4):
        tensors = views(buffer(end, dtype, seed, spread=1.0 if dtype == torch.float16 else 2.0), spans)
        (want, want_noop), (got, got_noop) = te(tensors, chunk_size), triton(tensors, chunk_size)
        assert same_bits(got, want), (seed, got.item(), want.item())
        assert got_noop == want_noop == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("special", ["subnormal", "overflow", "inf", "nan"])
def test_flushes_and_non_finite_values_as_te(special, dtype):
    flat = buffer(470_000, dtype, 11)
    if special == "subnormal":  # subnormal values, squares below fp32's normal range, beside ordinary values
        flat[:100_000] = 1e-39
        flat[100_000:200_000] = 3e-20
        flat[200_000:300_000] = 1e-19
    elif special == "overflow":  # finite values whose squares are not
        flat[123_457:123_460] = 1e20
    else:
        flat[123_457] = float(special)
    tensors = views(flat, SPANS["starts"])
    (want, want_noop), (got, got_noop) = te(tensors, MEGATRON_CHUNK), triton(tensors, MEGATRON_CHUNK)
    assert same_bits(got, want), (got.item(), want.item())
    assert got_noop == want_noop == (special != "subnormal")


def test_megatron_grad_norm_is_the_same_with_the_switch(monkeypatch):
    from megatron.core.optimizer import clip_grads

    tensors = views(buffer(70_000_000, torch.bfloat16, 5), SPANS["model"][:12])
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)  # one process, no group
    calls = []
    real = tn.norm
    monkeypatch.setattr(tn, "norm", lambda *a: calls.append(1) or real(*a))
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(tn.ENV, switch)
        noop = torch.zeros(1, dtype=torch.int, device="cuda")
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, noop, [list(tensors)], False)
        total = clip_grads.get_grad_norm_fp32(tensors)
        results[switch] = (norm.view(torch.int32).item(), total.view(torch.int32).item())
    assert calls == [1, 1]  # the Triton norm ran with the switch on, for the direct call and Megatron's
    assert results["1"] == results["0"]
