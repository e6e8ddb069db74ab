"""CPU tests of tensor-parallel-fsdp-wgrad-fusion-apex.patch: with --gradient-accumulation-fusion, a local
linear layer's weight gradient goes into Megatron-FSDP's main_grad through Apex's kernel when TE is absent.

The kernel is a stand-in with Apex's contract (``wgrad_gemm_accum_fp32/fp16(input, grad_output, out)``:
out += grad_output^T @ input, accumulated in out's dtype); the main_grad bucket starts as garbage, as a
recycled double-buffer bucket does, so a kernel that accumulates without the zeroing gives a wrong gradient.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from megatron.core.tensor_parallel import layers

CALLS: list[str] = []


def _accum(name: str):
    def kernel(total_input: torch.Tensor, grad_output: torch.Tensor, out: torch.Tensor) -> None:
        CALLS.append(name)
        out.add_((grad_output.float().t() @ total_input.float()).to(out.dtype))
    return kernel


@pytest.fixture
def apex_kernel(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    CALLS.clear()
    stand_in = types.SimpleNamespace(wgrad_gemm_accum_fp32=_accum("fp32"), wgrad_gemm_accum_fp16=_accum("fp16"))
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", stand_in, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    from megatron.core.extensions import transformer_engine
    monkeypatch.setattr(transformer_engine, "te_general_gemm", None)  # TE absent
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where Megatron puts its dummy wgrad
    return CALLS


def _linear(x: torch.Tensor, weight: torch.Tensor, fusion: bool) -> torch.Tensor:
    """LinearWithGradAccumulationAndAsyncCommunication, no bias, TP of 1, as the public wrapper calls it; arguments
    a later release adds take their wrapper's default (0.19.2's gtp_remat_size: 1, no GTP sharding)."""
    fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    later = list(inspect.signature(fn.forward).parameters)[10:]  # ctx and the nine arguments 0.18.2 has
    defaults = inspect.signature(layers.linear_with_grad_accumulation_and_async_allreduce).parameters
    return fn.apply(x, weight, None, fusion, False, False, None, None, None, *(defaults[n].default for n in later))


def _fsdp_weight(main_grad_dtype: torch.dtype) -> tuple[torch.nn.Parameter, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16))
    bucket = torch.full((6, 4), 7.0, dtype=main_grad_dtype)  # a recycled bucket: not zero
    weight.__fsdp_param__ = True
    weight.get_main_grad = lambda: bucket
    return weight, bucket


@pytest.mark.parametrize(("dtype", "kernel"), [(torch.float32, "fp32"), (torch.bfloat16, "fp16")])
def test_fsdp_main_grad_gets_apex_kernel_over_a_zeroed_bucket(apex_kernel: list[str], dtype: torch.dtype,
                                                             kernel: str) -> None:
    weight, bucket = _fsdp_weight(dtype)
    x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    out = _linear(x, weight, True)
    grad_output = torch.randn_like(out)
    out.backward(grad_output)
    assert apex_kernel == [kernel], apex_kernel
    expected = (grad_output.float().t() @ x.detach().float()).to(dtype)
    assert torch.equal(bucket, expected), (bucket, expected)
    assert weight.main_grad is bucket
    assert weight.grad is None  # no grad_added_to_main_grad attribute here: Megatron returns no wgrad


@pytest.mark.parametrize("case", ["unsharded buffer", "second use in one backward"])
def test_the_kernel_adds_where_main_grad_already_holds_this_backwards_gradient(apex_kernel: list[str],
                                                                              case: str) -> None:
    """An unsharded grad buffer accumulates micro-batches; a weight used twice in one backward (e.g. with MTP) gets
    both uses' gradients: neither is zeroed before the kernel adds."""
    weight, bucket = _fsdp_weight(torch.float32)
    if case == "unsharded buffer":
        weight._gbuf = types.SimpleNamespace(is_data_distributed=False)
    else:
        weight._gbuf = types.SimpleNamespace(is_data_distributed=True)
        weight.grad_added_to_main_grad = True
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    out = _linear(x, weight, True)
    grad_output = torch.randn_like(out)
    out.backward(grad_output)
    assert apex_kernel == ["fp32"], apex_kernel
    assert torch.equal(bucket, 7.0 + grad_output.float().t() @ x.float()), bucket


def test_without_fusion_the_kernel_is_not_used(apex_kernel: list[str]) -> None:
    weight, bucket = _fsdp_weight(torch.float32)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    out = _linear(x, weight, False)
    out.backward(torch.ones_like(out))
    assert apex_kernel == [] and weight.grad is not None
    assert torch.all(bucket == 7.0)
