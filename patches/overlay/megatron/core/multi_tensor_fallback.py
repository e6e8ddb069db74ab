# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Multi-tensor L2 norm and scale without Transformer Engine or Apex, with fewer host stalls.

[Note: one device-to-host copy for the fallback gradient norm]
Without TE or Apex, Megatron computes the gradient norm with ``local_multi_tensor_l2_norm``:
one ``torch.norm`` per tensor on the GPU, then ``torch.tensor(norms)`` to reduce them on the
host. ``torch.tensor`` reads a list of CUDA tensors one ``item()`` at a time, so the step makes
one blocking device-to-host copy per gradient (a profile of the default 236M hybrid counted 207
synchronizing calls per step, 22 with this module). The first copy waits for the backward pass;
each later one waits for the host, while the GPU idles.
Under a full-iteration CUDA graph, whose replay leaves the host free, those stalls add to every
step.

:func:`l2_norm` stacks the per-tensor norms on the device and copies them to the host once.
The host tensor has the same dtype, shape and values as ``torch.tensor(norms)`` made, so the
host reduction, and with it the norm, is the same to the bit.

[Note: one foreach launch for the fallback scale]
``local_multi_tensor_scale`` launches two kernels per tensor (``src * scale``, then
``dst.copy_``). Gradient clipping calls it in place on fp32 gradients; :func:`scale` then makes
one ``torch._foreach_mul_``, which rounds ``src * scale`` as ``mul`` does for fp32 and fp64 (NaN,
inf and subnormals included). Other calls keep the per-tensor loop: for bf16 and fp16, CPU
foreach kernels round differently; an out-of-place foreach would hold every temporary at once;
and a foreach copy for ``scale == 1`` would keep NaN payloads that ``src * 1`` rewrites. Source
and destination lists of different lengths are an error (the loop's ``zip`` dropped the extras).
"""

from collections.abc import Sequence

import torch

# In-place foreach multiply gives mul's bits for these on CPU and GPU (the tests check both).
_FOREACH_SCALE_DTYPES = (torch.float32, torch.float64)


def _host_norms(norms: list[list[torch.Tensor]]) -> torch.Tensor:
    """``torch.tensor(norms)``, with one device-to-host copy instead of one per element."""
    flat = [norm for row in norms for norm in row]
    rectangular = len({len(row) for row in norms}) <= 1
    one_device = len({norm.device for norm in flat}) == 1
    if not flat or not rectangular or not one_device:
        return torch.tensor(norms)  # nothing to copy, or a layout torch.tensor itself rejects
    # torch.stack promotes mixed dtypes as torch.tensor does
    # (tests/unit_tests/optimizer/test_multi_tensor_fallback.py checks dtype, shape and bits).
    return torch.stack(flat).cpu().reshape(len(norms), -1)


def total_norm(tensor_lists: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The L2 norm of all tensors of ``tensor_lists``, reduced on the host (a 0-dim CPU tensor)."""
    norms = [[torch.norm(tensor) for tensor in tensor_list] for tensor_list in tensor_lists]
    return torch.norm(_host_norms(norms))


def l2_norm(chunk_size: int, noop_flag, tensor_lists: Sequence[Sequence[torch.Tensor]],
            per_tensor: bool, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm`` (global norm only), as the fallback computes it."""
    return torch.tensor([float(total_norm(tensor_lists))], dtype=torch.float, device="cuda"), None


def scale(chunk_size: int, noop_flag, tensor_lists: Sequence[Sequence[torch.Tensor]], scale):
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for each pair."""
    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])
    if len(srcs) != len(dsts):
        raise ValueError(f"scale: {len(srcs)} sources for {len(dsts)} destinations")
    if not srcs:
        return
    if all(src is dst and src.dtype in _FOREACH_SCALE_DTYPES for src, dst in zip(srcs, dsts, strict=True)):
        torch._foreach_mul_(dsts, scale)
    else:
        for src, dst in zip(srcs, dsts, strict=True):
            dst.copy_(src * scale)
