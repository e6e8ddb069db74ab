"""On a GPU with Transformer Engine: FusedAdam with the model-weight writes gives the bits of FusedAdam followed by
the main-to-model copy ([Note: Adam writes the model weights]), for the precision-aware optimizer's bf16 decoupled
gradients, fp32 gradients and bf16 moments."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp.foreach_copy import copy_all
from megatron.core.optimizer import adam_model_writes as amw

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs a GPU and Transformer Engine")]


def run(pair_buffer, fused: bool, grad_dtype: torch.dtype, moments: torch.dtype):
    from transformer_engine.pytorch.optimizers import FusedAdam

    torch.manual_seed(0)
    sizes = (1000, 37, 70000, 4096)
    mains = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in sizes]
    models = [w.detach().to(torch.bfloat16) for w in mains]
    decoupled = grad_dtype != torch.float32
    opt = FusedAdam(mains, lr=1e-2, weight_decay=0.1, use_decoupled_grad=decoupled,
                    exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    pairs = [(model, main.detach()) for model, main in zip(models[:3], mains[:3], strict=True)]  # the last: none
    buffer = pair_buffer(pairs)
    initial = [m.clone() for m in models]
    writes = amw.install(opt, [buffer], {}) if fused else None
    assert (writes is not None) == fused
    for _ in range(3):
        for p in mains:
            g = torch.randn(p.shape, device="cuda").to(grad_dtype)
            if decoupled:
                p.decoupled_grad = g
            else:
                p.grad = g
        opt.step()
        left = writes.unwritten(pairs) if writes else pairs
        assert len(left) == (0 if fused else 3)  # the update wrote every model weight: nothing left to copy
        copy_all(left)
    torch.cuda.synchronize()
    states = [opt.state[p][k] for p in mains for k in ("exp_avg", "exp_avg_sq")]
    for model, main, before in zip(models[:3], mains[:3], initial[:3], strict=True):  # each model weight moved
        assert torch.equal(model, main.detach().to(torch.bfloat16)) and not torch.equal(model, before)
    return [m.detach().clone() for m in mains], [m.clone() for m in models], [s.clone() for s in states]


@pytest.mark.parametrize(("grad_dtype", "moments"), [
    (torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_fused_model_writes_give_the_bits_of_the_separate_copy(grad_dtype, moments, pair_buffer):
    fused, plain = run(pair_buffer, True, grad_dtype, moments), run(pair_buffer, False, grad_dtype, moments)
    for got, want in zip(fused, plain, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
