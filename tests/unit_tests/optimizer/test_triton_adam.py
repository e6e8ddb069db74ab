"""What the Triton Adam ([Note: Triton Adam]) leaves to TE's kernel, and its host-side numbers, on the CPU.
Its bits against TE's kernel are held on a GPU (test_triton_adam_gpu.py)."""

from __future__ import annotations

import struct

import pytest
import torch

from megatron.core.optimizer import triton_adam

ARGS = (1e-2, 0.9, 0.95, 1e-8, 3, 1, 1, 0.1)  # lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.mark.parametrize("step", [1, 2, 10, 1000])
def test_bias_corrections_are_te_host_code_values(step):
    # TE: float bias_correction1 = 1 - std::pow(beta1, step), beta1 a float: pow in double, stored as float.
    assert triton_adam.bias_corrections(0.9, 0.95, step, 1) == (f32(1 - f32(0.9) ** step), f32(1 - f32(0.95) ** step))
    assert triton_adam.bias_corrections(0.9, 0.95, step, 0) == (1.0, 1.0)


def lists(n: int = 3):
    return [[torch.ones(70_000 + j) for j in range(n)] for _ in range(4)]


def test_tensors_triton_cannot_take_go_to_te_kernel_in_one_call_after_the_scale():
    calls: list[tuple[str, int]] = []
    ls = lists()

    def kernel(chunk_size, noop, tensor_lists, *args):
        assert args == ARGS
        calls.append(("adam", len(tensor_lists[0])))

    def scale_kernel(chunk_size, noop, tensor_lists, scale):
        assert tensor_lists[0] == ls[0] and tensor_lists[1] == ls[0]  # the gradients, in place
        calls.append(("scale", len(tensor_lists[0])))

    triton_adam.apply(kernel, 2048, torch.zeros(1), ls, *ARGS, scale=torch.tensor([0.5]), scale_kernel=scale_kernel)
    assert calls == [("scale", 3), ("adam", 3)]  # CPU tensors: none fits the Triton kernel
    calls.clear()
    triton_adam.apply(kernel, 2048, torch.zeros(1), ls, *ARGS, environ={triton_adam.TE_KERNEL_ENV: "1"})
    assert calls == [("adam", 3)]


def test_a_scale_without_its_kernel_is_refused():
    with pytest.raises(ValueError, match="needs the multi_tensor_scale kernel"):
        triton_adam.apply(lambda *a: None, 2048, torch.zeros(1), lists(), *ARGS, scale=torch.tensor([0.5]))


def test_the_switch_keeps_te_kernel():
    assert not triton_adam.enabled({triton_adam.TE_KERNEL_ENV: "1"})


def test_refusal_says_why_a_tensor_stays_on_te_kernel():
    n, cpu = triton_adam.MIN_NUMEL, torch.device("cpu")

    def t(dtype=torch.float32, numel=n):
        return torch.zeros(numel, dtype=dtype)

    def why(*tensors):
        return triton_adam.refusal(tensors, cpu)

    assert "fewer than" in why(t(numel=n - 1), t(), t(), t())
    assert "different sizes" in why(t(), t(numel=n + 1), t(), t())
    assert "dtypes" in why(t(torch.float64), t(), t(), t())
    assert "dtypes" in why(t(), t(torch.uint8), t(), t())
    assert "dtypes" in why(t(), t(), t(), t(torch.bfloat16))  # moments of two dtypes
    assert "not fp32" in why(t(torch.bfloat16), t(torch.bfloat16), t(), t(), t(torch.bfloat16))
    assert "not contiguous" in why(torch.zeros(2 * n)[::2], t(), t(), t())
    assert "not all on cpu" in why(t(), t(), t(), t())  # every check passed but the device: CPU tensors
