"""On a GPU with Transformer Engine and Triton: the Triton Adam ([Note: Triton Adam]) gives the bits of TE's
multi_tensor_adam, with and without the clip coefficient applied in the update, subnormals included; and
FusedAdam with the deferred clip gives the bits of Megatron's clip followed by FusedAdam's step."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron.core.optimizer import adam_model_writes as amw
from megatron.core.optimizer import triton_adam

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None
    or triton_adam.triton is None, reason="needs a GPU, Transformer Engine and Triton")]

SIZES = (1000, triton_adam.MIN_NUMEL, 70_001, (1 << 20) + 3)  # one below the Triton threshold


def tensors(grad_dtype, moments, master: bool, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(n, scale, dtype=torch.float32):
        t = torch.randn(n, device="cuda", generator=gen) * scale
        t[: n // 8] *= 1e-36  # subnormal and tiny values: TE's fast math flushes them
        t[n // 8: n // 8 + 3] = 0.0
        return t.to(dtype)

    main = [randn(n, 0.02) for n in SIZES]
    model = [w.to(torch.bfloat16) for w in main]
    m = [randn(n, 1e-3, moments) for n in SIZES]
    v = [randn(n, 1e-5, moments).abs() for n in SIZES]
    g = [randn(n, 1.0, grad_dtype) for n in SIZES]
    return [g, model, m, v, main] if master else [g, main, m, v]


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize(("grad_dtype", "moments", "master"), [
    (torch.bfloat16, torch.float32, True), (torch.float32, torch.float32, True), (torch.bfloat16, torch.bfloat16, True),
    (torch.bfloat16, torch.float32, False)])
@pytest.mark.parametrize("scaled", [False, True])
def test_triton_adam_gives_te_bits(mode, grad_dtype, moments, master, scaled):
    import transformer_engine_torch as tex

    ref, got = tensors(grad_dtype, moments, master, 0), tensors(grad_dtype, moments, master, 0)
    device = torch.device("cuda", torch.cuda.current_device())
    assert [triton_adam.refusal(t, device) is None for t in zip(*got, strict=True)] == [False, True, True, True]
    te_calls: list[list[int]] = []

    def te_kernel(chunk_size, flag, lists, *args):  # TE's kernel, recording which tensors reach it
        te_calls.append([t.numel() for t in lists[0]])
        return tex.multi_tensor_adam(chunk_size, flag, lists, *args)

    noop = torch.zeros(1, dtype=torch.int, device="cuda")
    scale = torch.tensor([0.37], device="cuda") if scaled else None
    for step in (1, 2, 3):
        args = (1e-2, 0.9, 0.95, 1e-8, step, mode, 1, 0.1)
        fresh = tensors(grad_dtype, moments, master, step)[0]  # each step's gradients (the scale writes TE's)
        for a, b, new in zip(ref[0], got[0], fresh, strict=True):
            a.copy_(new)
            b.copy_(new)
        if scaled:
            tex.multi_tensor_scale_tensor(2048 * 32, noop, [ref[0], ref[0]], scale)
        tex.multi_tensor_adam(2048 * 32, noop, ref, *args)
        triton_adam.apply(te_kernel, 2048 * 32, noop, got, *args, scale=scale,
                          scale_kernel=tex.multi_tensor_scale_tensor, environ={})
    torch.cuda.synchronize()
    assert te_calls == [[SIZES[0]]] * 3  # the others went through Triton
    names = ("model", "m", "v", "main") if master else ("p", "m", "v")
    for name, a_list, b_list in zip(names, ref[1:], got[1:], strict=True):
        for a, b in zip(a_list, b_list, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} of {a.numel()} elements differs"


def test_fused_adam_with_the_deferred_clip_gives_the_bits_of_megatron_clip(pair_buffer):
    from transformer_engine.pytorch.optimizers import FusedAdam

    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    def run(deferred: bool):
        torch.manual_seed(0)
        mains = [torch.nn.Parameter(torch.randn(n, device="cuda") * 0.02) for n in SIZES]
        models = [w.detach().to(torch.bfloat16) for w in mains]
        opt = FusedAdam(mains, lr=1e-2, weight_decay=0.1, use_decoupled_grad=True)
        env = {} if deferred else {amw.SEPARATE_CLIP_ENV: "1"}
        writes = amw.install(opt, [pair_buffer([(m, w.detach()) for m, w in zip(models, mains, strict=True)])], env)
        assert writes is not None
        for _ in range(3):
            for p in mains:
                p.decoupled_grad = torch.randn(p.shape, device="cuda").to(torch.bfloat16)
            norm = torch.linalg.vector_norm(torch.cat([p.decoupled_grad.float() for p in mains])).reshape(1)
            if not amw.defer_clip(opt, 1.0, norm):
                assert not deferred
                clip_grad_by_total_norm_fp32(mains, 1.0, norm, use_decoupled_grad=True)
            assert (writes.grad_scale is not None) == deferred
            opt.step()
            assert writes.grad_scale is None
            writes.unwritten([])
        torch.cuda.synchronize()
        return [*mains, *models, *(opt.state[p][k] for p in mains for k in ("exp_avg", "exp_avg_sq"))]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)
