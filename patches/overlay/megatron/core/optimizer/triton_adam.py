# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Adam's update for large tensors in a Triton kernel with vector loads, bit for bit TE's.

[Note: Triton Adam]
Adam is memory-bound: with fp32 main weights and moments, bf16 gradients and a bf16 model weight
written in the update ([Note: Adam writes the model weights]) it moves 28 bytes a parameter. TE's
``multi_tensor_adam`` loads and stores one element per thread at a time. :func:`apply` takes a
``multi_tensor_adam`` call's lists (``[g, p, m, v]`` or ``[g, model, m, v, main]``) and its
arguments, and updates each tensor of at least :data:`MIN_NUMEL` elements whose tensors are all
contiguous, on one CUDA device, with one launch of :func:`_adam`, which loads and stores 16-byte
vectors; the other tensors go to TE's kernel in one call, as before.

A clip coefficient handed to :func:`apply` (``scale``, a device tensor) is applied as TE's
``multi_tensor_scale_tensor`` applies it before the step (the product in fp32, stored in the
gradient's dtype), but in the update's own pass: the large tensors' gradients are read once and
not written; the small ones are scaled by ``scale_kernel`` first. The large tensors' gradient
buffers then keep their unclipped values.

Invariants:

* Same bits as TE's ``multi_tensor_adam``. The kernel does TE's ``adam_update`` in fp32: the fused
  multiply-adds nvcc forms are written out (``tl.fma``); TE's library is built with fast division
  and square root, which Triton's ``/`` and ``tl.sqrt`` are too (``div.full``, ``sqrt.approx``);
  no other operation is fused (``enable_fp_fusion=False``); every result and operand is flushed
  to zero where it is subnormal (``ftz``), as fast math does. The bias corrections are computed on
  the host as TE's host code computes them (``1 - pow(double(float(beta)), step)``, stored as fp32).
  The model weight is the updated main weight rounded to nearest even, as the cast in TE's kernel.
  The GPU test holds every case to TE's bits.
* Only what TE's call would do: Adam (L2, mode 0) or AdamW (mode 1); gradients and weights fp32,
  bf16 or fp16, moments fp32 or bf16, a fifth list of fp32 main weights, all contiguous on one
  device (:func:`refusal` says why a tensor stays on TE's kernel). No Triton: TE's kernel for all.
* ``HFSDP_TE_ADAM_KERNEL=1`` keeps every tensor on TE's kernel, for comparisons.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

TE_KERNEL_ENV = "HFSDP_TE_ADAM_KERNEL"
MIN_NUMEL = 1 << 16  # smaller tensors cost a launch each for little traffic: they stay in TE's one call
_BLOCK = 1024
_MOMENTS = (torch.float32, torch.bfloat16)

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: TE's kernel (if any) does everything
    triton = None

if triton is not None:
    @triton.jit
    def ftz(x):
        """Flush a subnormal to a zero of its sign, as TE's kernels (built with --use_fast_math) do."""
        return tl.where(tl.abs(x) < 1.1754943508222875e-38, x * 0.0, x)

    @triton.jit
    def _adam(g_ptr, p_ptr, m_ptr, v_ptr, w_ptr, n, lr, beta1, beta2, bc1, bc2, eps, decay, scale_ptr,
              ADAMW: tl.constexpr, WRITE_MODEL: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask)
        if SCALED:  # TE's multi_tensor_scale_tensor before the update: the product, in the gradient's dtype
            g = ftz(ftz(g.to(tl.float32)) * tl.load(scale_ptr)).to(g_ptr.dtype.element_ty)
        g = ftz(g.to(tl.float32))
        p = ftz(tl.load(p_ptr + offs, mask=mask).to(tl.float32))
        m = ftz(tl.load(m_ptr + offs, mask=mask).to(tl.float32))
        v = ftz(tl.load(v_ptr + offs, mask=mask).to(tl.float32))
        if not ADAMW:
            g = ftz(tl.fma(decay, p, g))  # r_g + decay * r_p
        m = ftz(tl.fma(beta1, m, ftz((1.0 - beta1) * g)))  # beta1 * r_m + (1 - beta1) * r_g
        v = ftz(tl.fma(beta2, v, ftz(ftz((1.0 - beta2) * g) * g)))  # beta2 * r_v + (1 - beta2) * r_g * r_g
        denom = ftz(ftz(tl.sqrt(ftz(v / bc2))) + eps)
        update = ftz(ftz(m / bc1) / denom)
        if ADAMW:
            update = ftz(tl.fma(decay, p, update))  # next_m_unbiased / denom + decay * r_p
        p = ftz(tl.fma(-lr, update, p))  # r_p - lr * update
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
        if WRITE_MODEL:
            tl.store(w_ptr + offs, p.to(w_ptr.dtype.element_ty), mask=mask)


def bias_corrections(beta1: float, beta2: float, step: int, bias_correction: int) -> tuple[float, float]:
    """TE's host code: ``1 - std::pow(beta, step)`` of the fp32 beta in double, stored as fp32."""
    if bias_correction != 1:
        return 1.0, 1.0
    return _f32(1.0 - _f32(beta1) ** step), _f32(1.0 - _f32(beta2) ** step)


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return triton is not None and environ.get(TE_KERNEL_ENV) != "1"


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def refusal(tensors: Sequence[torch.Tensor], device: torch.device) -> str | None:
    """Why one tensor's ``[g, p, m, v]`` or ``[g, model, m, v, main]`` stays on TE's kernel, or None."""
    g, p, m, v = tensors[:4]
    if g.numel() < MIN_NUMEL:
        return f"{g.numel()} elements, fewer than {MIN_NUMEL}"
    if any(t.numel() != g.numel() for t in tensors):
        return "lists of different sizes"
    if g.dtype not in _FLOATS or p.dtype not in _FLOATS or m.dtype not in _MOMENTS or v.dtype != m.dtype:
        return f"dtypes {[t.dtype for t in tensors]}"
    if len(tensors) == 5 and tensors[4].dtype != torch.float32:
        return f"main weights in {tensors[4].dtype}, not fp32"
    if not all(t.is_contiguous() for t in tensors):
        return "not contiguous"
    if not all(t.is_cuda and t.device == device for t in tensors):
        return f"not all on {device}"
    return None


def apply(kernel: Callable[..., Any], chunk_size: int, noop: torch.Tensor, lists: list[list[torch.Tensor]],
          lr: float, beta1: float, beta2: float, eps: float, step: int, mode: int, bias_correction: int,
          weight_decay: float, *rest: Any, scale: torch.Tensor | None = None,
          scale_kernel: Callable[..., Any] | None = None, environ: Mapping[str, str] = os.environ) -> None:
    """TE's ``multi_tensor_adam(chunk_size, noop, lists, lr, ...)``, large tensors through :func:`_adam`;
    with ``scale`` (one fp32 element on the device), the gradients are first scaled as ``scale_kernel``
    (TE's ``multi_tensor_scale_tensor``) scales them."""
    if scale is not None and scale_kernel is None:
        raise ValueError(f"a gradient scale ({scale}) needs the multi_tensor_scale kernel that applies it")
    args = (lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay, *rest)
    big: list[int] = []
    if enabled(environ) and mode in (0, 1) and not rest and lists and lists[0] and len(lists) in (4, 5):
        device = lists[0][0].device
        big = [j for j, tensors in enumerate(zip(*lists, strict=True)) if refusal(tensors, device) is None]
    if len(big) < len(lists[0]):
        taken = set(big)
        small = [[tensors[j] for j in range(len(tensors)) if j not in taken] for tensors in lists]
        if scale is not None and scale_kernel is not None:  # both or neither (checked above)
            # A flag of its own, as Megatron's clip has: the scale sets it on a non-finite gradient.
            flag = torch.zeros(1, dtype=torch.int, device=small[0][0].device)
            scale_kernel(chunk_size, flag, [small[0], small[0]], scale)
        kernel(chunk_size, noop, small, *args)
    if not big:
        return
    bc1, bc2 = bias_corrections(beta1, beta2, step, bias_correction)
    write_model = len(lists) == 5
    with torch.cuda.device(lists[0][big[0]].device):  # Triton launches on the current device
        for j in big:
            g, first, m, v = (tensors[j] for tensors in lists[:4])
            main, model = (lists[4][j], first) if write_model else (first, first)
            n = g.numel()
            _adam[(triton.cdiv(n, _BLOCK),)](
                g, main, m, v, model, n, lr, beta1, beta2, bc1, bc2, eps, weight_decay,
                g if scale is None else scale, ADAMW=mode == 1, WRITE_MODEL=write_model, SCALED=scale is not None,
                BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)
